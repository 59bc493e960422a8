"""structinit: convolutional structure for transformers through initialization alone.

The package is organised by stage, in the order data flows (see ``docs/architecture.md``):

- :mod:`structinit.geometry`    -- token grids (1-D and 2-D), impulse targets, sin-cos embeddings, pseudo inputs
- :mod:`structinit.analysis`    -- quality measures of attention, layer inputs, as text and as figures
- :mod:`structinit.solver`      -- ``SolveConfig``, the solver recipes, the artifact format, the cache, ``solve()``
- :mod:`structinit.fit`         -- the impulse data fit: Q/K refined on each layer's inputs, its fitted artifacts
- :mod:`structinit.init`        -- init methods (typed specs), layouts, injection into models and checkpoints
- :mod:`structinit.training`    -- ``TrainConfig``, models, datasets, the training loop and its run directory
- :mod:`structinit.families`    -- one adapter per model family (timm, Hugging Face, ``nn.MultiheadAttention``, ours)
- :mod:`structinit.apply`       -- ``apply_checkpoint``: a checkpoint initialized through the model it describes
- :mod:`structinit.benchmarks`  -- stand-alone measurements: solver recipes, attention vs convolution, fit cost, loop
- :mod:`structinit.experiments` -- the paper's comparison as grids of training runs: launchers, status, reports
- :mod:`structinit.cli`         -- the ``structinit`` command line, a thin layer over all of the above

The names below are importable from the package root; none of them imports torch until used::

    from structinit import SolveConfig, solve
    art = solve(SolveConfig(grid=(16, 16), dim=192, heads=3, filter=3)).artifact
"""

from __future__ import annotations

import importlib
from typing import Any, List

__version__ = "0.3.0"

#: Public name -> the module that defines it (imported on first use).
_EXPORTS = {
    "Grid": "structinit.geometry.grid",
    "parse_grid": "structinit.geometry.grid",
    "SolveConfig": "structinit.solver.config",
    "solve": "structinit.solver.run",
    "compute": "structinit.solver.run",
    "SolveResult": "structinit.solver.run",
    "Artifact": "structinit.solver.artifact",
    "read_artifact": "structinit.solver.artifact",
    "resolve_artifact": "structinit.solver.cache",
    "InitSpec": "structinit.init.base",
    "init_spec": "structinit.init.registry",
    "parse_init": "structinit.init.registry",
    "initialize": "structinit.init.initialize",
    "initialize_model": "structinit.init.initialize",
    "InitReport": "structinit.init.report",
    "set_sincos_pos_embed": "structinit.init.pos_embed",
    "ModelFamily": "structinit.init.family",
    "InputSpec": "structinit.init.family",
    "register_family": "structinit.init.family",
    "apply_checkpoint": "structinit.apply.checkpoint",
    "ApplyOptions": "structinit.apply.options",
    "load_or_fit": "structinit.fit.artifact",
    "FitSettings": "structinit.fit.settings",
    "describe_checkpoint": "structinit.init.checkpoints",
    "TrainConfig": "structinit.training.config",
    "train": "structinit.training.loop",
    "TrainResult": "structinit.training.loop",
    "StructinitError": "structinit.errors",
    "UsageError": "structinit.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'structinit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return __all__
