"""Trace records → large-model training jobs: the seeded mapping of the Crius/Arena papers.

A trace CSV (``job_id,submit_time_s,duration_s,num_gpus,gpu_type,status``) records when
general DL jobs arrived and how long they ran. Each kept record becomes one large-model
job by the papers' tables (``regenerate_sim_trace.py`` of the Crius artifact, written
down in docs/simulation.md):

* draws, each a uniform integer below the last threshold, mapped by cumulative
  thresholds: model family over [wide_resnet, gpt, moe] with [15, 40, 100]; batch index
  over the family's three global batches with [50, 60, 65]; size index over the
  family's six sizes with [10, 25, 50, 70, 85, 95]; GPU count over [1, 2, 4, 8, 16] with
  [10, 25, 45, 65, 80] cut at threshold[min(4, size index + 2)]; requested GPU type
  over [a100, v100, a40, a10] with [15, 30, 60, 90];
* rejection: the whole tuple is drawn again until the measured table has the requested
  allocation in its most local layout (fewest nodes) with at most 300 s per iteration;
* iterations: ``duration_s // t_req`` where ``t_req`` is that measured time (the Philly
  formula ``5·iters·bs/new_bs`` needs the original iteration count and batch, which the
  extract does not keep; the processed samples are the recorded duration at the requested
  rate). Helios and PAI records outside [2000, 10000] / [1000, 5000] iterations draw a
  uniform count inside instead. The simulator's division by 5 (floor, at least 1)
  follows;
* deadline: submit + 1.5 × the pre-division duration, stretched by the simulator's rule
  ``now + 5·(ddl − now)``;
* the papers' Philly trace (``itp_cluster08``) keeps only submissions at or after
  1,945,572 s; times are then shifted so the first kept job arrives at 0;
* density: each record is kept with probability ``density`` (a separate draw), so the
  mapping of a kept record does not depend on the density.

Every record uses its own random stream seeded by (seed, job id), so the mapping is the
same for every policy and every run with the same seed.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

from estimator.errors import SpecError
from estimator.gpus import CATALOG
from estimator.jobs import JobSpec
from policy.measured import MeasuredTable

MAX_DURATION_S = 10 * 365 * 86400.0
TRACE_COLUMNS = ("job_id", "submit_time_s", "duration_s", "num_gpus", "gpu_type", "status")

FAMILIES = ("wide_resnet", "gpt", "moe")
FAMILY_THRESHOLDS = (15, 40, 100)
BATCHES = {"gpt": (128, 256, 512), "moe": (256, 512, 1024), "wide_resnet": (256, 512, 1024)}
BATCH_THRESHOLDS = (50, 60, 65)
# Six sizes per family; the last has no measurements, so it is always rejected.
SIZES = {
    "gpt": ("760m", "1.3b", "2.6b", "6.7b", "15b", "39b"),
    "moe": ("690m", "1.3b", "2.4b", "10b", "27b", "70b"),
    "wide_resnet": ("500m", "1b", "2b", "4b", "6.8b", "13b"),
}
SIZE_THRESHOLDS = (10, 25, 50, 70, 85, 95)
GPU_COUNTS = (1, 2, 4, 8, 16)
GPU_COUNT_THRESHOLDS = (10, 25, 45, 65, 80)
GPU_TYPES = ("a100", "v100", "a40", "a10")
GPU_TYPE_THRESHOLDS = (15, 30, 60, 90)
MAX_ITER_TIME_S = 300.0
MAX_DRAWS = 10_000
SIM_ITER_DIVISOR = 5
DEADLINE_FACTOR = 1.5
DEADLINE_STRETCH = 5.0


@dataclass(frozen=True)
class TraceKind:
    """How one family of traces turns durations into iterations.

    Attributes:
        name: ``philly`` (the ITP/Philly traces) or ``helios`` / ``pai``.
        min_submit_s: records submitted earlier are skipped.
        iteration_bounds: (low, high) before the simulator's division; a count outside
            is redrawn uniformly inside. None keeps the computed count.
    """

    name: str
    min_submit_s: float = 0.0
    iteration_bounds: tuple[int, int] | None = None


TRACE_KINDS = {
    "itp": TraceKind("philly", min_submit_s=1_945_572),
    "philly": TraceKind("philly"),
    "helios": TraceKind("helios", iteration_bounds=(2000, 10000)),
    "pai": TraceKind("pai", iteration_bounds=(1000, 5000)),
}


def trace_kind_for(path: str | Path) -> TraceKind:
    """The kind of a trace file from its name (``itp_cluster08.csv`` → the Philly filter)."""
    name = Path(path).name.lower()
    if name.startswith("itp"):
        return TRACE_KINDS["itp"]
    if "helios" in name or "venus" in name:
        return TRACE_KINDS["helios"]
    if name.startswith("pai"):
        return TRACE_KINDS["pai"]
    return TRACE_KINDS["philly"]


@dataclass(frozen=True)
class TraceRecord:
    """One row of a trace file."""

    job_id: str
    submit_time_s: float
    duration_s: float
    num_gpus: int


@dataclass(frozen=True)
class TraceJob:
    """A trace record turned into a large-model training job.

    Attributes:
        job_id: the record's id.
        submit_time_s: arrival, seconds from the first kept arrival.
        spec: model, global batch, requested GPU count and type.
        iterations: training iterations to run.
        requested_iter_time_s: measured seconds per iteration on the requested allocation.
        deadline_s: when it should finish, on the same time line as ``submit_time_s``.
        draws: how many tuples were drawn before one was accepted.
    """

    job_id: str
    submit_time_s: float
    spec: JobSpec
    iterations: int
    requested_iter_time_s: float
    deadline_s: float | None
    draws: int = 1

    @property
    def requested_gpu_s(self) -> float:
        """GPU-seconds the job asks for: iterations × requested time × GPUs."""
        return self.iterations * self.requested_iter_time_s * (self.spec.num_gpus or 1)


def read_trace(path: str | Path) -> tuple[TraceRecord, ...]:
    """The records of a trace CSV, in file order.

    Raises:
        SpecError: missing file, missing column, a row that does not parse, or a job id
            given twice.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecError("trace", str(path), "give a readable CSV with header " + ",".join(TRACE_COLUMNS))
    try:
        return _records(path)
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError("trace", str(path), f"cannot be read as a CSV text file ({e})") from None


