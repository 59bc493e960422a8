"""The authors' exact recipes as init methods, constant by constant.

- ``impulse-2024``: the released code of "Structured Initialization for Attention in Vision
  Transformers" (2024, a timm fork): the ``released`` solve (Adam, 10,000 iterations, lr 1e-4, the
  asymmetric norm reset every 100 iterations) run once and shared by every layer; offsets drawn
  per head uniformly from the ``f x f`` kernel positions with replacement; the fixed sin-cos
  position embedding; V/proj not touched.
- ``impulse-2025``: the code of "Structured Initialization for Vision Transformers" (NeurIPS
  2025, a timm 1.0.22 fork): offsets fixed, head ``h`` at position ``[4,1,5,3,7,0,2,6,8][h % 9]``
  of the 3x3 kernel; the position embedding replaced by a learnable ``18 x randn x 0.02``; the
  ``authors-2025`` closed form (:func:`structinit.solver.algorithms.solve_authors_2025`) on its
  LayerNorm, re-solved for every layer; V/proj ``0.4 Z - 0.4 I`` with uniform ``Z``.

In both, every other weight is at PyTorch's default, as the authors' models are built with timm's
own init skipped: every module that has ``reset_parameters()`` (``Linear``, ``Conv``,
``LayerNorm``, ...) is reset under ``seed`` first (:func:`reset_to_defaults`), then the position
embedding, Q/K and (2025) V/proj are written over it. The Q/K biases keep their PyTorch default,
as in the authors' code, which writes the weights only; the attention measured in the report
includes them. Both need the model itself (a checkpoint or state dict has no modules to reset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Tuple

import numpy as np

from structinit.errors import StructinitError, UsageError, param
from structinit.init.base import InitSpec, register
from structinit.init.baselines import reset_to_defaults
from structinit.init.report import InitReport

PAPER_2024 = "Structured Initialization for Attention in Vision Transformers"
PAPER_2025 = "Structured Initialization for Vision Transformers"
#: The 2025 code's kernel position of head ``h`` is ``AUTHORS_2025_ORDER[h % 9]`` (row-major 3x3).
AUTHORS_2025_ORDER: Tuple[int, ...] = (4, 1, 5, 3, 7, 0, 2, 6, 8)
#: timm's random position embedding (``randn * 0.02``) and the 2025 code's factor on it.
PE_STD = 0.02
PE_SCALE_2025 = 18.0
#: The 2025 code's V/proj: ``VPROJ_ALPHA * Z - VPROJ_BETA * I`` with ``Z ~ U(+-sqrt(3/D))``.
VPROJ_ALPHA = VPROJ_BETA = 0.4
#: ``torch.nn.functional.layer_norm``'s default eps, which the 2025 code's solve uses on the PE.
SOLVE_LN_EPS_2025 = 1e-5
#: The largest difference in hit rate or target mass between the solve and the written weights
#: before a write is reported as misplaced (impulse-2024).
TOLERANCE = 0.02


def not_reset(model) -> List[str]:
    """Parameters of ``model`` that no ``reset_parameters()`` covers (``pos_embed``, ``cls_token``, ...)."""
    out = []
    for name, module in model.named_modules():
        if callable(getattr(module, "reset_parameters", None)):
            continue
        for pname, _ in module.named_parameters(recurse=False):
            out.append(f"{name}.{pname}" if name else pname)
    return out


def qk_biases(sd, slot, heads: int):
    """``(bq, bk)`` float32 ``[H, d]`` of one layer (``None`` where the layer has no bias)."""
    from structinit.init.inject import read_part

    return tuple(None if part is None else read_part(sd, part).reshape(heads, -1)
                 for part in (slot.q_bias, slot.k_bias))


def attention_with_biases(x, q, k, bq=None, bk=None):
    """``softmax((x Q_h + b_q)(x K_h + b_k)^T / sqrt(d))`` per head, as timm's attention computes it on
    the normalized input ``x [N, D]``: ``[H, N, N]`` float32 (``q, k: [H, D, d]``, biases ``[H, d]``)."""
    import math

    import torch

    x = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    xq, xk = x @ q.float(), x @ k.float()
    if bq is not None:
        xq = xq + bq.float().unsqueeze(-2)
    if bk is not None:
        xk = xk + bk.float().unsqueeze(-2)
    return torch.softmax(xq @ xk.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)


def layer_row(x, q, k, bq, bk, columns) -> Dict[str, Any]:
    """``mse``, ``hit_rate``, ``target_mass`` of one layer's attention on ``x`` (with the biases):
    means over heads, and per head under ``heads``."""
    from structinit.analysis.quality import attention_quality

    got = attention_quality(attention_with_biases(x, q, k, bq, bk), columns)
    heads = {m: [float(v) for v in got[m]] for m in ("mse", "hit_rate", "target_mass")}
    return {**{m: float(np.mean(v)) for m, v in heads.items()}, "heads": heads}


@dataclass(frozen=True)
class _AuthorsInit(InitSpec):
    """What both authors' recipes share: they need the model (to reset it) with a position embedding."""

    #: The authors' code leaves every weight it does not write at PyTorch's defaults.
    fixed_base = "pytorch"
    reports_offsets = True
    needs_model = True

    needs_grid = True
    paper: ClassVar[str] = ""

    def check_target(self, target) -> None:
        import torch

        if target.model is None:
            raise UsageError(f"{self.method} resets every other weight to PyTorch's defaults (reset_parameters() of "
                             "each module), so it needs the model, not a state dict: call initialize_model on the "
                             "model, or apply on a checkpoint whose model structinit can build")
        if not isinstance(getattr(target.model, "pos_embed", None), torch.Tensor):
            raise UsageError(f"{self.method} writes the model's position embedding, but the model has no pos_embed "
                             "tensor")

    #: The solver recipe this init computes with.
    recipe: ClassVar[str] = ""

    def algorithms(self) -> Dict[str, int]:
        from structinit.solver.recipes import RECIPE_VERSIONS

        return {f"recipe {self.recipe}": RECIPE_VERSIONS[self.recipe]}

    def _summary(self, t, reset: List[str]) -> Dict[str, Any]:
        return {"method": self.method, "paper": self.paper, "layout": t.layout, "grid": list(t.grid), "dim": t.dim,
                "heads": t.heads, "params": self.params(), "padding": "zero", "causal": False,
                "reset": reset, "not_reset": not_reset(t.model),
                "qk_bias": "PyTorch's default, kept (the authors' code writes the Q/K weights only)"}


