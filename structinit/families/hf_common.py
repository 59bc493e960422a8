"""What the Hugging Face families share (:mod:`~structinit.families.hf_vit`,
:mod:`~structinit.families.hf_bert`, :mod:`~structinit.families.hf_gpt2`): a checkpoint's model is
built by transformers from the ``config.json`` beside the weights (as ``save_pretrained`` writes
it) or ``config``, and transformers loads the weights itself; a model tells its heads through its
config (``num_attention_heads``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from structinit.atomic import NotRegularFile, atomic_write, read_regular
from structinit.errors import UsageError, param
from structinit.init.checkpoints import CONFIG_LIMIT, HF_CONFIG
from structinit.init.family import CheckpointModel, InputSpec, ModelFamily


class HfFamily(ModelFamily):
    """A Hugging Face family (registered by its module): transformers builds its models."""

    builds = True

    def heads(self, model) -> int:
        heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
        if isinstance(heads, int):
            return heads
        return super().heads(model)

    def checkpoint_hints(self, ckpt) -> None:
        hf_config_hints(ckpt)

    def unavailable(self) -> Optional[str]:
        return None if transformers_installed() else f"Hugging Face transformers, which is not installed ({HF_EXTRA})"

    def config_inputs(self, cfg: dict, grid, det) -> Tuple[InputSpec, Any]:
        """``(inputs, grid)`` of the model a ``config.json`` (``cfg``) describes, ``grid`` as given."""
        raise NotImplementedError

    def build(self, ckpt, sd, *, model_name=None, config=None, heads=None, grid=None) -> CheckpointModel:
        if model_name is not None:
            raise UsageError(f"{param('model_name')} names a timm model; the {ckpt.detected.layout.name} checkpoint's "
                             f"model comes from its config.json (or {param('config')})")
        return hf_model(ckpt, sd, config, grid, self)


def hf_config(ckpt, config: Optional[str] = None) -> Tuple[dict, Path]:
    """The Hugging Face config of ``ckpt``: ``config`` (a ``config.json``, or the folder holding
    it) or the ``config.json`` beside the checkpoint, as ``(dict, path)``."""
    path = Path(config) if config is not None else ckpt.path.parent / HF_CONFIG
    if path.is_dir():
        path = path / HF_CONFIG
    try:
        cfg = json.loads(read_regular(path, limit=CONFIG_LIMIT))
    except FileNotFoundError:
        how = "" if config is not None else f" (none beside {ckpt.path.name}; give one with {param('config')})"
        raise UsageError(f"no Hugging Face config at {path}{how}") from None
    except NotRegularFile as exc:
        raise UsageError(f"{path} is not a readable config.json ({exc.strerror})") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} is not a readable config.json ({exc})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UsageError(f"{path} is not a Hugging Face config.json (it has no model_type)")
    return cfg, path


def hf_config_hints(ckpt) -> None:
    """The heads the Hugging Face ``config.json`` beside ``ckpt`` tells (when its hidden size is the
    checkpoint's dim), or a note saying why it could not tell them."""
    det = ckpt.detected
    cfg_path = ckpt.path.parent / HF_CONFIG
    cfg = None
    try:
        cfg = json.loads(read_regular(cfg_path, limit=CONFIG_LIMIT))
    except FileNotFoundError:
        pass
    except OSError as exc:  # a folder, a FIFO, one too large to be a config: say so, not "no heads"
        det.heads_note = f"{cfg_path} beside it is not readable: {exc.strerror or exc}"
    except ValueError as exc:
        det.heads_note = f"{cfg_path} beside it is not valid JSON: {str(exc)[:120]}"
    heads, hidden = _hf_config_shape(cfg)
    if isinstance(heads, int) and hidden == det.dim:
        det.heads = heads
        ckpt.extra[HF_CONFIG] = str(cfg_path)
    elif cfg is not None:
        det.heads_note = (f"{cfg_path} beside it is for hidden size {hidden}, not dim {det.dim}"
                          if isinstance(heads, int) else f"{cfg_path} beside it names no num_attention_heads")


def _hf_config_shape(cfg: Any) -> Tuple[Any, Any]:
    """``(heads, hidden size)`` from a Hugging Face ``config.json`` (GPT-2 spells them ``n_head``, ``n_embd``)."""
    if not isinstance(cfg, dict):
        return None, None
    return cfg.get("num_attention_heads", cfg.get("n_head")), cfg.get("hidden_size", cfg.get("n_embd"))


#: What to install for Hugging Face checkpoints' models.
HF_EXTRA = "pip install 'structinit[hf]' (or transformers)"


def transformers_installed() -> bool:
    """Whether Hugging Face transformers can be imported (it builds the models of ``hf-*`` checkpoints)."""
    import importlib.util

    try:
        return importlib.util.find_spec("transformers") is not None
    except ValueError:  # a module set to None in sys.modules (how a test hides it)
        return False


def hf_model(ckpt, sd: Mapping, config: Optional[str], grid, family: "HfFamily") -> CheckpointModel:
    """The transformers model of ``ckpt`` (from its ``config.json``) with ``sd`` loaded; ``family`` tells its inputs."""
    import torch
    from safetensors.torch import save

    try:
        import transformers
    except ImportError:
        raise UsageError(f"the {ckpt.detected.layout.name} checkpoint's model is built by Hugging Face "
                         f"transformers, which is not installed: {HF_EXTRA}") from None

    cfg, path = hf_config(ckpt, config)
    transformers.utils.logging.disable_progress_bar()  # one line per weight file on stderr otherwise
    archs = [a for a in cfg.get("architectures") or [] if hasattr(transformers, a)]
    cls = getattr(transformers, archs[0]) if archs else transformers.AutoModel
    det = ckpt.detected
    with tempfile.TemporaryDirectory() as tmp:
        with atomic_write(Path(tmp) / HF_CONFIG, "w") as fh:
            fh.write(json.dumps(cfg))
        tensors = {k: torch.as_tensor(v).detach().contiguous().clone() for k, v in sd.items() if isinstance(k, str)}
        with atomic_write(Path(tmp) / "model.safetensors") as fh:
            fh.write(save(tensors))
        # transformers 5 prints a table of missing and unexpected weights; the refusal below names them in one line
        verbosity = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()
        try:
            model, info = cls.from_pretrained(tmp, output_loading_info=True, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers' own failure, in one line
            raise UsageError(f"transformers cannot build {cls.__name__} from {path} with the checkpoint's weights "
                             f"({str(exc).strip().splitlines()[0][:200]})") from None
        finally:
            transformers.utils.logging.set_verbosity(verbosity)
    # transformers 4 reports lists, 5 sets: sorted, so the message names the same tensors every time
    problems = [f"{what}: {', '.join(sorted(str(k) for k in keys)[:5])}" for what, keys in
                (("tensors the model does not have", info.get("unexpected_keys") or ()),
                 ("tensors the checkpoint lacks", info.get("missing_keys") or ()),
                 ("tensors of another shape", info.get("mismatched_keys") or ())) if keys]
    if problems:
        raise UsageError(f"the checkpoint's weights do not fit the {cls.__name__} of {path} ({'; '.join(problems)})")
    model.eval()
    how = f"transformers {cls.__name__} from {path}"
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    inputs, grid = family.config_inputs(cfg, grid, det)
    return CheckpointModel(model, how, inputs, grid=grid, heads=heads)


__all__ = ["HfFamily", "hf_config", "hf_config_hints", "hf_model", "transformers_installed", "HF_EXTRA"]
