"""The compact plan string kept in a job's AdminComment, and its parser.

Format (space-separated ``key=value`` tokens; written in this order, read in any)::

    cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1
    cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1 layers=0,13,26

``cell`` is ``Cell.label()`` (GPU type, GPU count, stage count); ``plan`` lists each
stage's data- and tensor-parallel degrees; ``mb`` is the pipeline micro-batch count;
``remat`` is 1 or 0. ``layers`` (optional) gives the stage boundaries when they differ
from the Cell's default partition (``estimator.estimate.partition_stages``).

Optional memory tokens, written only when they differ from the default (so strings from
before them read the same)::

    cell=a100x8:s1 plan=[dp8tp1] mb=4 remat=1 zero=3 offload=1

``zero`` is the ZeRO stage (0–3; absent: 0, replicated states, what the runner runs);
``offload=1`` keeps master weights and optimizer states on the host (ZeRO-Offload).

A stage written ``dp4tp1ep`` (or ``dp2tp2ep``) splits its MoE experts over all its GPUs
(expert parallelism, ``StagePlan.ep``). A runner that cannot run a plan's ``zero``, ``offload``
or ``ep`` stage refuses it (``job_scripts.plan``).
"""

import re
from dataclasses import dataclass

from estimator.cells import Cell, StagePlan, stage_label
from estimator.errors import SpecError

# The longest plan a runner reads (a pipeline of about 100 stages; the estimator offers
# no Cell whose plan is longer): within a job's AdminComment with room for the rest.
MAX_PLAN_STRING = 2048
OPTIONAL_KEYS = ("layers", "zero", "offload")
_CELL_RE = re.compile(r"([a-z][a-z0-9_]*)x(\d+):s(\d+)")
_STAGE_RE = re.compile(r"dp(\d+)tp(\d+)(ep)?")


class PlanStringError(SpecError):
    """A malformed plan string; the message quotes it and shows the expected form."""

    def __init__(self, text: str, why: str):
        super().__init__("plan", text, f"{why}; expected e.g. "
                                       "'cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1'")


@dataclass(frozen=True)
class PlanString:
    """A parsed plan: the Cell's label parts, per-stage (dp, tp), micro-batches, remat."""

    gpu_type: str
    num_gpus: int
    num_stages: int
    stages: tuple[tuple[int, int], ...]
    micro_batches: int
    remat: bool
    layer_bounds: tuple[int, ...] | None = None
    zero_level: int = 0
    offload: bool = False
    expert_parallel: tuple[bool, ...] = ()  # per stage (empty: none)

    @property
    def stage_ep(self) -> tuple[bool, ...]:
        """Per stage, whether it splits its experts over its GPUs."""
        return self.expert_parallel or (False,) * len(self.stages)

    @property
    def stages_label(self) -> str:
        """``[dp2tp2|dp4tp1ep]``: the per-stage degrees as the plan string writes them."""
        return "[" + "|".join(stage_label(dp, tp, e) for (dp, tp), e in zip(self.stages, self.stage_ep)) + "]"

    @property
    def cell_label(self) -> str:
        return f"{self.gpu_type}x{self.num_gpus}:s{self.num_stages}"

    def format(self) -> str:
        """The canonical string (``parse_plan(p.format()) == p``)."""
        out = f"cell={self.cell_label} plan={self.stages_label} mb={self.micro_batches} remat={int(self.remat)}"
        if self.layer_bounds is not None:
            out += " layers=" + ",".join(str(b) for b in self.layer_bounds)
        if self.zero_level:
            out += f" zero={self.zero_level}"
        if self.offload:
            out += " offload=1"
        return out

    def stage_plans(self, default_ranges: tuple[tuple[int, int], ...]) -> tuple[StagePlan, ...]:
        """StagePlans, taking layer ranges from ``layer_bounds`` or else ``default_ranges``."""
        if self.layer_bounds is not None:
            b = self.layer_bounds
            ranges = tuple((b[i], b[i + 1]) for i in range(len(b) - 1))
        else:
            ranges = tuple(default_ranges)
        if len(ranges) != len(self.stages):
            raise SpecError("layers", ranges, f"{len(self.stages)} stages need as many layer ranges")
        return tuple(StagePlan(s, e, dp, tp, x) for (s, e), (dp, tp), x in zip(ranges, self.stages, self.stage_ep))


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def format_plan(cell: Cell, stages: tuple[StagePlan, ...], micro_batches: int, remat: bool,
                default_ranges: tuple[tuple[int, int], ...] | None = None, *,
                zero_level: int = 0, offload: bool = False) -> str:
    """The plan string of a tuned plan; ``layers=`` only when the ranges are not the default."""
    ranges = tuple((s.layer_start, s.layer_end) for s in stages)
    bounds = None
    if default_ranges is None or ranges != tuple(default_ranges):
        bounds = (ranges[0][0],) + tuple(e for _, e in ranges)
    ep = tuple(s.ep for s in stages) if any(s.ep for s in stages) else ()
    return PlanString(cell.gpu_type, cell.num_gpus, cell.num_stages,
                      tuple((s.dp, s.tp) for s in stages), micro_batches, remat, bounds,
                      zero_level, offload, ep).format()


