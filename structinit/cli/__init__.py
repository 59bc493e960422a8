"""The ``structinit`` command line: one module per command, registered by :mod:`structinit.cli.app`.

Importing this package from the ``structinit`` console script (whose first line imports
:mod:`structinit.cli.app`) installs the stop handler of ``train`` and ``bench run`` before the
command line loads (:func:`stop_early`), as ``python -m structinit`` does: a SIGTERM in the
fraction of a second the command line takes to load is then a stop request with its documented
exit code and one line, not the end of the process by the signal."""

import os
import sys


def stop_early(argv=None) -> bool:
    """When ``argv`` (default ``sys.argv``) is the ``structinit`` program running ``train`` or
    ``bench ...``, install that command's stop handler now
    (:func:`structinit.experiments.stopping.install_process_stopper`); whether one was installed."""
    argv = sys.argv if argv is None else argv
    if not argv or os.path.basename(argv[0]) not in ("structinit", "structinit.exe") \
            or argv[1:2] not in (["bench"], ["train"]):
        return False
    from structinit.experiments.stopping import install_process_stopper

    return install_process_stopper(argv[1:]) is not None


stop_early()
