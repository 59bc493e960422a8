"""What impulse init tells the user beside its report: warnings (a fit that could not run on a
model, a fit on noise inputs, a layer left weakly structured) and notes (the plain solve written).
"""

from __future__ import annotations

from typing import ClassVar, List, Optional

from structinit.errors import param
from structinit.init.base import InitWarning
from structinit.init.report import InitReport

#: What ``apply`` says of a checkpoint written with the plain solve (``data_fit=0``).
PLAIN_SOLVE_NOTE = (f"{param('data_fit')} 0 writes the plain solve, which real inputs wash out: it trained 12 points "
                    "below mimetic init at 100 digits (docs/results/digits-datafit)")


class ImpulseNotices:
    """Impulse init's warnings and notes (a mixin of :class:`~structinit.init.impulse.ImpulseInit`)."""

    method: ClassVar[str]
    data_fit: int

    def warnings(self, report: InitReport, target, *, checkpoint: bool = False,
                 pe_scale: Optional[float] = None) -> List[InitWarning]:
        """A fit that could not run on a model, a fit on noise inputs (real ones can be given), and a
        fit that left a layer weakly structured where a remedy was measured to help at its shape
        (:func:`~structinit.fit.advice.structure_warning`)."""
        from structinit.fit.advice import structure_warning
        from structinit.init.impulse_write import noise_notice

        if checkpoint:
            weak = structure_warning(report.to_dict())
            return [InitWarning(f"impulse: {weak}", loggable=False)] if weak else []
        out = []
        skipped = report.fit.skipped if report.fit is not None else None
        if skipped and target.model is not None:
            out.append(InitWarning(f"{self.method} {param('data_fit')} {skipped}", loggable=False))
        notice = noise_notice(report)
        if notice:
            out.append(InitWarning(notice))
        weak = structure_warning(report.to_dict())
        if weak:
            out.append(InitWarning(f"{self.method}: {weak}", warning=True))
        return out

    def notes(self, report: InitReport) -> List[str]:
        """That the fit ran on noise inputs (real ones can be given), or that the plain solve was written."""
        from structinit.init.impulse_write import noise_notice

        return [line for line in (noise_notice(report), None if self.data_fit else PLAIN_SOLVE_NOTE) if line]

    def summary(self, report: InitReport, *, model: Optional[str] = None) -> List[str]:
        """See :func:`structinit.init.impulse_write.summary`."""
        from structinit.init.impulse_write import summary

        return summary(self, report, model)