def parse_plan(text: str) -> PlanString:
    """Parse and validate a plan string.

    Raises:
        PlanStringError: anything malformed or inconsistent, quoting the string.
    """
    if not isinstance(text, str):
        raise PlanStringError(repr(text), "not a string")
    if len(text) > MAX_PLAN_STRING:
        raise PlanStringError(text[:60] + "…", f"longer than {MAX_PLAN_STRING} characters")
    tokens = text.split()
    fields: dict[str, str] = {}
    for tok in tokens:
        key, sep, value = tok.partition("=")
        if not sep or not value:
            raise PlanStringError(text, f"token {tok!r} is not key=value")
        if key in fields:
            raise PlanStringError(text, f"{key} given twice")
        fields[key] = value
    required = ("cell", "plan", "mb", "remat")
    for key in required:
        if key not in fields:
            raise PlanStringError(text, f"missing {key}=")
    unknown = [k for k in fields if k not in (*required, *OPTIONAL_KEYS)]
    if unknown:
        raise PlanStringError(text, f"unknown key {unknown[0]!r}")
    m = _CELL_RE.fullmatch(fields["cell"])
    if not m:
        raise PlanStringError(text, f"cell={fields['cell']!r} is not <gpu>x<count>:s<stages>")
    gpu, n, s = m.group(1), int(m.group(2)), int(m.group(3))
    body = fields["plan"]
    if not (body.startswith("[") and body.endswith("]")):
        raise PlanStringError(text, "plan= must be [dpXtpY|…] in brackets")
    stages, ep = [], []
    for part in body[1:-1].split("|"):
        sm = _STAGE_RE.fullmatch(part)
        if not sm:
            raise PlanStringError(text, f"stage {part!r} is not dp<N>tp<M> (or dp<N>tp<M>ep)")
        dp, tp = int(sm.group(1)), int(sm.group(2))
        if not (_pow2(dp) and _pow2(tp)):
            raise PlanStringError(text, f"stage {part!r}: dp and tp must be powers of two")
        stages.append((dp, tp))
        ep.append(sm.group(3) is not None)
    if n < 1 or s < 1 or len(stages) != s:
        raise PlanStringError(text, f"cell has {s} stage(s) but plan lists {len(stages)}")
    if sum(dp * tp for dp, tp in stages) != n:
        raise PlanStringError(text, f"stages use {sum(dp * tp for dp, tp in stages)} GPUs, cell has {n}")
    if not re.fullmatch(r"[1-9]\d{0,7}", fields["mb"]):  # up to the largest global batch (2**24)
        raise PlanStringError(text, f"mb={fields['mb']!r} is not a positive integer")
    if fields["remat"] not in ("0", "1"):
        raise PlanStringError(text, f"remat={fields['remat']!r} must be 0 or 1")
    bounds = None
    if "layers" in fields:
        if not re.fullmatch(r"\d+(,\d+)+", fields["layers"]):
            raise PlanStringError(text, f"layers={fields['layers']!r} is not comma-separated integers")
        bounds = tuple(int(v) for v in fields["layers"].split(","))
        if len(bounds) != s + 1 or any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise PlanStringError(text, f"layers= needs {s + 1} increasing boundaries")
    zero = fields.get("zero", "0")
    if zero not in ("0", "1", "2", "3"):
        raise PlanStringError(text, f"zero={zero!r} must be 0, 1, 2 or 3 (the ZeRO stage)")
    offload = fields.get("offload", "0")
    if offload not in ("0", "1"):
        raise PlanStringError(text, f"offload={offload!r} must be 0 or 1")
    return PlanString(gpu, n, s, tuple(stages), int(fields["mb"]), fields["remat"] == "1", bounds,
                      int(zero), offload == "1", tuple(ep) if any(ep) else ())
