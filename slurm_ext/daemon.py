"""The scheduler service: observe Slurm → estimate → decide → act, every round.

A round reads every job and node from Slurm, parses the specs of elastic jobs (comment
``elastic``), estimates their Cells (cached in the state store), builds the policy's
Snapshot (`slurm_ext.observe`), asks the policy, and applies the difference through
journaled Slurm commands (`slurm_ext.act`); plain jobs are never touched, their GPUs
count as used.

This module is the service around that: the loop, stop and reload requests, recovery at
start, back-off while Slurm is unreachable, and the poll for new elastic jobs between
rounds. Logs are ``key=value`` lines.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass, replace

from estimator.cells import Cell
from estimator.cluster import ClusterSpec
from estimator.contract import MAX_MEASURED_BYTES, MEASURED_FILE, ElasticSpecError
from estimator.estimate import EstimateOptions
from estimator.errors import SpecError
from estimator.jobs import JobSpec
from estimator.models import BUILTIN_MODELS
from estimator.refine import refine
from policy.clock import Clock, WallClock
from policy.forecast import GpuRelease, forecast
from policy.interface import (
    DROPPED_PREFIX, PENDING, RUNNING, TRIGGER_ARRIVAL, TRIGGER_COMPLETION, TRIGGER_ROUND, Decision,
    DecisionError, DerivedCache, JobView, Policy, validate_decision,
)
from policy.placement import job_fitting_idle_gpus
from policy.registry import make_policy
from slurm_ext.act import Actor, Acts
from slurm_ext.background_forecast import BackgroundForecast
from slurm_ext.config import DaemonConfig
from slurm_ext.errors import SlurmExtError
from slurm_ext.guarantees import GuaranteeClaim, grant_guarantees
from slurm_ext.jobspec import ElasticSpec, check_model, parse_spec
from slurm_ext.metrics import Metrics
# The observe helpers are re-exported: callers and tests know them from here.
from slurm_ext.observe import (  # noqa: F401
    ManagedJob, build_snapshot, cluster_spec, estimate_key, is_held, kv, measurement_from_text,
    estimate_cells, model_loader_for, model_text_for, node_type, partition_types, plan_comment, profile_db_if_written,
    profile_version,
    requested_gpus, rescale_pins, reserved_cell, gpu_releases, running_assignment, running_plan_comment,
    runner_progress, steerable_nodes, type_partitions, update_cell, finish_on_s, rescale_new_cell, rescale_releases,
    cell_gpus, required_placement, START_REFUSALS, refused_gpu_types, refused_starts,
)
from slurm_ext.limits import (kept_back_by_slurm, launch_is_stale, over_per_job_limit, sole_under_group_limit,
                              waits_on_its_own_condition)
from slurm_ext.profile_job import (
    RETRY_AFTER_S, background_request, free_for_policy, is_background, next_background, parse_background,
    profiled_pairs, retry_after_failures, to_cancel, waiting_partitions,
)
from slurm_ext.refit import OnlineRefitter
from slurm_ext.slurm_client import SlurmClient, SlurmJob, SlurmNode
from slurm_ext.steering import Steering, steering
from slurm_ext.store import GPU_TYPE_NOTE_EVERY_S, START, EstimateCache, Store
from slurm_ext.user_files import read_user_file

log = logging.getLogger(__name__)

JOURNAL_KEEP_S = 7 * 86400.0  # closed journal entries (and cached estimates) are kept this long
PRUNE_EVERY_S = 3600.0
# dry_run too: a daemon started dry holds no lock on its state file (commands/daemon.py).
RESTART_KEYS = ("state_db", "slurm_backend", "slurm_prefix", "slurm_timeout_s", "metrics_port", "metrics_address",
                "log_level", "dry_run")
# A spec that needs the batch script is read again next round when Slurm did not give the
# script (a timeout under load), this many rounds in a row before its error is kept.
SCRIPT_READ_TRIES = 3
SCRIPT_UNREAD = " (its batch script could not be read)"
# A job no Cell can be estimated for while GPU types seen before are gone from the listing
# (nodes powered down, in FUTURE state) stays held this long, estimated again each round,
# before it runs as submitted with the error kept.
ESTIMATE_ERROR_SETTLE_S = 300.0
ARRAY_REFUSED = ("a job array cannot be elastic: one Cell would be chosen for all its tasks and each task "
                 "would run on it; submit the tasks as separate jobs")


@dataclass(frozen=True)
class RoundReport:
    """What one round saw and did (logged, returned to tests and the benchmark)."""

    trigger: str
    jobs: int = 0
    elastic: int = 0
    managed: int = 0
    spec_errors: int = 0
    actions: tuple[tuple[str, int], ...] = ()
    observe_s: float = 0.0
    estimate_s: float = 0.0
    decide_s: float = 0.0
    act_s: float = 0.0
    new_specs: int = 0
    unread_specs: int = 0
    plans_shown: tuple[int, ...] = ()  # running jobs whose AdminComment now shows their tuned plan
    rescaled: tuple[int, ...] = ()  # rescales finished this round: released on their new Cell
    rescaling: tuple[int, ...] = ()  # rescales still under way (a checkpoint, a forced requeue)
    forecasts_shown: tuple[int, ...] = ()  # jobs whose AdminComment got a new forecast

    @property
    def total_s(self) -> float:
        return self.observe_s + self.estimate_s + self.decide_s + self.act_s


class Daemon:
    """The scheduling service.

    Args:
        config: the resolved configuration.
        client: the Slurm backend.
        store: the state store.
        clock: the clock (wall time in production).
        metrics: Prometheus metrics (no-op when disabled).
        out: where ``--dry-run`` prints the actions it would take.
        reload: returns a fresh config on SIGHUP (None: reload is not possible).
    """

    def __init__(self, config: DaemonConfig, client: SlurmClient, store: Store,
                 clock: Clock | None = None, metrics: Metrics | None = None,
                 out: Callable[[str], None] = print,
                 reload: Callable[[], DaemonConfig] | None = None):
        self.client = client
        self.store = store
        self._wake = threading.Event()
        self.clock = clock or WallClock(sleep=self._wake.wait)
        self.metrics = metrics or Metrics(None)
        self.out = out
        self._reload = reload
        self._stop = False
        self._reload_requested = False
        self._policy_state: object = None
        self._known_ids: set[int] = set()
        # Ids a poll saw pending that the next round's listing did not have (a line of a
        # comment that imitates one): not a reason for an early round again.
        self._polled_ids: set[int] = set()
        self._unlisted_ids: set[int] = set()
        self._estimates = EstimateCache(store, read_only=config.dry_run)
        self._spec_cache: dict[int, tuple[ElasticSpec | None, str | None]] | None = None
        self._submit_s: dict[int, float] = {}
        self._new_specs = 0
        self._claimed_gpus: dict[int, int] = {}  # guaranteed job without a count: GPUs charged to its quota
        self._gpu_caps = store.gpu_caps()  # job: most GPUs a per-job limit lets it have (Slurm refused more)
        self._group_shared_s: dict[int, float] = {}  # see sole_under_group_limit
        self._sole: frozenset[int] = frozenset()  # jobs whose Cell alone is over their group's limit
        self._script_read_failures: dict[int, int] = {}  # job: rounds in a row its script was unreadable
        self._estimate_failing_s: dict[int, float] = {}  # job: since when its estimate fails, in a row
        self._gpu_types_seen = store.gpu_types_seen(self.clock.now_s())  # this run's rounds or earlier ones
        self._gpu_types_noted_s: dict[str, float] = {}  # type: when this run last wrote it seen
        self._pruned_s = 0.0
        self._forecast_s = -math.inf
        self.forecasts = BackgroundForecast()
        self._derived = DerivedCache()  # what the policy derives per job spec, kept across rounds
        self._slurm_version: tuple[int, int, int] | None = None  # asked once, when first needed
        # (model, GPU type) whose background profile failed → (job id, when to try again).
        self._profile_retry: dict[tuple[str, str], tuple[int | None, float]] = {}
        self.config = config
        self.policy: Policy = make_policy(config.policy, **dict(config.policy_options))
        self.actor = Actor(client, store, self.clock, self.metrics, out, lambda: self.config)
        self.refits = OnlineRefitter(store, lambda: self.config)  # Rubick's online refit

    # -- control ------------------------------------------------------------------------
    def use_client(self, client: SlurmClient) -> None:
        """Talk to Slurm through another backend from the next round on (a benchmark
        compares backends round by round on one queue)."""
        self.client = self.actor.client = client

    def request_stop(self) -> None:
        """Finish the current step and exit (SIGTERM)."""
        self._stop = True
        self._wake.set()

    def request_reload(self) -> None:
        """Re-read the configuration before the next round (SIGHUP)."""
        self._reload_requested = True
        self._wake.set()

    def _apply_reload(self) -> None:
        self._reload_requested = False
        if self._reload is None:
            return
        try:
            new = self._reload()
        except Exception as e:  # a bad edit must not kill the service: keep the old config
            log.error(kv("config_reload_failed", error=e))
            return
        if (new.policy, new.policy_options) != (self.config.policy, self.config.policy_options):
            self.policy = make_policy(new.policy, **dict(new.policy_options))
            self._policy_state = None
        # What the service built once at its start (the state file, the Slurm client, the
        # metrics server, the log) keeps its old setting until a restart, and says so.
        for key in RESTART_KEYS:
            if getattr(new, key) != getattr(self.config, key):
                log.warning(kv("config_reload_ignored", key=key, why="takes effect at the next restart"))
                new = replace(new, **{key: getattr(self.config, key)})
        self.config = new
        log.info(kv("config_reloaded", policy=new.policy, interval_s=new.interval_s, dry_run=new.dry_run))

    # -- the loop -----------------------------------------------------------------------
    def run(self, once: bool = False) -> int:
        """Recover, then run rounds until stopped (or one round with ``once``).

        Returns:
            0, or 1 when ``once`` and the round failed.
        """
        backoff_s = 0.0
        recovered = False
        trigger = TRIGGER_ROUND
        while not self._stop:
            if self._reload_requested:
                self._apply_reload()
            started_s = self.clock.now_s()
            ok = True
            try:
                if not recovered:
                    self.recover()
                    recovered = True
                report = self.round(trigger)
                self.metrics.round_done(self.clock.now_s() - started_s, "ok")
                backoff_s = 0.0
                if report.unread_specs or report.rescaling:
                    # A backlog of new jobs, or rescales to finish: the next round soon.
                    backoff_s = min(self.config.interval_s, max(self.config.poll_s, 1.0))
            except SlurmExtError as e:
                ok = False
                self.metrics.error("slurm")
                self.metrics.round_done(self.clock.now_s() - started_s, "slurm_error")
                backoff_s = min(self.config.backoff_max_s,
                                max(self.config.interval_s / 10, 2 * backoff_s, 1.0))
                log.error(kv("slurm_unreachable", error=e, retry_in_s=backoff_s))
            except Exception as e:  # the service must outlive any single bad round
                ok, backoff_s = False, 0.0  # the next round at the interval, whatever Slurm did before
                self.metrics.error("round")
                self.metrics.round_done(self.clock.now_s() - started_s, "error")
                log.exception(kv("round_failed", error=repr(e)))
            if once:
                return 0 if ok else 1
            next_s = started_s + (backoff_s or self.config.interval_s)
            trigger = self._wait_for_next(next_s, poll=ok)
        if self.actor.held_nodes != () and not self.config.dry_run:  # held, or not known (a failed change)
            self.actor.hold_nodes((), ())
        log.info(kv("daemon_stopped"))
        return 0

    def _wait_for_next(self, next_s: float, poll: bool) -> str:
        """Sleep until ``next_s``, polling for new elastic jobs; returns the next trigger."""
        while True:
            self._wake.clear()  # before the tests: a stop or reload requested after them wakes the sleep
            if self._stop or self._reload_requested:
                break
            now_s = self.clock.now_s()
            if now_s >= next_s:
                return TRIGGER_ROUND
            step_s = next_s - now_s
            if poll and self.config.poll_s > 0:
                step_s = min(step_s, self.config.poll_s)
            self.clock.sleep_until(now_s + step_s)
            if poll and self.config.poll_s > 0 and not self._stop and self._new_elastic_job():
                return TRIGGER_ARRIVAL
        return TRIGGER_ROUND

    def _new_elastic_job(self) -> bool:
        try:
            pending = self.client.pending_elastic_job_ids()
        except SlurmExtError as e:  # Slurm busy or away: the round says so
            log.debug(kv("poll_failed", error=e))
            return False
        except Exception as e:  # noqa: BLE001 - a poll that fails waits for the round, never stops the service
            log.warning(kv("poll_failed", error=repr(e)))
            return False
        new = [j for j in pending if j not in self._known_ids and j not in self._unlisted_ids]
        self._polled_ids.update(new)
        if new:
            log.info(kv("elastic_job_arrived", job_ids=",".join(map(str, new[:10]))))
        return bool(new)

    # -- recovery -----------------------------------------------------------------------
    def recover(self) -> int:
        """Finish or undo actions a previous run left open; returns the entries handled."""
        return self.actor.recover()

    # -- one round ----------------------------------------------------------------------
    def round(self, trigger: str = TRIGGER_ROUND) -> RoundReport:
        """One observe → estimate → decide → act pass.

        Raises:
            SlurmExtError: Slurm could not be read (the caller backs off and retries).
        """
        cfg = self.config
        t0 = time.perf_counter()
        now_s = self.clock.now_s()
        jobs = self.client.jobs()
        nodes = self.client.nodes()
        t1 = time.perf_counter()
        active = [j for j in jobs if j.is_active]
        self._known_ids = {j.job_id for j in active}
        self._unlisted_ids = {j for j in self._unlisted_ids | self._polled_ids if j not in self._known_ids}
        self._polled_ids = set()
        self._sole, self._group_shared_s = sole_under_group_limit(active, self._group_shared_s, now_s)
        part_types = partition_types(nodes, cfg.partition_map())
        cluster = cluster_spec(nodes, part_types, cfg.cluster, cfg.network)
        self._gpu_types_seen.update(cluster.gpu_types)
        noted_s = self._gpu_types_noted_s
        due = [t for t in cluster.gpu_types if now_s - noted_s.get(t, -math.inf) >= GPU_TYPE_NOTE_EVERY_S]
        if due and not cfg.dry_run:
            self.store.note_gpu_types(due, now_s)
            noted_s.update(dict.fromkeys(due, now_s))
        elastic = [j for j in active if j.is_elastic]
        if self._spec_cache is None:  # once per process: what earlier runs parsed
            self._spec_cache = {job_id: (None if sj is None else ElasticSpec.from_json(sj), err)
                                for job_id, (sj, err) in self.store.specs().items()}
        active_ids = {j.job_id for j in active}
        if trigger == TRIGGER_ROUND and any(
                spec is not None and job_id not in active_ids
                for job_id, (spec, _) in self._spec_cache.items()):
            trigger = TRIGGER_COMPLETION  # a managed job ended since the last round
        acts = Acts()
        # Rescales go on first, a step each, without waiting; the jobs in one are left to it
        # this round (their GPUs are busy, or about to be, on their new Cell).
        active_by_id = {j.job_id: j for j in active}
        in_rescale = self.actor.advance_rescales(active_by_id, acts)
        specs, errors = self._specs(elastic, now_s)
        progress = self.store.progress()
        node_types = {n.name: node_type(n, part_types) for n in nodes}
        managed, launching, more_errors = self._managed(
            [j for j in elastic if j.job_id not in in_rescale], specs, progress, node_types, part_types, cluster,
            now_s)
        errors += more_errors
        # Jobs in a rescale or about to start (or kept back by Slurm, on their Cell) keep their
        # place in their quota's order.
        holding = [j for j in elastic if (j.job_id in in_rescale or j in launching or kept_back_by_slurm(j, self._sole))
                   and j.job_id in specs]
        managed = self._apply_guarantees(managed, [(j, specs[j.job_id]) for j in holding])
        for job, message in errors:
            self.actor.handle_spec_error(job, message, acts)
        # Jobs Slurm is about to start hold their GPUs already, as far as the policy goes.
        # A job with a spec error counts only while its release is recent: one Slurm does
        # not start (a dependency, a limit) must not keep idle GPUs from the policy.
        about_to_start = launching + [j for j, _ in errors if j.state == "PENDING" and not
                                      waits_on_its_own_condition(j, self._sole) and not self._launch_stale(j, now_s)]
        # A forecast sees their GPUs come free when they would finish on their Cells.

        def until_s(job_id: int, cell: Cell | None) -> float | None:
            if cell is None or (job := active_by_id.get(job_id)) is None:
                return None
            return self._finish_on_s(specs.get(job_id), job, cell, progress, cluster, now_s)

        reserved = [(c, until_s(j.job_id, c), required_placement(self.store.entries(j.job_id)))
                    for j in about_to_start if (c := reserved_cell(j, part_types)) is not None]
        # A rescale's new Cell holds its nodes from the signal on (the job may still be
        # checkpointing on part of them). One on nodes Slurm picks most likely lands on the
        # GPUs its run leaves; the rest of it is a reservation.
        pins = {job_id: rescale_pins(u, active_by_id.get(job_id)) for job_id, u in in_rescale.items()}
        pinned = tuple(p for job_pins in pins.values() if job_pins for p in job_pins)
        rescaling: tuple[GpuRelease, ...] = ()
        for job_id, u in in_rescale.items():
            job = active_by_id.get(job_id)
            end_s = until_s(job_id, update_cell(u))
            new, rest = rescale_new_cell(u, job, node_types)
            if rest is not None:
                reserved.append((rest, end_s, None))
            rescaling += rescale_releases(job, new, now_s, end_s)
        background = [b for b in (parse_background(j, part_types) for j in active) if b is not None]
        policy_nodes = steerable_nodes(free_for_policy(nodes, background, active_by_id) if background else nodes,
                                       part_types, cfg.steering, managed)
        snapshot, reserved_releases = build_snapshot(
            now_s, policy_nodes, managed, reserved, part_types, trigger, cfg.interval_s, cfg.restart_cost_s,
            self._policy_state, self._derived, pinned)
        solve_next = getattr(self.policy, "solve_next", None)
        if solve_next and snapshot.policy_state is not None and (waiting := job_fitting_idle_gpus(snapshot)):
            # Work-conserving: a policy may skip a round it believes unchanged, but not
            # while a waiting job could run on GPUs that sit idle (what it learnt is kept).
            log.info(kv("resolve", why="idle GPUs fit a waiting job", job_id=waiting))
            snapshot = replace(snapshot, policy_state=solve_next(snapshot.policy_state))
        t2 = time.perf_counter()
        decision = self.policy.decide(snapshot)
        self.metrics.decision()
        try:
            validate_decision(snapshot, decision)
        except DecisionError as e:
            self.metrics.error("policy")
            log.error(kv("decision_rejected", policy=self.policy.name, error=e))
            decision = Decision((), holds=None)  # what was held stays held
        self._policy_state = decision.policy_state
        decision, snapshot, managed = self._release_dropped(decision, snapshot, managed, acts, now_s)
        forecasts = self.forecasts.take()  # one finished since the last round, if any
        # Background profiling jobs' GPUs are free in the snapshot already: no release.
        self._start_forecast(snapshot, decision, managed,
                             [j for j in active if j.job_id not in in_rescale and not is_background(j)],
                             reserved_releases + rescaling, now_s)
        t3 = time.perf_counter()
        held = None if decision.holds is None else \
            tuple(sorted({n for _, names in decision.holds for n in names}))
        if not cfg.dry_run and (background or cfg.background_profiling):
            self._background_profiling(jobs, active, nodes, part_types, background, decision, specs,
                                       set(held or ()), now_s)
        if held is not None:  # free what is no longer held before the round's starts (the held job's)
            kept = tuple(n for n in self.actor.held_nodes or () if n in held)
            if kept != self.actor.held_nodes:
                self.actor.hold_nodes(kept, decision.holds or ())
        self.actor.act(snapshot, decision, {m.view.job_id: m for m in managed},
                       lambda: self._steering(nodes, part_types), self.policy.name, acts, forecasts,
                       [j for j in elastic if j.job_id in specs and kept_back_by_slurm(j, self._sole)])
        if held:  # after the starts, which never use held GPUs
            self.actor.hold_nodes(held, decision.holds or ())
        if cfg.profile_db and not cfg.dry_run:  # online refit, after the actions: never delays them
            self.refits.refit_due(cluster, active_ids, now_s)
        if not cfg.dry_run:
            self.store.forget_jobs_except(active_ids)
            if now_s - self._pruned_s > PRUNE_EVERY_S:
                self.store.prune(now_s - JOURNAL_KEEP_S)
                self._pruned_s = now_s
        self._spec_cache = {j: v for j, v in self._spec_cache.items() if j in active_ids}
        self._submit_s = {j: v for j, v in self._submit_s.items() if j in active_ids}
        self._claimed_gpus = {j: v for j, v in self._claimed_gpus.items() if j in active_ids}
        self._gpu_caps = {j: v for j, v in self._gpu_caps.items() if j in active_ids}
        self._script_read_failures = {j: v for j, v in self._script_read_failures.items() if j in active_ids}
        self._estimate_failing_s = {j: v for j, v in self._estimate_failing_s.items() if j in active_ids}
        t4 = time.perf_counter()
        report = RoundReport(trigger, len(active), len(elastic), len(snapshot.jobs), len(errors),
                             tuple(acts.taken), t1 - t0, t2 - t1, t3 - t2, t4 - t3,
                             self._new_specs, len(elastic) - len(specs) - len(errors),
                             tuple(acts.plans_shown), tuple(acts.rescaled),
                             tuple(sorted(set(in_rescale) - set(acts.rescaled) | set(acts.signalled))),
                             tuple(acts.forecasts_shown))
        self.metrics.jobs({"active": len(active), "elastic": len(elastic), "managed": len(snapshot.jobs)})
        log.info(kv("round_done", trigger=trigger, jobs=report.jobs, elastic=report.elastic,
                    managed=report.managed, spec_errors=report.spec_errors,
                    actions=len(report.actions), seconds=report.total_s))
        return report

    def _release_dropped(self, decision: Decision, snapshot, managed: list[ManagedJob], acts: Acts,
                         now_s: float) -> tuple[Decision, object, list[ManagedJob]]:
        """A job the policy will never start (crius-ddl: no Cell meets its deadline) is not
        left held: it runs as submitted, and its AdminComment says why. Returns the
        decision, snapshot and managed jobs without it."""
        dropped = {d.job_id for d in decision.jobs if d.assignment is None and d.reason.startswith(DROPPED_PREFIX)}
        if not dropped:
            return decision, snapshot, managed
        for m in managed:
            if m.view.job_id in dropped and m.view.assignment is None:
                message = f"{decision.for_job(m.view.job_id).reason}; runs as submitted"
                self.actor.handle_spec_error(m.slurm, message, acts)
                if not self.config.dry_run:
                    self.store.put_spec(m.slurm.job_id, None, message, now_s)
                self._spec_cache[m.slurm.job_id] = (None, message)
        return (replace(decision, jobs=tuple(d for d in decision.jobs if d.job_id not in dropped)),
                replace(snapshot, jobs=tuple(j for j in snapshot.jobs if j.job_id not in dropped)),
                [m for m in managed if m.view.job_id not in dropped])

    def _start_forecast(self, snapshot, decision: Decision, managed: list[ManagedJob], active: list[SlurmJob],
                        reserved: tuple[GpuRelease, ...], now_s: float) -> None:
        """When one is due and none runs: the same policy run forward from this snapshot,
        starting from this round's decision, in the background (a round never waits).
        GPUs of plain ``active`` jobs come free at their Slurm end times, ``reserved`` ones
        (jobs about to start, in a rescale) as given."""
        cfg = self.config
        if cfg.forecast_every_s <= 0 or now_s - self._forecast_s < cfg.forecast_every_s or not snapshot.jobs \
                or self.forecasts.running:
            return
        managed_ids = {m.slurm.job_id for m in managed}
        releases = gpu_releases([j for j in active if j.job_id not in managed_ids], now_s) + reserved
        # A job whose runner reported a step of its current run is past its start-up.
        progressing = {m.view.job_id: m.runner.at_s for m in managed if m.runner is not None}
        self.forecasts.start(lambda: forecast(snapshot, self.policy, releases, cfg.forecast_max_decisions,
                                              first=decision, min_step_s=cfg.interval_s,
                                              time_budget_s=cfg.forecast_budget_s, progress_from_s=progressing))
        self._forecast_s = now_s

    def _specs(self, elastic: list[SlurmJob], now_s: float
               ) -> tuple[dict[int, ElasticSpec], list[tuple[SlurmJob, str]]]:
        """Specs of elastic jobs and the spec errors.

        A job's spec is parsed once (its batch script read with one Slurm call) and kept in
        the store; at most ``max_new_specs_per_round`` new ones per round, oldest job first,
        so a flood of submissions does not stall a round. The rest wait for the next round.
        """
        specs: dict[int, ElasticSpec] = {}
        errors: list[tuple[SlurmJob, str]] = []
        budget = self.config.max_new_specs_per_round
        self._new_specs = 0
        for job in sorted(elastic, key=lambda j: j.job_id):
            cached = self._spec_cache.get(job.job_id)
            if cached is None:
                if budget <= 0:
                    continue
                budget -= 1
                self._new_specs += 1
                spec_json, error = self._parse(job)
                if error is None or not error.endswith(SCRIPT_UNREAD):
                    self._script_read_failures.pop(job.job_id, None)
                elif self._script_read_failures.get(job.job_id, 0) + 1 < SCRIPT_READ_TRIES:
                    self._script_read_failures[job.job_id] = self._script_read_failures.get(job.job_id, 0) + 1
                    continue  # read again next round: nothing is kept
                if error is not None:
                    self.metrics.error("spec")
                if not self.config.dry_run:
                    self.store.put_spec(job.job_id, spec_json, error, now_s)
                cached = (None if spec_json is None else ElasticSpec.from_json(spec_json), error)
                self._spec_cache[job.job_id] = cached
            spec, error = cached
            if error is not None:
                errors.append((job, error))
            else:
                specs[job.job_id] = spec
        return specs, errors

    def _parse(self, job: SlurmJob) -> tuple[dict | None, str | None]:
        if job.array_job_id is not None:
            log.warning(kv("spec_error", job_id=job.job_id, user=job.user, error="job array"))
            return None, ARRAY_REFUSED
        try:
            script = self.client.batch_script(job.job_id) if job.batch else None
        except SlurmExtError as e:
            log.warning(kv("batch_script_unreadable", job_id=job.job_id, error=e))
            script = None
        pc = plan_comment(job.admin_comment)
        try:
            spec = parse_spec(job.comment, script, requested_gpus(job),
                              pc.requested or job.gpu_type_requested)
            check_model(spec, model_loader_for(job.user))
        except ElasticSpecError as e:
            log.warning(kv("spec_error", job_id=job.job_id, user=job.user, error=e))
            # Its #ELASTIC lines were not read: the error may be only that.
            return None, str(e) + (SCRIPT_UNREAD if job.batch and script is None else "")
        return spec.to_json(), None

    def _managed(self, elastic: list[SlurmJob], specs: dict[int, ElasticSpec], progress: dict[int, float],
                 node_types: dict[str, str | None], part_types: dict[str, str], cluster: ClusterSpec,
                 now_s: float) -> tuple[list[ManagedJob], list[SlurmJob], list[tuple[SlurmJob, str]]]:
        """Managed jobs with their estimates; jobs Slurm is about to start; estimation errors.
        ``progress``: the journal's iterations done in earlier runs, per job; ``node_types``:
        each node's GPU type."""
        cfg = self.config
        candidates = [j for j in elastic if j.job_id in specs]
        new = {j.job_id: float(j.submit_time_s) for j in candidates if j.job_id not in self._submit_s}
        if new:  # the original submit time survives requeues (which reset Slurm's)
            self._submit_s.update(self.store.submit_times(new) if not cfg.dry_run else new)
        submit_s = self._submit_s
        suspended_s = self.store.suspended_times()
        managed: list[ManagedJob] = []
        launching: list[SlurmJob] = []
        errors: list[tuple[SlurmJob, str]] = []
        by_spec: dict[tuple[ElasticSpec, str], tuple[JobSpec, dict | str]] = {}
        refusing = self.store.jobs_with_failed(START)  # the only jobs whose journal a refusal may be in
        for job in candidates:
            spec, barred = specs[job.job_id], set()
            pc = plan_comment(job.admin_comment)
            if job.state == "RUNNING":
                assignment = running_assignment(job, pc, node_types, part_types)
                if not job.requeue:  # Slurm would end it on exit 86, not requeue it held
                    log.info(kv("running_job_not_requeueable", job_id=job.job_id, nodes=",".join(job.nodes)))
                    continue  # counted as unmanaged usage: never rescaled or suspended
                if assignment is None:  # counted as unmanaged usage through the nodes' gres
                    log.info(kv("running_job_not_managed", job_id=job.job_id, nodes=",".join(job.nodes),
                                granted=",".join(map(str, job.granted_gpus_per_node)),
                                gpu_type=job.granted_gpu_type))
                    continue
                state = RUNNING
            elif is_held(job):
                if job.job_id in refusing:  # GPU types whose starts Slurm refuses: offer others
                    entries = self.store.entries(job.job_id)
                    barred = {t for t, n in refused_gpu_types(entries).items() if n >= START_REFUSALS}
                assignment, state = None, PENDING
            elif kept_back_by_slurm(job, self._sole):
                continue  # Slurm starts it on its Cell once the condition holds
            elif job.state == "PENDING" and pc.cell is not None and not self._launch_stale(job, now_s):
                launching.append(job)  # released by us; Slurm starts it when it can
                continue
            elif job.state == "PENDING":
                assignment, state = None, PENDING
            else:
                continue  # completing, suspended, ...: its GPUs show in the nodes' gres
            # Jobs of one spec and user share their estimates: look up once (a model file
            # is read as its job's owner could, so another user's job reads it anew).
            if (spec, job.user) not in by_spec:
                by_spec[spec, job.user] = self._estimate(spec, job.user, cluster, now_s)
            jspec, est = by_spec[spec, job.user]
            if isinstance(est, str):
                if self._gpu_types_seen - set(cluster.gpu_types) and \
                        now_s - self._estimate_failing_s.setdefault(job.job_id, now_s) < ESTIMATE_ERROR_SETTLE_S:
                    continue  # estimated again next round: the nodes gone may be back
                message = est
                if not cfg.dry_run:
                    self.store.put_spec(job.job_id, None, message, now_s)
                self._spec_cache[job.job_id] = (None, message)
                errors.append((job, message))
                continue
            self._estimate_failing_s.pop(job.job_id, None)
            estimates, dp_only = est[cfg.plan_space], est["dp-only"]
            if (cap := self._gpu_caps.get(job.job_id)) is not None:  # Slurm refused more (a per-job limit)
                estimates, dp_only = ([e for e in x if e.cell.num_gpus <= cap] for x in (estimates, dp_only))
                if not any(e.feasible for e in estimates):
                    errors.append((job, f"no Cell of {cap} GPUs or fewer fits, and Slurm refuses more (a "
                                        f"limit of its user, account or QOS: {job.reason or 'as before'})"))
                    continue
            if barred:
                estimates, dp_only = ([e for e in x if e.cell.gpu_type not in barred] for x in (estimates, dp_only))
                if "" in barred or not any(e.feasible for e in estimates):  # "": starts of no known Cell
                    refused, why = refused_starts(entries)
                    errors.append((job, f"Slurm refused {refused} starts in a row, on "
                                        f"{', '.join(sorted(barred - {''})) or 'its Cells'} ({why})"))
                    continue
            running_comment = None
            measured_text = self._measured_text(job) if state == RUNNING and cfg.checkpoint_root else None
            if measured_text is not None:
                measured = measurement_from_text(measured_text, pc.cell, cfg.use_cpu_measurements)
                if measured is not None:  # Rubick's continuous fitting of the running Cell
                    text = model_text_for(job.user, spec.model) if cfg.profile_db and not cfg.dry_run else None
                    if text is not None:  # online refit (slurm_ext.refit), of what the owner could read
                        self.refits.observe(job.job_id, spec.model, spec.global_batch, estimates, measured,
                                            measured_text, cluster, now_s, text)
                    estimates = refine(estimates, measured, spec.global_batch)
                # The runner may have tuned the plan in the allocation: show the one that runs.
                running_comment = running_plan_comment(job.admin_comment, measured_text,
                                                       cfg.use_cpu_measurements, job.restart_count)
            started_s = float(job.start_time_s or job.submit_time_s)
            waiting_since_s = max(submit_s.get(job.job_id, started_s), suspended_s.get(job.job_id, -math.inf))
            view = JobView(
                job_id=str(job.job_id), user=job.user, spec=jspec,
                submit_time_s=submit_s.get(job.job_id, float(job.submit_time_s)), state=state,
                assignment=assignment, iterations_done=progress.get(job.job_id, 0.0),
                iterations_total=spec.iterations, restarts=job.restart_count,
                last_change_s=started_s if state == RUNNING else waiting_since_s,
                deadline_s=spec.deadline_s, guaranteed=spec.guaranteed,
                estimates=tuple(estimates), dp_only_estimates=tuple(dp_only))
            runner = runner_progress(measured_text, job) if measured_text is not None else None
            m = ManagedJob(job, spec, view, running_comment, view.iterations_done, runner)
            if state == RUNNING:
                m = replace(m, view=replace(view, iterations_done=min(
                    float(spec.iterations), view.iterations_done + m.run_iterations(now_s))))
            managed.append(m)
        return managed, launching, errors

    def _steering(self, nodes: tuple[SlurmNode, ...], part_types: dict[str, str]) -> Steering:
        """How this round's starts reach their GPU types (``slurm_ext.steering``)."""
        if self._slurm_version is None:
            try:
                self._slurm_version = self.client.slurm_version()
            except SlurmExtError as e:  # the older Slurm's way is safe on every version
                log.warning(kv("slurm_version_unknown", error=e, assumed="22.05"))
                self._slurm_version = (22, 5, 0)
        return steering(self.config.steering, self._slurm_version, nodes, type_partitions(part_types),
                        lambda n: node_type(n, part_types))

    def _background_profiling(self, jobs, active, nodes, part_types: dict[str, str], background,
                              decision: Decision, specs: dict, held: set[str], now_s: float) -> None:
        """Cancel profiling jobs a user job needs; submit one where a node idles and a
        known model lacks a profile of its type (``slurm_ext.profile_job``)."""
        cfg = self.config
        placed = {n for d in decision.jobs if d.assignment is not None for n in d.assignment.nodes}
        partitions = waiting_partitions(active)
        waiting = {part_types[p] for p in partitions if p in part_types}
        for b in to_cancel(background, placed, waiting, partitions, {n.name: n.partitions for n in nodes}):
            try:
                self.client.cancel(b.job_id)
                log.info(kv("background_profile_cancelled", job_id=b.job_id, node=b.node, model=b.model,
                            why="a job needs the node" if b.node in placed else "a job waits for its type"))
            except SlurmExtError as e:
                log.warning(kv("background_profile_cancel_failed", job_id=b.job_id, error=e))
        models = {s.model for s in specs.values() if s is not None and s.model in BUILTIN_MODELS}
        profiled = profiled_pairs(cfg.profile_db, models) if models and cfg.profile_db else None
        # a failed profile of a pair (or one that timed nothing) is not tried again at once
        self._profile_retry = retry_after_failures(jobs, part_types, self._profile_retry, now_s, profiled)
        if background or not (cfg.background_profiling and cfg.profile_db) or profiled is None:
            return  # one at a time; no model to profile, or a store that cannot be read (logged)
        retry = {pair: until for pair, (_, until) in self._profile_retry.items()}
        plan = next_background(models, profiled, nodes, part_types, placed | held, waiting, retry, now_s,
                               partitions)
        if plan is None:
            return
        log_path = str(Path(cfg.profile_db).resolve().parent / "background-profile-%j.out")
        request = background_request(plan, sys.executable, str(Path(cfg.profile_db).resolve()),
                                     None if cfg.profile_mpi == "none" else cfg.profile_mpi,
                                     cfg.background_profile_time_min, log_path)
        try:
            job_id = self.client.submit(request)
        except SlurmExtError as e:
            log.warning(kv("background_profile_submit_failed", node=plan.node, model=plan.model, error=e))
            self._profile_retry[(plan.model, plan.gpu_type)] = (None, now_s + RETRY_AFTER_S)
            return
        log.info(kv("background_profile_submitted", job_id=job_id, node=plan.node, gpu_type=plan.gpu_type,
                    model=plan.model))

    def _apply_guarantees(self, managed: list[ManagedJob], holding: list[tuple[SlurmJob, ElasticSpec]]
                          ) -> list[ManagedJob]:
        """``guaranteed=yes`` binds only where the admin's list grants it (config
        ``guarantees``); other such jobs run best effort, the reason shown with their plan.
        ``holding``: guaranteed jobs the policy does not see this round (in a rescale, about
        to start), which claim their quota in their turn all the same."""
        # A job that named no count is guaranteed its smallest feasible one (the policy's
        # reference, ``requested_count``), and charged it; a job the policy does not see
        # this round, what it was charged when it did (else the Cell it holds).
        for m in managed:
            if m.spec.guaranteed and not m.spec.num_gpus:
                self._claimed_gpus[m.slurm.job_id] = min(
                    (e.cell.num_gpus for e in m.view.estimates if e.feasible), default=0)
        claims = [GuaranteeClaim(m.slurm.job_id, m.slurm.user, m.slurm.account, m.slurm.qos,
                                 m.spec.num_gpus or self._claimed_gpus[m.slurm.job_id], m.view.submit_time_s)
                  for m in managed if m.spec.guaranteed]
        if not claims:
            return managed
        claims += [GuaranteeClaim(j.job_id, j.user, j.account, j.qos,
                                  spec.num_gpus or self._claimed_gpus.get(j.job_id) or cell_gpus(j),
                                  self._submit_s.get(j.job_id, float(j.submit_time_s)))
                   for j, spec in holding if spec.guaranteed]
        refused = {j: why for j, why in grant_guarantees(self.config.guarantees, claims).items() if why}
        return [replace(m, view=replace(m.view, guaranteed=False), guarantee_note=refused[m.slurm.job_id])
                if m.slurm.job_id in refused else m for m in managed]

    def _measured_text(self, job: SlurmJob) -> str | None:
        """The job's runner's ``measured.json`` (speed and plan that runs), or None."""
        path = Path(self.config.checkpoint_root) / str(job.job_id) / MEASURED_FILE
        try:  # in a directory the job's user writes: a FIFO or a huge file is refused
            return read_user_file(str(path), MAX_MEASURED_BYTES).decode()
        except (OSError, SpecError, UnicodeDecodeError):
            return None

    def _estimate(self, spec: ElasticSpec, user: str, cluster: ClusterSpec, now_s: float
                  ) -> tuple[JobSpec, dict | str]:
        """The spec's job and its estimates by plan space, or why it cannot be estimated.
        A model file is read here, as ``user`` could read it, and handed to the estimator
        loaded (``JobSpec.model_spec``): it never opens the user's path as root."""
        cfg = self.config
        jspec = spec.job_spec()
        try:
            model = check_model(spec, model_loader_for(user))
            jspec = replace(jspec, model_spec=model) if "/" in spec.model else jspec
            est = {}
            profile = profile_version(cfg.profile_db)
            profile_db = profile_db_if_written(cfg.profile_db)
            for space in (cfg.plan_space, "dp-only"):
                options = EstimateOptions(plan_space=space, micro_batches=cfg.micro_batches_for(spec.global_batch),
                                          max_gpus=cfg.max_gpus, profile_db=profile_db,
                                          expert_parallel=cfg.expert_parallel)
                est[space] = self._estimates.get(
                    estimate_key(spec, cluster, space, options.micro_batches, cfg.max_gpus, profile,
                                 cfg.expert_parallel),
                    lambda o=options: estimate_cells(jspec, cluster, o, lambda why: log.warning(kv(
                        "profile_store_unreadable", error=why))), now_s)
            if not any(e.feasible for e in est[cfg.plan_space]):
                why = next((e.reason for e in est[cfg.plan_space] if e.reason), "no Cell enumerated")
                raise SpecError("model", spec.model, f"no Cell of this cluster fits it ({why})")
        except (SpecError, ValueError, KeyError, ArithmeticError) as e:
            return jspec, f"cannot estimate: {e}"
        return jspec, est

    def _finish_on_s(self, spec: ElasticSpec | None, job: SlurmJob, cell: Cell, progress: dict[int, float],
                     cluster: ClusterSpec, now_s: float) -> float | None:
        """When a job about to (re)start on ``cell`` would finish there: a restart, then its
        remaining iterations at its estimate of the Cell (None: not known)."""
        if spec is None:
            return None
        _, est = self._estimate(spec, job.user, cluster, now_s)
        if isinstance(est, str):
            return None
        left = spec.iterations - progress.get(job.job_id, 0.0)
        return finish_on_s(tuple(est[self.config.plan_space]), cell, left, now_s + self.config.restart_cost_s)

    def _launch_stale(self, job: SlurmJob, now_s: float) -> bool:
        """A released job Slurm will not start as planned (``launch_is_stale``): decide it
        afresh; one over a per-job limit, on fewer GPUs than Slurm refused."""
        entries = self.store.entries(job.job_id)
        if over_per_job_limit(job, entries, now_s, self._sole) and (refused := cell_gpus(job)):
            cap = min(self._gpu_caps.get(job.job_id, refused), refused - 1)
            if cap != self._gpu_caps.get(job.job_id) and not self.config.dry_run:
                self.store.put_gpu_cap(job.job_id, cap)
            self._gpu_caps[job.job_id] = cap
        return launch_is_stale(job, entries, now_s, self.config.interval_s, self._sole)
