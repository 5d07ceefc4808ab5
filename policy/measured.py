"""Ground truth of the simulator: measured seconds per iteration for an allocation.

The table (``policy/data/measured_iter_time.csv``) gives, per (model, size, global batch,
GPU type, nodes, GPUs per node), the iteration time of the best plan found on real GPUs.
A simulated job advances at this rate for the allocation it actually holds.

Rule for allocations that were not measured (written down in docs/simulation.md):

1. The exact layout (GPU type, nodes, GPUs per node) measured and successful: its time.
2. Else the nearest measured layout of the same model, batch, GPU type and GPU count:
   nearest in log2(GPUs per node); on a tie, the slower one (a conservative guess). A
   layout whose measurement failed (out of memory) is never used as a neighbour.
3. Else the allocation is not runnable: no GPU count is ever extrapolated, because
   memory, not speed, decides whether a model fits on fewer GPUs.

An uneven placement (e.g. 4 + 2 + 2 GPUs) counts as its number of nodes and its largest
per-node share; rule 2 then finds the nearest measured layout.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

from estimator.cells import gpus_per_node_of
from estimator.errors import SpecError

DEFAULT_MEASURED_PATH = Path(__file__).parent / "data" / "measured_iter_time.csv"
_COLUMNS = ("model", "param", "global_batch", "gpu_type", "num_nodes", "gpus_per_node",
            "num_gpus", "iter_time_s")


def model_name(family: str, param_label: str) -> str:
    """The built-in model name of a table row: (``gpt``, ``1.3B``) → ``gpt-1.3b``."""
    return f"{family}-{param_label.lower()}"


@dataclass(frozen=True)
class MeasuredPoint:
    """One row: an allocation's measured iteration time (None when the run failed)."""

    model: str
    global_batch: int
    gpu_type: str
    num_nodes: int
    gpus_per_node: int
    iter_time_s: float | None

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


