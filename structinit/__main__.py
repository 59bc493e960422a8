"""``python -m structinit`` runs the CLI."""

import os
import sys


def _real_package() -> None:
    """Run from a folder that holds a folder named ``structinit`` (a clone of the repository, say),
    ``import structinit`` finds that folder first as a namespace package when the real one is
    installed in editable mode, and nothing of ``structinit/__init__.py`` runs. Put the package
    this file belongs to in its place."""
    import importlib.util

    pkg = sys.modules.get("structinit")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("structinit", os.path.join(here, "__init__.py"),
                                                  submodule_search_locations=[here])
    # A path to a .py file always has a spec with a loader.
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["structinit"] = module
    spec.loader.exec_module(module)


def _stop_early() -> None:
    """``bench run`` and ``train`` stop cleanly on SIGTERM (``bench run`` on SIGUSR2 too): their
    handler goes in before the command line loads (a fraction of a second; seconds on a busy
    machine), so that a signal meanwhile is a stop request rather than the end of the process."""
    if sys.argv[1:2] in (["bench"], ["train"]):
        from structinit.experiments.task import install_process_stopper

        install_process_stopper(sys.argv[1:])


_real_package()
_stop_early()

from structinit.cli.app import run  # noqa: E402

if __name__ == "__main__":
    run()
