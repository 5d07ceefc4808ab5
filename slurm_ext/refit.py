"""The daemon's online refit (Rubick's continuous refitting of the performance model).

Every round the daemon reads each running job's ``measured.json``. Besides refining that
job's own Cells (``estimator.refine``), each new measurement becomes an observation of its
GPU type (:func:`observation_from_report`: the plan that ran and its measured seconds per
iteration), kept in the daemon's state store. When one is off the estimate of the plan
that ran by more than ``refit_threshold_frac``, the type is due a refit
(:class:`RefitGate`); after the round's actions the type's efficiency is refitted from all
its observations (``estimator.online_refit``) and, when that lowers their median error,
written into the profile store (``estimator.profile_store.write_refit``), which every
estimate of the type then uses (the estimate cache is keyed by the store's version).

Observations live in the daemon's state store, not in the profile store: the profile store
is the site's measurement record, written by profiling jobs and read by every estimate,
and only what the daemon concludes (a refit, with its error before and after) belongs
there; the observations are the daemon's own bookkeeping — one row per job and plan,
rewritten as the runner rewrites ``measured.json`` — and the state store is already
where what the daemon learns across rounds survives a restart.

:func:`observation_from_report` and :class:`RefitGate` are pure (tested without Slurm);
:class:`OnlineRefitter` is the edge that stores, fits, writes and logs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from estimator.cells import CellEstimate
from estimator.cluster import ClusterSpec
from estimator.compute import Efficiency, efficiency
from estimator.errors import SpecError
from estimator.estimate import EstimateOptions, score_plan
from estimator.gpus import gpu_type as catalog_gpu
from estimator.online_refit import MAX_OBSERVATIONS, RefitObservation, RefitResult, refit_efficiency
from estimator.plan_string import format_plan
from estimator.profile_store import load_profile_view, write_refit
from estimator.refine import Measurement
from slurm_ext.config import DaemonConfig
from slurm_ext.observe import kv, running_plan_from_text
from slurm_ext.store import Store

log = logging.getLogger(__name__)

# A GPU type is refitted at most once per this many seconds. Each refit rewrites the
# profile store, which makes every cached estimate stale (each elastic job is estimated
# anew next round: seconds for a long queue) and shifts the estimates the policy weighs,
# so refits in quick succession would churn its decisions (a rescale costs a restart);
# and runners rewrite measured.json at every checkpoint, so waiting lets the measurements
# of several jobs, and steadier means, go into one fit.
REFIT_MIN_INTERVAL_S = 600.0


def observation_from_report(job_id: int, model: str, global_batch: int,
                            estimates: Iterable[CellEstimate], measurement: Measurement,
                            measured_text: str, now_s: float, model_text: str = "") -> RefitObservation | None:
    """The plan a running job runs and its measured speed, as an observation.

    The plan is the one ``measured.json`` names (the runner may have tuned it; without
    ``layers=`` its stages take the Cell estimate's layer ranges — the default split the
    runner uses too), else the Cell estimate's plan. None when the measured Cell is not
    among the job's estimates.
    """
    est = next((e for e in estimates if e.cell.label() == measurement.cell_label and e.stages), None)
    if est is None:
        return None
    stages, micro_batches, remat, zero_level = est.stages, est.micro_batches, est.remat, est.zero_level
    run = running_plan_from_text(measured_text)
    if run is not None and run.plan.cell_label == measurement.cell_label:
        try:
            stages = run.plan.stage_plans(tuple((s.layer_start, s.layer_end) for s in est.stages))
        except SpecError:
            return None
        micro_batches, remat, zero_level = run.plan.micro_batches, run.plan.remat, run.plan.zero_level
    return RefitObservation(model, global_batch, est.cell, stages, micro_batches, remat,
                            measurement.iteration_time_s, str(job_id), now_s, zero_level, model_text)


def plan_key(obs: RefitObservation) -> str:
    """The plan string of an observation (with its layer ranges): one stored row per job
    and plan."""
    return format_plan(obs.cell, obs.stages, obs.micro_batches, obs.remat, zero_level=obs.zero_level)


def off_by_text(job_id: str, error_frac: float) -> str:
    """``job 123 off by +23 %``: a refit's trigger, as the profile store records it."""
    return f"job {job_id} off by {error_frac * 100:+.0f} %"


