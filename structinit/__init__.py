"""structinit: convolutional structure for Vision Transformers through initialization alone.

The package root stays import-light (no torch, no timm) so that the CLI starts instantly.
Public entry points live in their own modules:

- :mod:`structinit.solve`        -- ``solve()``: Q/K for a shape and recipe, cached as safetensors
- :mod:`structinit.targets`      -- impulse offsets and target attention matrices
- :mod:`structinit.pseudo_input` -- 2-D sin-cos position embedding and the LayerNorm'd pseudo input
- :mod:`structinit.quality`      -- attention maps and solution quality measures
- :mod:`structinit.solvers`      -- the solver recipes (``fast``, ``paper``, ``released``, ``closed-form``)
- :mod:`structinit.artifact`     -- the safetensors artifact format
- :mod:`structinit.cache`        -- cache locations, look-up and atomic, concurrent-safe writes
"""

__version__ = "0.1.0"
