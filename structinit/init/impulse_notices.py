"""What impulse init tells the user beside its report: warnings (a fit that could not run on a
model, a fit on noise inputs, a layer left weakly structured) and notes (the plain solve written).
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional

from structinit.errors import param
from structinit.init.base import InitWarning

#: What ``apply`` says of a checkpoint written with the plain solve (``data_fit=0``).
PLAIN_SOLVE_NOTE = (f"{param('data_fit')} 0 writes the plain solve, which real inputs wash out: it trained 12 points "
                    "below mimetic init at 100 digits (docs/results/digits-datafit)")


class ImpulseNotices:
    """Impulse init's warnings and notes (a mixin of :class:`~structinit.init.impulse.ImpulseInit`)."""

    method: ClassVar[str]
    data_fit: int

    def warnings(self, report: Dict[str, Any], target, *, checkpoint: bool = False,
                 pe_scale: Optional[float] = None) -> List[InitWarning]:
        """A fit that could not run on a model, a fit on noise inputs (real ones can be given), and a
        fit that left a layer weakly structured where a remedy was measured to help at its shape
        (:func:`~structinit.fit.advice.structure_warning`)."""
        from structinit.fit.advice import structure_warning
        from structinit.init.impulse_write import noise_notice

        if checkpoint:
            weak = structure_warning(report)
            return [InitWarning(f"impulse: {weak}", loggable=False)] if weak else []
        out = []
        skipped = (report.get("data_fit") or {}).get("skipped")
        if skipped and target.model is not None:
            out.append(InitWarning(f"{self.method} {param('data_fit')} {skipped}", loggable=False))
        notice = noise_notice(report)
        if notice:
            out.append(InitWarning(notice))
        weak = structure_warning(report)
        if weak:
            out.append(InitWarning(f"{self.method}: {weak}", warning=True))
        return out

    def notes(self, report: Dict[str, Any]) -> List[str]:
        """That the fit ran on noise inputs (real ones can be given), or that the plain solve was written."""
        from structinit.init.impulse_write import noise_notice

        out = []
        notice = noise_notice(report) if isinstance(report.get("data_fit"), dict) else None
        if notice:
            out.append(notice)
        if not report.get("dry_run") and not self.data_fit:
            out.append(PLAIN_SOLVE_NOTE)
        return out