def _records(path: Path) -> tuple[TraceRecord, ...]:
    out = []
    first_line: dict[str, int] = {}  # job id → the line that gave it
    with path.open(newline="", encoding="utf-8-sig") as f:  # a BOM (spreadsheets) is not a column
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS[:4] if c not in (reader.fieldnames or ())]
        if missing:
            raise SpecError("trace", str(path), f"missing column(s) {', '.join(missing)}; "
                            f"expected header {','.join(TRACE_COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            try:
                rec = TraceRecord((row["job_id"] or "").strip(), float(row["submit_time_s"]),
                                  float(row["duration_s"]), int(row["num_gpus"]))
            except (TypeError, ValueError):
                raise SpecError(f"{path.name} line {line}", dict(row),
                                "submit_time_s, duration_s and num_gpus must be numbers") from None
            # A job that ended at once (duration 0) or asked for no GPU is still an arrival:
            # the mapping draws its own GPU count and gives it at least one iteration.
            if not (math.isfinite(rec.submit_time_s) and rec.submit_time_s >= 0
                    and math.isfinite(rec.duration_s) and rec.duration_s >= 0 and rec.num_gpus >= 0):
                raise SpecError(f"{path.name} line {line}", dict(row),
                                "submit_time_s and duration_s must be finite and ≥ 0, num_gpus ≥ 0")
            if not rec.job_id:
                raise SpecError(f"{path.name} line {line}", dict(row), "job_id is empty; each job needs its own id")
            if rec.duration_s > MAX_DURATION_S:
                raise SpecError(f"{path.name} line {line}", rec.duration_s,
                                f"duration_s over {MAX_DURATION_S:.0f} s (ten years): not a job's run time")
            if rec.job_id in first_line:
                raise SpecError(f"{path.name} line {line}", rec.job_id,
                                f"job_id already given on line {first_line[rec.job_id]}; each job needs its own id")
            first_line[rec.job_id] = line
            out.append(rec)
    return tuple(out)


def _pick(rng: random.Random, values: tuple, thresholds: tuple[int, ...], limit: int | None = None):
    """A uniform integer below ``limit`` (default the last threshold) mapped by thresholds."""
    draw = rng.randint(0, (limit if limit is not None else thresholds[-1]) - 1)
    for value, threshold in zip(values, thresholds):
        if draw < threshold:
            return value
    raise AssertionError("draw beyond the last threshold")


def draw_request(rng: random.Random) -> tuple[str, int, int, int, str]:
    """One (family, size index, global batch, GPU count, GPU type) draw of the tables."""
    family = _pick(rng, FAMILIES, FAMILY_THRESHOLDS)
    batch = _pick(rng, BATCHES[family], BATCH_THRESHOLDS)
    size_index = _pick(rng, tuple(range(6)), SIZE_THRESHOLDS)
    count_limit = GPU_COUNT_THRESHOLDS[min(len(GPU_COUNTS) - 1, size_index + 2)]
    num_gpus = _pick(rng, GPU_COUNTS, GPU_COUNT_THRESHOLDS, count_limit)
    gpu = _pick(rng, GPU_TYPES, GPU_TYPE_THRESHOLDS)
    return family, size_index, batch, num_gpus, gpu


def map_record(record: TraceRecord, measured: MeasuredTable, seed: int, kind: TraceKind,
               submit_offset_s: float = 0.0) -> TraceJob:
    """The job a record becomes (deterministic in seed and job id).

    Raises:
        SpecError: no drawable tuple is in the measured table (a table without the papers'
            models), after ``MAX_DRAWS`` draws.
    """
    rng = random.Random(f"{seed}:{record.job_id}")
    for draws in range(1, MAX_DRAWS + 1):
        family, size_index, batch, num_gpus, gpu = draw_request(rng)
        model = f"{family}-{SIZES[family][size_index]}"
        t_req = measured.best_locality_iter_time_s(model, batch, gpu, num_gpus, CATALOG[gpu].gpus_per_node)
        if t_req is not None and t_req <= MAX_ITER_TIME_S:
            break
    else:
        raise SpecError("measured", measured.source, "no drawn job configuration is measured; "
                        "use a table with the papers' gpt/moe/wide_resnet rows")
    iters_pre = int(record.duration_s // t_req)
    if kind.name == "philly":
        # 5·samples/new_bs in the papers, divided by 5 again in their simulator.
        iters_pre *= SIM_ITER_DIVISOR
    elif kind.iteration_bounds is not None:
        low, high = kind.iteration_bounds
        if not low <= iters_pre <= high:
            iters_pre = rng.randint(low, high)
    iterations = max(1, iters_pre // SIM_ITER_DIVISOR)
    submit_s = record.submit_time_s - submit_offset_s
    # At least the iterations it was given (a record of no duration runs one).
    pre_duration_s = max(record.duration_s if kind.name == "philly" else iters_pre * t_req, iterations * t_req)
    deadline_s = submit_s + DEADLINE_STRETCH * DEADLINE_FACTOR * pre_duration_s
    spec = JobSpec(model, batch, num_gpus, gpu)
    return TraceJob(record.job_id, submit_s, spec, iterations, t_req, deadline_s, draws)


def map_trace(records: tuple[TraceRecord, ...], measured: MeasuredTable, seed: int = 0,
              density: float = 1.0, kind: TraceKind = TRACE_KINDS["philly"]) -> tuple[TraceJob, ...]:
    """Every kept record mapped to a job, ordered by submission (then file order).

    Args:
        records: the trace's rows.
        measured: the ground-truth table (decides which requests are accepted).
        seed: the mapping's seed.
        density: the share of records kept, in (0, 1].
        kind: the trace family (submit filter, iteration rule).

    Raises:
        SpecError: density outside (0, 1].
    """
    if not 0 < density <= 1:
        raise SpecError("density", density, "give a fraction in (0, 1]")
    kept = []
    for index, rec in enumerate(records):
        if rec.submit_time_s < kind.min_submit_s:
            continue
        if density < 1 and random.Random(f"density:{seed}:{rec.job_id}:{index}").random() >= density:
            continue
        kept.append((rec.submit_time_s, index, rec))
    kept.sort(key=lambda x: (x[0], x[1]))
    if not kept:
        return ()
    offset_s = kept[0][0]
    return tuple(map_record(rec, measured, seed, kind, offset_s) for _, _, rec in kept)


def offered_load(jobs: tuple[TraceJob, ...], capacity_gpus: int) -> float:
    """GPU-hours the jobs ask for ÷ GPU-hours the cluster offers while they arrive.

    The window is first to last arrival (at least one hour, so a tiny trace is not
    divided by zero); each job's ask is its iterations at the requested allocation.
    """
    if not jobs or capacity_gpus <= 0:
        return 0.0
    window_s = max(3600.0, jobs[-1].submit_time_s - jobs[0].submit_time_s)
    return sum(j.requested_gpu_s for j in jobs) / (capacity_gpus * window_s)
