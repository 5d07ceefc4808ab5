"""Online refit of a GPU type's efficiency from running jobs' measured speeds (Rubick's
continuous refitting of the performance model).

``estimator.refine`` corrects one job's Cells by its own measured/estimated ratio. This
module goes one step further: from every measurement of a GPU type seen so far (one
:class:`RefitObservation` per job and plan that ran), it refits the type's physical
efficiency parameters (``estimator.compute.Efficiency``), so that every job on the type —
including those that never ran — is estimated from what the type really attains.

The fit is robust least squares (soft-L1) on the log of estimated / measured seconds per
iteration, where the estimate is ``estimator.estimate.score_plan`` of the plan that ran
with the candidate parameters: the fit uses exactly the estimator's model. Parameters are
fitted in log space within physical bounds (fractions of peaks in [0.01, 1], the per-layer
overhead in [0, 2 ms]), with a quadratic prior pulling toward the current values: one or
two far-off observations move them part of the way, a dozen consistent ones all the way,
and one outlier among many hardly at all. Only the parameters the observations say something
about are fitted (an fp16 model says nothing about ``conv_frac``, a single-node job nothing
about ``inter_node_frac``); the others keep their values.

Pure: no clock, no files (the estimator reads model files and a profile store when the
options name them).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from estimator.cells import Cell, StagePlan
from estimator.cluster import ClusterSpec
from estimator.compute import Efficiency
from estimator.errors import SpecError
from estimator.estimate import EstimateOptions, score_plan
from estimator.jobs import JobSpec
from estimator.models import model_from_yaml

# The newest observations a fit uses: bounds its time (a fit costs about
# distinct plans × (fitted parameters + 1) × iterations plan scores of ~0.2 ms each).
MAX_OBSERVATIONS = 50
# A measured time this many times off the current estimate, either way, is not the
# device's speed (a run stalled on I/O, a file written by hand): it is left out.
MAX_OFF_FACTOR = 20.0
# Soft-L1 scale of the data residuals (log of estimated / measured): within ~2 % (what
# repeated measurements of one plan scatter by) a residual counts quadratically, beyond it
# linearly, so one far-off observation pulls with a bounded force, however far off it is.
FIT_SCALE = 0.02
# The prior: each parameter's change in log space, in units of PRIOR_SIGMA (its plausible
# spread; the fitted types' values span about that much), weighted as if observations
# scattered by PRIOR_NOISE. Weighed against soft-L1 data residuals this lets a single
# observation 2× off move matmul_frac by about a factor 1.6 (not 2), while a dozen
# consistent observations move the parameters where they say (their pull adds up).
PRIOR_NOISE = 0.05
PRIOR_SIGMA = {"matmul_frac": 0.3, "conv_frac": 0.3, "memory_frac": 0.3, "layer_overhead_s": 0.7,
               "inter_node_frac": 0.5}
# Physical bounds. Fractions of datasheet peaks: [MIN_FRAC, 1]. The per-layer overhead:
# [0, MAX_OVERHEAD_S] (4× the largest fitted), fitted as log(overhead + OVERHEAD_SCALE_S) so
# that 0 is reachable and the fitted types' range (6 µs to 456 µs) is under two units of log.
# A refit is written only when it cuts the median error by at least this much (absolute)
# and a tenth of it: a refit that changes nothing measurable still invalidates every cached
# estimate, and a trigger repeated at each checkpoint wrote one every interval.
MIN_GAIN_FRAC = 0.01
MIN_FRAC = 0.01
OVERHEAD_SCALE_S = 1e-4
MAX_OVERHEAD_S = 2e-3
OVERHEAD = "layer_overhead_s"
CANDIDATES = ("matmul_frac", "conv_frac", "memory_frac", OVERHEAD, "inter_node_frac")
# A parameter is fitted when changing it (a fraction halved, the overhead + 100 µs) changes
# some observation's estimate by more than MIN_SENSITIVITY (log): otherwise the
# observations cannot tell, and it keeps its value (half_rate_gflop is never refitted: it
# trades off against matmul_frac, and the profile's kernels measure it directly).
SENSITIVITY_PROBE_OVERHEAD_S = 1e-4
MIN_SENSITIVITY = 0.01


@dataclass(frozen=True)
class RefitObservation:
    """One measured speed of one plan that ran.

    Attributes:
        model: the job's model (built-in name or YAML path), as the estimator loads it.
        global_batch: the job's samples per iteration.
        cell: the Cell that ran (its GPU type, count, GPUs per node, stages).
        stages: the plan that ran: per stage its layer range, dp and tp.
        micro_batches: micro-batches per iteration of that plan.
        remat: whether it rematerialized.
        iteration_time_s: measured seconds per iteration.
        job_id: the job that measured it (for logs).
        observed_s: when it was measured (Unix seconds); newer ones are kept first.
        zero_level: the plan's ZeRO stage (its collectives and memory are the estimate's).
        model_text: a model file's YAML as it was read when the job ran (by whoever could
            read it): scored from this, the file is never opened again. "" for a built-in.
    """

    model: str
    global_batch: int
    cell: Cell
    stages: tuple[StagePlan, ...]
    micro_batches: int
    remat: bool
    iteration_time_s: float
    job_id: str = ""
    observed_s: float = 0.0
    zero_level: int = 0
    model_text: str = ""

    def plan_key(self) -> tuple:
        """What the estimate depends on (observations with equal keys share one score)."""
        return (self.model, self.global_batch, self.cell, self.stages, self.micro_batches, self.remat,
                self.zero_level, self.model_text)

    def job_spec(self) -> JobSpec:
        """The job as the estimate scores it: a model file from ``model_text`` when kept."""
        model = model_from_yaml(self.model_text, self.model) if self.model_text else None
        return JobSpec(self.model, self.global_batch, model_spec=model)

    def to_json(self) -> dict:
        return {"model": self.model, "global_batch": self.global_batch,
                "cell": [self.cell.gpu_type, self.cell.num_gpus, self.cell.gpus_per_node, self.cell.num_stages],
                "stages": [s.as_row() for s in self.stages],
                "micro_batches": self.micro_batches, "remat": self.remat,
                "iteration_time_s": self.iteration_time_s, "job_id": self.job_id,
                "observed_s": self.observed_s, "zero_level": self.zero_level,
                **({"model_text": self.model_text} if self.model_text else {})}

    @classmethod
    def from_json(cls, raw: dict) -> "RefitObservation":
        """The inverse of :meth:`to_json`.

        Raises:
            SpecError: a field is missing or of the wrong kind (quoting it).
        """
        try:
            obs = cls(str(raw["model"]), int(raw["global_batch"]), Cell(*raw["cell"]),
                       tuple(StagePlan(*s) for s in raw["stages"]), int(raw["micro_batches"]),
                       bool(raw["remat"]), float(raw["iteration_time_s"]), str(raw.get("job_id", "")),
                       float(raw.get("observed_s", 0.0)), int(raw.get("zero_level", 0)),
                       str(raw.get("model_text", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError("refit_observation", raw, f"not an observation ({e!r})") from None
        if not (math.isfinite(obs.iteration_time_s) and obs.iteration_time_s > 0):
            raise SpecError("refit_observation", raw, "iteration_time_s is not a positive number of seconds")
        return obs


@dataclass(frozen=True)
class RefitResult:
    """A refit of one GPU type.

    Attributes:
        gpu_type: the type refitted.
        efficiency: the new parameters (the current ones where nothing was fitted).
        observations: observations the fit used.
        median_error_before_frac: median |estimated / measured − 1| with the current
            parameters, over those observations.
        median_error_after_frac: the same with the new parameters.
        fitted: names of the parameters the fit moved (the others kept their values).
    """

    gpu_type: str
    efficiency: Efficiency
    observations: int
    median_error_before_frac: float
    median_error_after_frac: float
    fitted: tuple[str, ...] = ()

    @property
    def improved(self) -> bool:
        before = self.median_error_before_frac
        return self.observations > 0 and self.median_error_after_frac <= before - max(MIN_GAIN_FRAC, 0.1 * before)


def _to_x(name: str, value: float) -> float:
    return math.log(value + OVERHEAD_SCALE_S) if name == OVERHEAD else math.log(value)


def _from_x(name: str, x: float) -> float:
    return max(0.0, math.exp(x) - OVERHEAD_SCALE_S) if name == OVERHEAD else math.exp(x)


def _bounds(name: str) -> tuple[float, float]:
    if name == OVERHEAD:
        return _to_x(name, 0.0), _to_x(name, MAX_OVERHEAD_S)
    return math.log(MIN_FRAC), 0.0


class _Scorer:
    """Estimated seconds per iteration of each distinct plan, for candidate parameters."""

    def __init__(self, gpu_type: str, cluster: ClusterSpec, options: EstimateOptions,
                 plans: Sequence[RefitObservation]):
        self.gpu_type, self.cluster, self.options, self.plans = gpu_type, cluster, options, plans

    def __call__(self, eff: Efficiency) -> np.ndarray:
        opts = replace(self.options, efficiency={self.gpu_type: eff})
        return np.array([score_plan(p.job_spec(), p.cell, self.cluster, p.stages,
                                    p.micro_batches, p.remat,
                                    replace(opts, memory=replace(opts.memory, zero_level=p.zero_level))
                                    ).iteration_time_s for p in self.plans])


def _usable(gpu_type: str, cluster: ClusterSpec, options: EstimateOptions,
            observations: Sequence[RefitObservation], current: Efficiency
            ) -> tuple[list[RefitObservation], list[RefitObservation], np.ndarray]:
    """The observations the estimator can score (their distinct plans and the current
    estimates of those): a model file gone or a Cell the cluster lost drops one, and so
    does a time over ``MAX_OFF_FACTOR`` off the estimate (a stalled run, a bad file)."""
    plans: dict[tuple, RefitObservation] = {}
    for o in observations:
        plans.setdefault(o.plan_key(), o)
    kept_plans, times = [], []
    for p in plans.values():
        try:
            t = _Scorer(gpu_type, cluster, options, [p])(current)[0]
        except (SpecError, KeyError, ValueError, ArithmeticError):
            continue
        if math.isfinite(t) and t > 0:
            kept_plans.append(p)
            times.append(t)
    estimate_of = {p.plan_key(): t for p, t in zip(kept_plans, times)}
    kept = [o for o in observations if o.plan_key() in estimate_of
            and 1 / MAX_OFF_FACTOR <= o.iteration_time_s / estimate_of[o.plan_key()] <= MAX_OFF_FACTOR]
    return kept, kept_plans, np.array(times)


def refit_efficiency(gpu_type: str, current: Efficiency, cluster: ClusterSpec,
                     observations: Sequence[RefitObservation],
                     options: EstimateOptions = EstimateOptions(),
                     max_observations: int = MAX_OBSERVATIONS, anchor: Efficiency | None = None) -> RefitResult:
    """Refit one GPU type's efficiency parameters to measured seconds per iteration.

    Args:
        gpu_type: the type to refit; observations of other types are ignored.
        current: the type's parameters now (the start, and the prior's centre without
            ``anchor``).
        cluster: the cluster spec the plans ran on (node layout, network).
        observations: measurements of the type; the newest ``max_observations`` are used.
        options: estimator options other than the efficiency (e.g. ``profile_db``, whose
            collectives and layer timings stay as the estimator uses them).
        max_observations: cap on the observations used (newest first).
        anchor: the prior's centre: parameters no refit moved (the profile's fit, the
            datasheet's). Centred on the last refit, the prior moved with every refit, and
            one job's measurements took over the type in two refits.

    Returns:
        The new parameters and the median relative error before and after; with no
        usable observation, or nothing the observations can tell, the current parameters
        and equal errors.
    """
    mine = sorted((o for o in observations if o.cell.gpu_type == gpu_type and math.isfinite(o.iteration_time_s)
                   and o.iteration_time_s > 0),
                  key=lambda o: -o.observed_s)[:max_observations]
    mine, plans, before_t = _usable(gpu_type, cluster, options, mine, current)
    if not mine:
        return RefitResult(gpu_type, current, 0, 0.0, 0.0)
    score = _Scorer(gpu_type, cluster, options, plans)
    index = {p.plan_key(): i for i, p in enumerate(plans)}
    which = np.array([index[o.plan_key()] for o in mine])
    measured = np.array([o.iteration_time_s for o in mine])

    def median_error(times: np.ndarray) -> float:
        return float(statistics.median(np.abs(times[which] / measured - 1.0)))

    before = median_error(before_t)
    names = _identifiable(score, current, before_t)
    if not names:
        return RefitResult(gpu_type, current, len(mine), before, before)
    lower = np.array([_bounds(n)[0] for n in names])
    upper = np.array([_bounds(n)[1] for n in names])
    x0 = np.clip([_to_x(n, max(getattr(current, n), 1e-12)) for n in names], lower,
                 np.nextafter(upper, -np.inf))

    prior_w = np.array([PRIOR_NOISE / PRIOR_SIGMA[n] for n in names])
    centre = x0 if anchor is None else np.clip([_to_x(n, max(getattr(anchor, n), 1e-12)) for n in names], lower,
                                               np.nextafter(upper, -np.inf))

    def candidate(x: np.ndarray) -> Efficiency:
        return replace(current, **{n: _from_x(n, v) for n, v in zip(names, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        t = score(candidate(x))
        data = np.log(np.maximum(t[which], 1e-12) / measured)
        return np.concatenate([data, _quadratic_under_soft_l1(prior_w * (x - centre))])

    sol = least_squares(residuals, x0, bounds=(lower, upper), loss="soft_l1", f_scale=FIT_SCALE,
                        x_scale=1.0, ftol=1e-5, xtol=1e-5, gtol=1e-8, max_nfev=60)
    new = candidate(sol.x)
    after = median_error(score(new))
    return RefitResult(gpu_type, new, len(mine), before, after, names)


def _quadratic_under_soft_l1(q: np.ndarray) -> np.ndarray:
    """Residuals whose soft-L1 cost is exactly q²: the prior stays a Gaussian (quadratic)
    pull however far a parameter moves. Under soft-L1 alone it would turn linear past
    FIT_SCALE, and a single observation could drag a parameter to its bound.

    soft-L1 costs C²·2(√(1 + g²/C²) − 1) for a residual g; that equals q² for
    g = q·√(1 + q²/(4C²)).
    """
    return q * np.sqrt(1.0 + q * q / (4.0 * FIT_SCALE * FIT_SCALE))


def _identifiable(score: _Scorer, current: Efficiency, base_t: np.ndarray) -> tuple[str, ...]:
    """The parameters some observation's estimate depends on (see MIN_SENSITIVITY)."""
    out = []
    for name in CANDIDATES:
        value = getattr(current, name)
        probe = value + SENSITIVITY_PROBE_OVERHEAD_S if name == OVERHEAD else 0.5 * value
        t = score(replace(current, **{name: probe}))
        if np.max(np.abs(np.log(t / base_t))) > MIN_SENSITIVITY:
            out.append(name)
    return tuple(out)
