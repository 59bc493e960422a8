"""The ``structinit train`` command line that trains a run's config: what a task runs under
``torchrun``, and what ``bench grid --print`` shows.
"""

from __future__ import annotations

import json
import shlex
from typing import List, Optional

#: TrainConfig fields that ``structinit train`` has no flag for (execution settings only).
NO_FLAG = ("eval_batch_size",)


def train_command(config, program: Optional[List[str]] = None) -> List[str]:
    """``structinit train`` arguments that train ``config`` (its ``out``, with ``--resume``):
    every setting that differs from TrainConfig's default, ``init_params`` as ``--init-param``.
    ``program`` replaces the leading ``["structinit"]`` (e.g. ``[python, "-m", "structinit"]``)."""
    from structinit.training.config import TrainConfig

    defaults = TrainConfig().to_dict()
    args = (list(program) if program is not None else ["structinit"]) + ["train"]
    for name, value in config.to_dict().items():
        if name in ("out", "resume") or name in NO_FLAG:
            continue
        always = name in ("model", "dataset")
        flag = "--" + name.replace("_", "-")
        if name == "init_params":
            for k, v in sorted(value.items()):
                args += ["--init-param", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
        elif isinstance(value, bool):
            if value:
                args.append(flag)
        elif value is not None and (always or value != defaults[name]):
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
    if config.out:
        args += ["--out", str(config.out), "--resume"]
    return args


def shell_command(args: List[str]) -> str:
    return shlex.join(args)

