"""Refining a job's Cell estimates with what its running Cell measured (Rubick's
continuous fitting, for the Cells one measurement can speak for).

The runner records seconds per iteration of the Cell it runs (``measured.json``), and on
GPUs its peak memory per device. The measured Cell takes the measured time and memory
(``memory_fidelity: measured``); the other Cells of the same GPU type are scaled by
the same measured/estimated ratio, since the estimator's error for one job on one GPU
type is mostly systematic (kernel efficiency of this model on this GPU); Cells of other
GPU types keep their estimates. Refined estimates say so in ``fidelity``.
"""

import math
from dataclasses import dataclass, replace

from estimator.cells import CellEstimate
from estimator.errors import SpecError

MEASURED = "measured"
REFINED = "analytic+measured"


@dataclass(frozen=True)
class Measurement:
    """Seconds per iteration measured on one Cell (its label, e.g. ``a100x8:s2``)."""

    cell_label: str
    iteration_time_s: float
    steps_measured: int
    peak_memory_gb: float | None = None  # GPUs only

    @classmethod
    def from_json(cls, raw: object) -> "Measurement":
        """Validate the runner's ``measured.json`` content (a parsed JSON object)."""
        if not isinstance(raw, dict):
            raise SpecError("measured", raw, "expected a JSON object")
        label, t, n = raw.get("cell"), raw.get("iteration_time_s"), raw.get("steps_measured")
        peak = raw.get("peak_memory_gb")
        if not isinstance(label, str) or ":" not in label:
            raise SpecError("measured.cell", label, "expected a Cell label like a100x8:s2")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < math.inf:
            raise SpecError("measured.iteration_time_s", t, "expected a positive number")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise SpecError("measured.steps_measured", n, "expected a positive integer")
        good_peak = isinstance(peak, (int, float)) and not isinstance(peak, bool) and peak > 0
        return cls(label, float(t), n, float(peak) if good_peak else None)


def refine(estimates: tuple[CellEstimate, ...], measurement: Measurement,
           global_batch: int) -> tuple[CellEstimate, ...]:
    """Estimates with the measured Cell's time and its GPU type's other Cells rescaled.

    Returns the estimates unchanged when the measured Cell is not among them.
    """
    measured = next((e for e in estimates if e.cell.label() == measurement.cell_label and e.feasible), None)
    if measured is None:
        return estimates
    ratio = measurement.iteration_time_s / measured.iteration_time_s
    out = []
    for e in estimates:
        if e is measured:
            t, fidelity = measurement.iteration_time_s, MEASURED
            if measurement.peak_memory_gb:
                e = replace(e, peak_memory_gb=measurement.peak_memory_gb, memory_fidelity=MEASURED)
        elif e.feasible and e.cell.gpu_type == measured.cell.gpu_type:
            t, fidelity = e.iteration_time_s * ratio, REFINED
        else:
            out.append(e)
            continue
        out.append(replace(e, iteration_time_s=t, samples_per_s=global_batch / t, fidelity=fidelity))
    return tuple(out)