@dataclass(frozen=True)
class RefitGate:
    """Which GPU types are due a refit: those with a measurement off its estimate by more
    than the threshold since their last refit, at most one refit per type per interval.

    Attributes:
        last_refit_s: GPU type → when it was last refitted (kept in the state store).
        pending: GPU type → (|error| of its worst measurement since, its trigger text).
    """

    last_refit_s: dict[str, float] = field(default_factory=dict, hash=False)
    pending: dict[str, tuple[float, str]] = field(default_factory=dict, hash=False)

    def note(self, gpu_type: str, job_id: str, error_frac: float, threshold_frac: float) -> "RefitGate":
        """The gate after a measurement off its estimate by ``error_frac`` (measured /
        estimated − 1); a type keeps the worst measurement as its trigger."""
        if not abs(error_frac) > threshold_frac:
            return self
        worst = self.pending.get(gpu_type)
        if worst is not None and worst[0] >= abs(error_frac):
            return self
        trigger = off_by_text(job_id, error_frac)
        return replace(self, pending={**self.pending, gpu_type: (abs(error_frac), trigger)})

    def due(self, now_s: float, min_interval_s: float = REFIT_MIN_INTERVAL_S) -> tuple[tuple[str, str], ...]:
        """(GPU type, trigger) of each pending type whose last refit is ``min_interval_s`` ago."""
        return tuple((t, trigger) for t, (_, trigger) in sorted(self.pending.items())
                     if now_s - self.last_refit_s.get(t, float("-inf")) >= min_interval_s)

    def done(self, gpu_type: str, now_s: float) -> "RefitGate":
        """The gate after a refit of the type (written or not): nothing pending, the clock restarted."""
        return RefitGate({**self.last_refit_s, gpu_type: now_s},
                         {t: v for t, v in self.pending.items() if t != gpu_type})


