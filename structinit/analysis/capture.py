"""What a model's attention layers see on a batch: each layer's input, captured by running the
model and nothing else (no measure, no init). The data fit (:mod:`structinit.fit`) and
the real-data measures (:mod:`structinit.analysis.fidelity`) both read layer inputs through here.

An attention layer's input is the input of the module that projects it to queries (timm's fused
``qkv`` Linear, or ``blocks[i].attn``; a Hugging Face ``query`` Linear; GPT-2's ``c_attn``):
``[B, T, D]`` with ``T`` = prefix tokens (a class token) + grid tokens, after the block's norm.

:class:`LayerInputs` hands them out layer by layer while the caller changes the weights in between
(layer ``i``'s input reflects layers ``0..i-1`` as they are when it is asked for). On a model built
of sequential blocks (timm's ViTs, structinit's ``transformer-1d``: the ``blocks`` its family tells,
:meth:`structinit.init.family.ModelFamily.blocks`) it runs each block once:
the residual stream before block ``i`` is kept and pushed through block ``i`` when layer ``i + 1``
is asked for, so the whole pass costs about one forward of the batch. On any other model (or one
whose forward is not ``blocks`` in order, which is checked once on the batch) it runs the model
up to the layer for every layer asked for.

Example::

    inputs = LayerInputs(model, images)          # images as the model sees them in training
    x0 = inputs(0)                               # [B, T, D], the first layer's input
    ...                                          # change layer 0's weights
    x1 = inputs(1)                               # what layer 1 sees now
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from structinit.errors import UsageError, param

#: Images pushed through the model at once (the batch is split into chunks of this many).
CHUNK = 64


class _Stop(Exception):
    """Raised inside a hook to end a forward pass once what it captures is in hand."""


def attention_inputs(model, x) -> List[Any]:
    """The input of every ``model.blocks[i].attn`` (after the block's norm) on batch ``x``:
    a list of ``[B, N, D]`` tensors, one per block (no gradients; the model's weights as they are)."""
    import torch

    seen: List[Any] = []
    hooks = [blk.attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
             for blk in model.blocks]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(x)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return seen


def first_input(module, run) -> Any:
    """The first positional input of ``module`` during ``run()``, which is cut short there."""
    got: List[Any] = []

    def hook(_m, args):
        got.append(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        run()
    except _Stop:
        pass
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that cannot take the batch: one line that says so
        text = str(exc).strip().splitlines()
        raise UsageError(f"the {param('model')} cannot run on the {param('data')} given "
                         f"({type(exc).__name__}: {text[0][:200] if text else ''})") from exc
    finally:
        handle.remove()
    if not got:
        raise UsageError("an attention layer did not run in the model's forward (is the model using it?)")
    return got[0]


def _inside(module, container) -> bool:
    return any(m is module for m in container.modules())


class LayerInputs:
    """Layer ``i``'s attention input on batch ``x`` (``[B, ...]``, on the model's device), asked for
    in increasing ``i`` (see the module docstring). ``modules[i]``: the module whose first input is
    layer ``i``'s attention input; ``blocks`` (optional, what the model's family tells: timm's
    ``model.blocks``): the blocks the model's forward runs in order, one per layer, which the
    residual stream is pushed through. ``streamed`` says whether the model is run block by block.
    ``between()`` (optional) is called after every chunk of :data:`CHUNK` images (it may raise to
    stop)."""

    def __init__(self, model, x, modules: Sequence[Any], between=None, blocks: Optional[Sequence[Any]] = None):
        import torch

        self.between = between
        self.model = model
        self.modules = list(modules)
        self.device = next(model.parameters()).device
        self.x = x.to(self.device)
        self._torch = torch
        self._next = 0
        self._h: Optional[Any] = None
        self._at = 0
        self.blocks: Optional[List[Any]] = None
        if blocks is not None and len(blocks) == len(self.modules) and \
                all(_inside(m, b) for m, b in zip(self.modules, blocks)):
            self.blocks = list(blocks)
            self._start_stream(self.blocks)

    def _eval(self, fn):
        torch = self._torch
        was = self.model.training
        try:
            self.model.eval()
            with torch.no_grad():
                return fn()
        finally:
            self.model.train(was)

    def _chunks(self, fn, t):
        out = []
        for i in range(0, int(t.shape[0]), CHUNK):
            out.append(fn(t[i:i + CHUNK]))
            if self.between is not None:
                self.between()
        return self._torch.cat(out)

    def _start_stream(self, blocks: List[Any]) -> None:
        """The residual stream before block 0, and the check that block 0 of it gives what the
        model's own forward gives block 1 (else every layer runs the model from its input)."""
        torch = self._torch
        h0 = self._eval(lambda: self._chunks(lambda c: first_input(blocks[0], lambda: self.model(c)), self.x))
        if len(blocks) > 1:
            probe = self.x[:4]
            try:
                want = self._eval(lambda: first_input(blocks[1], lambda: self.model(probe)))
                got = self._eval(lambda: blocks[0](h0[:4]))
                same = got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
            except Exception:  # noqa: BLE001 - a block that needs more than the stream: run the model instead
                same = False
            if not same:
                self.blocks = None
                return
        self._h, self._at = h0, 0

    @property
    def streamed(self) -> bool:
        return self.blocks is not None

    def __call__(self, i: int):
        """Layer ``i``'s input ``[B, T, D]`` (float32) with the weights as they are now."""
        if i < self._next:
            raise UsageError(f"{param('layer')} {i} was asked for after layer {self._next - 1}: layers are captured "
                             "in increasing order")
        if not 0 <= i < len(self.modules):
            raise UsageError(f"{param('layer')} {i} out of range: the model has {len(self.modules)} attention layers")
        self._next = i + 1
        if self.blocks is None:
            return self._eval(lambda: self._chunks(
                lambda c: first_input(self.modules[i], lambda: self.model(c)), self.x)).float()
        while self._at < i:
            blk, h = self.blocks[self._at], self._h
            self._h = self._eval(lambda b=blk, h=h: self._chunks(b, h))
            self._at += 1
        blk = self.blocks[i]
        return self._eval(lambda: self._chunks(lambda c: first_input(self.modules[i], lambda: blk(c)),
                                               self._h)).float()


def projection_module(model, weight_key: str):
    """The submodule of ``model`` that owns the state-dict entry ``weight_key`` (e.g. the ``qkv``
    Linear of ``blocks.3.attn.qkv.weight``): its first input is the attention input."""
    path = weight_key.rsplit(".", 1)[0]
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise UsageError(f"the model has no module {path!r} (from the key {weight_key!r})") from None


__all__ = ["LayerInputs", "attention_inputs", "first_input", "projection_module", "CHUNK"]