@register
@dataclass(frozen=True)
class Impulse2024Init(_AuthorsInit):
    """The released code of "Structured Initialization for Attention in Vision Transformers".

    1. every module with ``reset_parameters()`` is reset under ``seed`` (:func:`reset_to_defaults`);
    2. the fixed 2-D sin-cos table is written into ``pos_embed`` (class-token rows zeroed) and
       frozen (``requires_grad=False``; the released code keeps it as a plain tensor);
    3. one ``released`` solve (Adam lr 1e-4, 10,000 iterations, MSE, scale ``1/sqrt(d)``, Q/K
       uniform in ``+-sqrt(1/(d heads))``, every 100 iterations from the first Q rescaled over its
       ``D`` axis and K over its ``d`` axis to Q's mean initial column norm) on the LayerNorm'd
       table, offsets drawn per head uniformly from the ``f x f`` positions with replacement (from
       ``seed``), cached as an artifact and written into every selected layer (the same Q/K and
       offsets in every layer); Q/K biases keep their PyTorch default;
    4. V/proj are not touched (their PyTorch default from step 1).

    ``recipe_params`` overrides the released recipe's ``iters``, ``lr`` or ``norm_every`` (then it
    is no longer the released behaviour; for quick checks).
    """

    method = "impulse-2024"
    recipe = "released"
    paper = PAPER_2024
    writes = ("model: every module with reset_parameters() (PyTorch defaults); pos_embed (sin-cos, frozen); "
              "Q/K rows")
    filter: int = 3
    recipe_params: Dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        from structinit.solver.recipes import recipe_params

        self.check_positive("filter")
        recipe_params("released", self.recipe_params)  # refuse bad values now

    def impulse_spec(self):
        """The :class:`~structinit.init.impulse.ImpulseInit` whose solve this is."""
        from structinit.init.impulse import ImpulseInit

        return ImpulseInit(filter=self.filter, recipe="released", recipe_params=dict(self.recipe_params), share=True,
                           offset_order="random", padding="zero", pseudo_input="pe")

    def presolves(self, shape, seed: int = 0) -> List[Any]:
        """The one shared ``released`` solve (see :meth:`impulse_spec`)."""
        return self.impulse_spec().presolves(shape, seed)

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        import torch

        from structinit.analysis.quality import measure
        from structinit.geometry.targets import impulse_columns
        from structinit.init.impulse_checks import check_artifact
        from structinit.init.inject import read_qk, write_qk
        from structinit.init.pos_embed import set_sincos_pos_embed

        t = target
        reset = reset_to_defaults(t.model, seed)
        pe_written = set_sincos_pos_embed(t.model, t.grid, zero_prefix=True)
        art, cached = self.impulse_spec().artifact_for(t, seed, cache_dir, device)
        check_artifact(art, t.grid, t.dim, t.heads, t.layers)
        own = t.own_input()
        solved = art.stats.get("layers", [])
        rows = []
        for slot in t.slots:
            src = 0 if art.config.layers == 1 else slot.index
            keys = write_qk(t.sd, slot, torch.from_numpy(art.q[src]), torch.from_numpy(art.k[src]), zero_bias=False)
            rq, rk = read_qk(t.sd, slot, t.heads)
            cols = impulse_columns(art.config.grid, art.offsets[src], art.config.padding)
            placed = measure(art.layer_input(src), rq, rk, cols)
            for name in ("hit_rate", "target_mass"):
                want = float(np.mean([h[name] for h in solved[src]]))
                got = float(getattr(placed, name).mean())
                if abs(want - got) > TOLERANCE:
                    raise StructinitError(f"layer {slot.index}: the written weights give {name} {got:.3f} but the "
                                          f"solve has {want:.3f}; the Q/K rows were not placed as the layout expects")
            bq, bk = qk_biases(t.sd, slot, t.heads)
            rows.append({"layer": slot.index, "replaced": keys, "offsets": art.offsets[src].tolist(),
                         **layer_row(own, rq, rk, bq, bk, cols),
                         "solved": {m: float(getattr(placed, m).mean()) for m in ("hit_rate", "target_mass")}})
        out = self._summary(t, reset)
        out.update({
            "recipe": "released", "recipe_params": dict(art.config.params), "shared": True,
            "artifact": {"key": art.key, "path": str(art.path) if art.path else None, "cached": cached,
                         "config": art.config.to_dict()},
            "pos_embed": {"key": t.pos_key, "written": pe_written, "kind": t.pos_embed_kind(), "learnable": False},
            "vproj": "not written (PyTorch's default from the reset)",
            "measured_on": f"{t.pos_key} (sin-cos), LayerNorm'd as the model's first block does, with the Q/K biases",
            "layers": rows, "hit_rate": float(np.mean([r["hit_rate"] for r in rows])),
            "target_mass": float(np.mean([r["target_mass"] for r in rows]))})
        return InitReport.from_dict(out)