def _utc(now_s: float) -> str:
    return datetime.fromtimestamp(now_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _existing(profile_db: str) -> str | None:
    """The profile store when it exists (estimates ignore one not yet written)."""
    return profile_db if Path(profile_db).is_file() else None


class OnlineRefitter:
    """Observations kept in the state store, refits written into the profile store.

    Args:
        store: the daemon's state store (``slurm_ext.store.Store``).
        config: returns the daemon's current config (``profile_db``, ``refit_threshold_frac``).
        min_interval_s: the shortest time between two refits of one GPU type.
    """

    def __init__(self, store: Store, config: Callable[[], DaemonConfig],
                 min_interval_s: float = REFIT_MIN_INTERVAL_S):
        self.store = store
        self._config = config
        self.min_interval_s = min_interval_s
        self.gate = RefitGate(dict(store.refit_times()))
        # Job id → the last observation taken from its measured.json: the file is read
        # every round, and only a new measurement is stored and weighed.
        self._seen: dict[int, RefitObservation] = {}

    def observe(self, job_id: int, model: str, global_batch: int, estimates: tuple[CellEstimate, ...],
                measurement: Measurement, measured_text: str, cluster: ClusterSpec, now_s: float,
                model_text: str = "") -> None:
        """Take a running job's measurement of its current Cell (a trusted one: GPU, or CPU
        where the config allows it). ``model_text``: a model file's YAML, as read for the
        job's owner (kept with the observation: the daemon never reopens the path)."""
        cfg = self._config()
        obs = observation_from_report(job_id, model, global_batch, estimates, measurement, measured_text, now_s,
                                      model_text)
        if obs is None or replace(obs, observed_s=0.0) == self._seen.get(job_id):
            return
        self._seen[job_id] = replace(obs, observed_s=0.0)
        try:
            self.store.put_refit_observation(job_id, plan_key(obs), obs.cell.gpu_type, obs.to_json(), now_s,
                                             MAX_OBSERVATIONS)
            options = EstimateOptions(profile_db=_existing(cfg.profile_db))  # under the plan's ZeRO, as the refit
            options = replace(options, memory=replace(options.memory, zero_level=obs.zero_level))
            estimated_s = score_plan(obs.job_spec(), obs.cell, cluster, obs.stages,
                                     obs.micro_batches, obs.remat, options).iteration_time_s
        except Exception as e:  # noqa: BLE001 - the refit is an aid: it must never fail a round
            log.warning(kv("refit_observation_failed", job_id=job_id, error=repr(e)))
            return
        self.gate = self.gate.note(obs.cell.gpu_type, str(job_id), obs.iteration_time_s / estimated_s - 1.0,
                                   cfg.refit_threshold_frac)

    def refit_due(self, cluster: ClusterSpec, active_job_ids: Iterable[int], now_s: float) -> list[RefitResult]:
        """Refit every GPU type that is due; returns the refits written."""
        keep = set(active_job_ids)
        self._seen = {j: o for j, o in self._seen.items() if j in keep}
        written = []
        for gpu_type, trigger in self.gate.due(now_s, self.min_interval_s):
            self.gate = self.gate.done(gpu_type, now_s)
            try:
                self.store.put_refit_time(gpu_type, now_s)
                result = self._refit(gpu_type, trigger, cluster, now_s)
            except Exception as e:  # noqa: BLE001 - the refit is an aid: it must never fail a round
                log.exception(kv("efficiency_refit_failed", gpu_type=gpu_type, error=repr(e)))
                continue
            if result is not None:
                written.append(result)
        return written

    def _refit(self, gpu_type: str, trigger: str, cluster: ClusterSpec, now_s: float) -> RefitResult | None:
        profile_db = self._config().profile_db
        observations = []
        for raw in self.store.refit_observations(gpu_type, MAX_OBSERVATIONS):
            try:
                obs = RefitObservation.from_json(raw)
            except SpecError as e:  # one bad row (kept from an earlier version) must not stop the type's refits
                log.warning(kv("refit_observation_skipped", gpu_type=gpu_type, error=e))
                continue
            if "/" in obs.model and not obs.model_text:  # kept without what was read: the path is not reopened
                continue
            observations.append(obs)
        existing = _existing(profile_db)
        current, anchor = current_efficiency(existing, gpu_type)
        result = refit_efficiency(gpu_type, current, cluster, observations, EstimateOptions(profile_db=existing),
                                  anchor=anchor)
        params = {n: f"{getattr(result.efficiency, n):.4g}" for n in result.fitted}
        fields = dict(gpu_type=gpu_type, observations=result.observations,
                      error_before=result.median_error_before_frac, error_after=result.median_error_after_frac,
                      trigger=trigger, **params)
        if not result.improved:
            log.info(kv("efficiency_refit_kept", **fields))
            return None
        write_refit(profile_db, gpu_type, result.efficiency, result.observations,
                    result.median_error_before_frac, result.median_error_after_frac, trigger, _utc(now_s))
        log.info(kv("efficiency_refit", **fields))
        return result


def current_efficiency(profile_db: str | None, gpu_type: str) -> tuple[Efficiency, Efficiency]:
    """What the estimator uses for the type now (the profile store's newest refit, else its
    profile's fit, else the shipped parameters), and the same without refits: the refit's
    prior. The store is read once for both."""
    shipped = efficiency(catalog_gpu(gpu_type))
    if profile_db is None:
        return shipped, shipped
    view = load_profile_view(profile_db)
    anchor = view.fitted.get(gpu_type, shipped)
    return view.efficiencies.get(gpu_type, anchor), anchor