class MeasuredTable:
    """Lookup of measured iteration times, with the nearest-layout rule.

    Args:
        points: the rows.
        source: where they came from (for messages).
    """

    def __init__(self, points: tuple[MeasuredPoint, ...], source: str = "<memory>"):
        self.points = points
        self.source = source
        self._exact: dict[tuple, float | None] = {}
        self._by_count: dict[tuple, list[MeasuredPoint]] = {}
        for p in points:
            self._exact[(p.model, p.global_batch, p.gpu_type, p.num_nodes, p.gpus_per_node)] = p.iter_time_s
            self._by_count.setdefault((p.model, p.global_batch, p.gpu_type, p.num_gpus), []).append(p)
        self._cache: dict[tuple, float | None] = {}

    def iter_time_s(self, model: str, global_batch: int, gpu_type: str,
                    num_nodes: int, gpus_per_node: int) -> float | None:
        """Seconds per iteration on this allocation, or None when it is not runnable."""
        key = (model, global_batch, gpu_type, num_nodes, gpus_per_node)
        if key in self._cache:
            return self._cache[key]
        value = self._lookup(key)
        self._cache[key] = value
        return value

    def _lookup(self, key: tuple) -> float | None:
        model, batch, gtype, nodes, per_node = key
        exact = self._exact.get(key)
        if exact is not None:
            return exact
        candidates = [p for p in self._by_count.get((model, batch, gtype, nodes * per_node), ())
                      if p.iter_time_s is not None]
        if not candidates:
            return None
        target = math.log2(per_node)
        best = min(candidates, key=lambda p: (abs(math.log2(p.gpus_per_node) - target), -p.iter_time_s))
        return best.iter_time_s

    def best_locality_iter_time_s(self, model: str, global_batch: int, gpu_type: str,
                                  num_gpus: int, node_size: int) -> float | None:
        """The time of the most local layout (fewest nodes) — what a trace record asks for.

        Only the exact layout counts here (no nearest-layout rule), as in the papers' trace
        generator: a request is accepted only when this very allocation was measured.
        """
        per_node = gpus_per_node_of(num_gpus, node_size)
        if node_size <= 0 or num_gpus % per_node:
            return None
        return self._exact.get((model, global_batch, gpu_type, num_gpus // per_node, per_node))

    def models(self) -> tuple[str, ...]:
        return tuple(sorted({p.model for p in self.points}))

    def has_config(self, model: str, global_batch: int) -> bool:
        return any(k[0] == model and k[1] == global_batch for k in self._exact)


def load_measured(path: str | Path | None = None) -> MeasuredTable:
    """Read a measured table (CSV with the columns of ``measured_iter_time.csv``).

    Raises:
        SpecError: the file is missing, lacks a column or has an unreadable row.
    """
    path = Path(path) if path is not None else DEFAULT_MEASURED_PATH
    if not path.exists():
        raise SpecError("measured", str(path), "give a readable CSV of measured iteration times")
    try:
        return MeasuredTable(_points(path), str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError("measured", str(path), f"cannot be read as a CSV text file ({e})") from None


def _points(path: Path) -> tuple[MeasuredPoint, ...]:
    points = []
    with path.open(newline="", encoding="utf-8-sig") as f:  # a BOM (spreadsheets) is not a column
        reader = csv.DictReader(f)
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise SpecError("measured", str(path), f"missing column(s) {', '.join(missing)}")
        for i, row in enumerate(reader, start=2):
            try:
                t = float(row["iter_time_s"])
                points.append(MeasuredPoint(
                    model_name(row["model"], row["param"]), int(row["global_batch"]),
                    row["gpu_type"].strip().lower(), int(row["num_nodes"]),
                    int(row["gpus_per_node"]), t if t > 0 else None))
            except (TypeError, ValueError):
                raise SpecError(f"measured line {i}", dict(row), "numbers expected in every column") from None
    return tuple(points)


def cell_layout(cell) -> tuple[int, int]:
    """(num_nodes, gpus_per_node) a Cell asks for."""
    per_node = min(cell.gpus_per_node, cell.num_gpus)
    return (max(1, -(-cell.num_gpus // per_node)), per_node)


def mask_unmeasured(estimates: tuple, model: str, global_batch: int, table: MeasuredTable,
                    oracle: bool = False) -> tuple:
    """Estimates as a policy may see them in simulation.

    A Cell whose allocation has no measured rate becomes infeasible ("no measured rate"),
    so the runnable set is visible to every policy. With ``oracle`` the feasible Cells
    carry the measured time instead of the estimate.

    Args:
        estimates: CellEstimates from the estimator.
        model, global_batch: the job's model and batch (the table's key).
        table: the ground truth.
        oracle: replace estimated times by measured ones.
    """
    out = []
    for e in estimates:
        nodes, per_node = cell_layout(e.cell)
        t = table.iter_time_s(model, global_batch, e.cell.gpu_type, nodes, per_node)
        if t is None:
            reason = f"no measured rate for {e.cell.gpu_type} {nodes}x{per_node}"
            out.append(replace(e, feasible=False, iteration_time_s=math.inf, samples_per_s=0.0,
                               reason=e.reason or reason) if e.feasible else
                       replace(e, reason=f"{e.reason}; {reason}" if e.reason else reason))
        elif oracle:
            out.append(replace(e, feasible=True, iteration_time_s=t, samples_per_s=global_batch / t,
                               reason="", fidelity="measured"))
        else:
            out.append(e)
    return tuple(out)


def measured_estimates(spec, cluster, table: MeasuredTable, plan_space: str = "cell") -> tuple:
    """Cells of a job estimated by the measured table alone (no analytic model).

    For a site without the estimator's model files, and for tests: every GPU type of the
    cluster × counts {N/2, N, 2N} (every power of two up to 16 when no count was asked)
    × one stage, in the most local layout; the time is the measured one, and a Cell
    without a measurement is infeasible. ``plan_space`` is accepted for the estimator's
    signature; the table has one best plan per allocation whatever the plan space.
    """
    from estimator.cells import Cell, CellEstimate

    del plan_space
    out = []
    for group in cluster.node_groups:
        counts = (sorted({max(1, spec.num_gpus // 2), spec.num_gpus, 2 * spec.num_gpus})
                  if spec.num_gpus else [1, 2, 4, 8, 16])
        for n in counts:
            cell = Cell(group.gpu_type, n, gpus_per_node_of(n, group.gpus_per_node), 1)
            t = table.iter_time_s(spec.model, spec.global_batch, cell.gpu_type, *cell_layout(cell))
            if t is None:
                out.append(CellEstimate(cell, (), 1, math.inf, 0.0, 0.0, False,
                                        f"no measured rate for {cell.gpu_type} x{n}", "measured"))
            else:
                out.append(CellEstimate(cell, (), 1, t, spec.global_batch / t, 0.0, True, "", "measured"))
    return tuple(out)
