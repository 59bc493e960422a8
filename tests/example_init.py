"""An init method that fits to data, written as a plugin writes one: this module alone, nothing else
in structinit changed. It registers ``example-pca``: every selected layer's ``Q_h`` and ``K_h`` are
``scale`` times the ``h``-th block of ``d`` principal directions of what the first attention layer
reads on a batch of inputs (``data``; without it, noise inputs of the model's input shape), so that
a head's logits are that block's principal components against each other.

``tests/test_init_conformance.py`` registers it (by importing this module), puts it through the
checks every registered method passes, and runs it through ``initialize_model``, ``structinit
train`` and ``structinit apply``, each of which finds it by name and hands it its inputs; then takes
it out of the registry again."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional

from structinit.errors import UsageError, param
from structinit.init.base import InitSpec, InitWarning, register
from structinit.init.report import FitRecord, InitReport, LayerRow


def self_mass(target, rows: List[LayerRow]) -> Optional[float]:
    """The method's own value: the mean attention a token pays itself on the target's own position
    embedding, over the layers written (what a plugin reports beside the common fields)."""
    import torch

    from structinit.init.inject import read_qk

    own = target.own_input()
    if own is None:
        return None
    x = torch.from_numpy(own).float()
    masses = []
    for slot in target.slots:
        q, k = read_qk(target.sd, slot, target.heads)
        attn = torch.softmax((x @ q) @ (x @ k).transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        masses.append(float(attn.diagonal(dim1=-2, dim2=-1).mean()))
    return sum(masses) / len(masses)


@dataclass(frozen=True)
class Directions:
    """What :meth:`ExamplePcaInit.prepare` makes: the principal directions ``[D, D]`` (columns, by
    falling variance) and what they were found on."""

    vectors: Any
    inputs: str
    samples: int


@register
@dataclass(frozen=True)
class ExamplePcaInit(InitSpec):
    """``Q_h = K_h = scale * V[:, h*d:(h+1)*d]``, ``V`` the principal directions of the first attention
    layer's input on at most ``samples`` inputs; Q/K biases zeroed. :meth:`prepare` needs the model (it
    runs inputs through it); a checkpoint's copies get what it found on the model the file describes."""

    method = "example-pca"
    writes = "Q/K rows (biases zeroed)"
    fits_data = True
    scale: float = 1.0
    samples: int = 32

    def validate(self) -> None:
        self.check_positive("scale")
        self.check_positive("samples", allow_zero=True)

    @property
    def uses_data(self) -> bool:
        return self.samples > 0

    def fit_off(self) -> str:
        return "samples is 0" if not self.samples else ""

    def without_fit(self) -> "ExamplePcaInit":
        """No fit (``samples=0``): Q/K are the weights a resumed run's checkpoint holds, left as they are."""
        return dataclasses.replace(self, samples=0)

    @property
    def fit_samples(self) -> int:
        return self.samples

    def with_fit_samples(self, samples: int) -> "ExamplePcaInit":
        return dataclasses.replace(self, samples=samples)

    def prepare(self, target, *, seed: int = 0, data=None, source: Optional[str] = None, stage=None,
                **_: Any) -> Directions:
        import torch

        from structinit.analysis.capture import first_input, projection_module
        from structinit.fit.inputs import data_inputs, noise_inputs

        if not self.samples:
            return None
        model = target.model
        if model is None:  # a checkpoint's copies get what prepare found on its model (write_copy)
            raise UsageError(f"{self.method} runs inputs through the model; give the model, not a state dict")
        if data is not None:
            inputs = data_inputs(data, self.samples, source)
        else:
            shape = target.inputs.noise_shape if target.inputs is not None else None  # what the model's family tells
            if shape is None:
                raise UsageError(f"{self.method}: the model does not tell its input shape; give {param('data')}")
            inputs = noise_inputs(shape, self.samples, seed)
        if stage is not None:
            stage("finding the principal directions")
        qkv = projection_module(model, target.det.slots[0].q.key)
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                x = first_input(qkv, lambda: model(inputs.x)).reshape(-1, target.dim).double()
        finally:
            model.train(was)
        x = x - x.mean(dim=0)
        _, vectors = torch.linalg.eigh(x.T @ x)
        return Directions(vectors.flip(-1).float(), inputs.kind, inputs.samples)

    def write(self, target, prepared: Optional[Directions] = None, *, seed: int = 0, cache_dir=None,
              device: str = "cpu") -> InitReport:
        from structinit.init.inject import write_qk

        if prepared is None:
            if self.samples:
                raise UsageError(f"{self.method} writes what prepare found; call apply")
            return InitReport(self.method, layers=[LayerRow(slot.index) for slot in target.slots])
        d = target.dim // target.heads
        per_head = self.scale * prepared.vectors.reshape(target.dim, target.heads, d).permute(1, 0, 2)
        rows = [LayerRow(slot.index, replaced=write_qk(target.sd, slot, per_head, per_head)) for slot in target.slots]
        return InitReport(self.method, layers=rows, fit=FitRecord(inputs=prepared.inputs, samples=prepared.samples),
                          extra={"dim": target.dim, "heads": target.heads, "params": self.params(),
                                 "self_mass": self_mass(target, rows)})

    def warnings(self, report: InitReport, target, *, checkpoint: bool = False,
                 pe_scale: Optional[float] = None) -> List[InitWarning]:
        if report.fit is not None and report.fit.inputs == "noise":
            return [InitWarning(f"{self.method}: no data given, so the directions are those of noise inputs; give "
                                f"{param('data')}")]
        return []