@register
@dataclass(frozen=True)
class Impulse2025Init(_AuthorsInit):
    """The code of "Structured Initialization for Vision Transformers" (NeurIPS 2025).

    1. every module with ``reset_parameters()`` is reset under ``seed`` (:func:`reset_to_defaults`);
    2. ``pos_embed`` (every row, class-token rows too) becomes ``18 x 0.02 x randn`` (seeded) and
       learnable (``requires_grad=True``);
    3. pseudo input ``P``: its grid rows (class-token rows dropped), LayerNorm'd without affine
       (eps 1e-5, ``torch.nn.functional.layer_norm``'s default, as the authors' solve has it);
    4. offsets fixed: head ``h`` takes position ``[4,1,5,3,7,0,2,6,8][h % 9]`` of the 3x3 kernel, in
       every layer;
    5. for every selected layer, a fresh ``authors-2025`` solve on ``P`` (fresh noise, same
       offsets): Q/K at Frobenius norm 7 per head, written as the weights (Q/K biases keep their
       PyTorch default); then V/proj with ``x W_V W_proj = x (0.4 Z - 0.4 I)``,
       ``Z ~ U(+-sqrt(3/D))`` per entry, split by SVD (``mimetic_v_proj(..., dist="uniform")``).

    Only the 3x3 filter exists in that code (``filter`` must be 3), and only image grids.
    """

    method = "impulse-2025"
    recipe = "authors-2025"
    paper = PAPER_2025
    writes = ("model: every module with reset_parameters() (PyTorch defaults); pos_embed (18 x random, learnable); "
              "Q/K rows; V and output projection")
    filter: int = 3

    def validate(self) -> None:
        if self.filter != 3:
            order = ",".join(map(str, AUTHORS_2025_ORDER))
            raise UsageError(f"impulse-2025 parameter {param('filter')} must be 3: the authors' 2025 code assigns the "
                             f"9 positions of a 3x3 kernel ({order}), got {self.filter}")

    def planned(self, slot) -> List[str]:
        from structinit.init.mimetic import vproj_keys

        return super().planned(slot) + vproj_keys(slot)

    def check_target(self, target) -> None:
        import torch

        super().check_target(target)
        if target.grid is not None and target.grid.ndim != 2:
            raise UsageError(f"impulse-2025 assigns the positions of a 3x3 kernel on an image grid; the model's "
                             f"{param('grid')} is a sequence of {target.grid.tokens} tokens")
        if not isinstance(target.model.pos_embed, torch.nn.Parameter):
            raise UsageError("impulse-2025 makes the position embedding learnable, but the model's pos_embed is a "
                             "buffer or plain tensor, not an nn.Parameter")

    def offsets(self, heads: int) -> np.ndarray:
        """int32 ``[heads, 2]``: ``(dy, dx)`` of position ``AUTHORS_2025_ORDER[h % 9]`` for head ``h``."""
        from structinit.geometry.targets import kernel_offset

        return np.array([kernel_offset(AUTHORS_2025_ORDER[h % 9], 3) for h in range(heads)], dtype=np.int32)

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        import torch

        from structinit.geometry.targets import impulse_columns
        from structinit.init.baselines import generator
        from structinit.init.inject import read_qk, read_vproj, write_qk, write_vproj
        from structinit.init.mimetic import mimetic_v_proj
        from structinit.solver.algorithms import solve_authors_2025
        from structinit.solver.recipes import recipe_params

        t = target
        model = t.model
        reset = reset_to_defaults(model, seed)
        gen = generator(seed)
        pe = model.pos_embed
        with torch.no_grad():
            pe.copy_((torch.randn(pe.shape, generator=gen) * PE_STD * PE_SCALE_2025).to(pe.dtype))
        pe.requires_grad_(True)
        grid_rows = torch.from_numpy(t.pos_embed()).double()  # the class-token rows dropped
        x = torch.nn.functional.layer_norm(grid_rows, grid_rows.shape[-1:], eps=SOLVE_LN_EPS_2025)
        offsets = self.offsets(t.heads)
        cols = impulse_columns(t.grid, offsets, "zero")
        columns = torch.from_numpy(cols).unsqueeze(0)
        params = recipe_params("authors-2025")
        own = t.own_input()
        rows = []
        for slot in t.slots:
            q, k = solve_authors_2025(x.unsqueeze(0), columns, t.dim // t.heads, t.heads, gen, **params)
            keys = write_qk(t.sd, slot, q[0], k[0], zero_bias=False)
            w_v, w_p, _ = mimetic_v_proj(t.dim, VPROJ_ALPHA, VPROJ_BETA, gen, dist="uniform")
            keys += write_vproj(t.sd, slot, w_v, w_p)
            rq, rk = read_qk(t.sd, slot, t.heads)
            rv, rp = read_vproj(t.sd, slot)
            if not (torch.allclose(rq, q[0], atol=1e-5) and torch.allclose(rk, k[0], atol=1e-5)):
                raise StructinitError(f"layer {slot.index}: the Q/K read back differ from the ones written; the rows "
                                      "were not placed as the layout expects")
            bq, bk = qk_biases(t.sd, slot, t.heads)
            rows.append({"layer": slot.index, "replaced": keys, "offsets": offsets.tolist(),
                         **layer_row(own, rq, rk, bq, bk, cols),
                         "qk_fro": [float(v) for v in rq.norm(dim=(-2, -1))],
                         "vproj_diag_mean": float((rv @ rp).diagonal().mean())})
        out = self._summary(t, reset)
        out.update({
            "recipe": "authors-2025", "recipe_params": params, "shared": False, "artifact": None,
            "pos_embed": {"key": t.pos_key, "written": f"{t.pos_key} = {PE_SCALE_2025:g} x {PE_STD:g} x randn "
                          "(seeded), every row", "std": float(pe.detach().float().std()), "learnable": True,
                          "solve_layer_norm_eps": SOLVE_LN_EPS_2025},
            "vproj": {"written": True, "alpha": VPROJ_ALPHA, "beta": VPROJ_BETA, "z": "uniform in +-sqrt(3/D)"},
            "measured_on": f"{t.pos_key} (18 x random), LayerNorm'd as the model's first block does, with the Q/K "
                           "biases",
            "layers": rows, "hit_rate": float(np.mean([r["hit_rate"] for r in rows])),
            "target_mass": float(np.mean([r["target_mass"] for r in rows]))})
        return InitReport.from_dict(out)
