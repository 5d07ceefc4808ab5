"""The scheduler service: observe Slurm → estimate → decide → act, every round.

A round reads every job and node from Slurm, parses the specs of elastic jobs (comment
``elastic``), estimates their Cells (cached in the state store), builds the policy's
Snapshot, asks the policy, and applies the difference:

- a pending elastic job the policy starts: ``scontrol update`` to the partition of the
  chosen GPU type, untyped GPUs per node, ``NumNodes=N-N``, the plan in AdminComment,
  ``StartTime=now``, then release;
- a running elastic job the policy rescales: USR1 to the batch step, wait (up to
  ``rescale_timeout_s``) for the job to requeue itself held (exit 86), else
  ``requeuehold``; then the same update and release (or, to suspend, stay held);
- an elastic job whose spec is invalid: the error goes to its AdminComment and the job is
  released to run exactly as submitted;
- plain jobs are never touched; their GPUs count as used.

Every action is written to the journal before it is taken and closed after, so a restart
finishes or undoes half-done work (:meth:`Daemon.recover`). Slurm being unreachable is
logged and retried with back-off. Logs are ``key=value`` lines.
"""

from __future__ import annotations

import functools
import json
import logging
import pwd
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from estimator.cells import Cell, CellEstimate
from estimator.cluster import ClusterSpec, cluster_from_dict, load_cluster
from estimator.estimate import EstimateOptions, estimate_job
from estimator.errors import SpecError
from estimator.gpus import CATALOG
from estimator.jobs import JobSpec
from estimator.models import load_model
from policy.clock import Clock, WallClock
from policy.interface import (
    CHANGE_TYPE, MOVE, PENDING, RESIZE, RUNNING, START, SUSPEND, TRIGGER_ARRIVAL,
    TRIGGER_COMPLETION, TRIGGER_ROUND, Action, Assignment, Decision, DecisionError, JobView,
    NodeView, Policy, Snapshot, implied_actions, validate_decision,
)
from policy.placement import FreeGpus
from policy.registry import make_policy
from slurm_ext.config import DaemonConfig
from slurm_ext.errors import SlurmCommandError, SlurmExtError
from slurm_ext.jobspec import ElasticSpec, ElasticSpecError, check_model, is_elastic, parse_spec
from slurm_ext.metrics import Metrics
from slurm_ext.run import run_command
from slurm_ext.slurm_client import (
    ACTIVE_STATES, HELD_REASONS, JobUpdate, SlurmClient, SlurmJob, SlurmNode,
)
from slurm_ext.squeue_view import PlanComment, format_plan_comment, parse_plan_comment, plan_label
from slurm_ext import store as journal
from slurm_ext.store import EstimateCache, Store, plan_recovery

log = logging.getLogger(__name__)

HELD_FOR_RESCALE = frozenset({"SPECIAL_EXIT", "REQUEUE_HOLD"})
RESCALE_POLL_S = 1.0
REQUEUE_HOLD_WAIT_S = 45.0
JOURNAL_KEEP_S = 7 * 86400.0  # closed journal entries are kept this long for inspection
PRUNE_EVERY_S = 3600.0
# A released job waiting for one of these will never start as it is: decide it afresh.
# So is one still waiting after LAUNCH_TIMEOUT_ROUNDS rounds (at least LAUNCH_TIMEOUT_MIN_S).
LAUNCH_TIMEOUT_ROUNDS = 3
LAUNCH_TIMEOUT_MIN_S = 60.0
STUCK_REASONS = frozenset({"BadConstraints", "PartitionNodeLimit", "PartitionConfig",
                           "InvalidQOS", "PartitionDown", "PartitionInactive"})


def kv(event: str, **fields: object) -> str:
    """One structured log line: ``event=round_done jobs=12 why="no GPUs"``."""
    parts = [f"event={event}"]
    for k, v in fields.items():
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        if not text or any(c in text for c in ' "='):
            text = '"' + text.replace('"', "'") + '"'
        parts.append(f"{k}={text}")
    return " ".join(parts)


def is_held(job: SlurmJob) -> bool:
    """Held, including requeued-held after a rescale signal (``SPECIAL_EXIT``)."""
    return job.is_held or job.state in HELD_FOR_RESCALE


# -- observing: pure functions from Slurm's jobs and nodes to the policy's Snapshot ---

def pending_listing_argv() -> list[str]:
    """A cheap listing of pending jobs and their comments (0.02 s for 2,000 jobs)."""
    return ["squeue", "-h", "-t", "PENDING", "-O", "JobID:|,Comment:|"]


def parse_pending_listing(text: str) -> list[int]:
    """Job ids of the elastic jobs in :func:`pending_listing_argv`'s output."""
    out = []
    for line in text.splitlines():
        job_id, _, comment = line.partition("|")
        job_id = job_id.strip()
        if job_id.isdigit() and is_elastic(comment.rstrip("|")):
            out.append(int(job_id))
    return out


def job_states_argv(job_ids: set[int]) -> list[str]:
    """A cheap listing of some jobs' state, reason and priority (finished ones included)."""
    return ["squeue", "-h", "--states=all", "-j", ",".join(str(j) for j in sorted(job_ids)),
            "-O", "JobID:|,State:|,Reason:|,Priority:|"]


def parse_job_states(text: str) -> dict[int, tuple[str, bool]]:
    """Job id → (state, held) from :func:`job_states_argv`'s output.

    Held: requeued held after a rescale signal (``SPECIAL_EXIT``, ``REQUEUE_HOLD``), or
    pending with a hold reason or zero priority.
    """
    out: dict[int, tuple[str, bool]] = {}
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < 4 or not fields[0].strip().isdigit():
            continue
        state, reason = fields[1].strip(), fields[2].strip()
        try:
            zero_priority = float(fields[3]) == 0.0
        except ValueError:
            zero_priority = False
        held = state in HELD_FOR_RESCALE or (state == "PENDING" and (
            reason in HELD_REASONS or reason == "job requeued in held state" or zero_priority))
        out[int(fields[0])] = (state, held)
    return out


MAX_MODEL_FILE_BYTES = 1 << 20


def model_loader_for(user: str) -> Callable[[str], object]:
    """``load_model`` that reads a model file only if the job's owner could read it.

    The daemon runs as root: without this a user could name any file (``/dev/zero``, a
    file only root may read) as a model and learn from the error what it holds.
    """
    def load(name: str) -> object:
        if "/" in name:
            path = Path(name)
            st = path.stat()  # OSError: check_model reports "cannot be loaded"
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MODEL_FILE_BYTES:
                raise SpecError("model", name, f"give a regular YAML file of at most {MAX_MODEL_FILE_BYTES} bytes")
            try:
                uid = pwd.getpwnam(user).pw_uid if user else None
            except KeyError:
                uid = None
            if not (st.st_mode & stat.S_IROTH or (uid is not None and st.st_uid == uid
                                                  and st.st_mode & stat.S_IRUSR)):
                raise SpecError("model", name, "the file must be readable by the job's owner "
                                "(owned by them or world-readable)")
        return load_model(name)
    return load


def partition_types(nodes: tuple[SlurmNode, ...], configured: dict[str, str]) -> dict[str, str]:
    """Partition → GPU type: the configured map, else each partition whose nodes share a type."""
    if configured:
        return dict(configured)
    seen: dict[str, set] = {}
    for n in nodes:
        for p in n.partitions:
            seen.setdefault(p, set()).add(n.gpu_type)
    return {p: next(iter(t)) for p, t in sorted(seen.items())
            if len(t) == 1 and next(iter(t)) in CATALOG}


def type_partitions(part_types: dict[str, str]) -> dict[str, str]:
    """GPU type → the partition that steers a job to it (one named like the type first)."""
    out: dict[str, str] = {}
    for part, gtype in sorted(part_types.items(), key=lambda pt: (pt[0] != pt[1], pt[0])):
        out.setdefault(gtype, part)
    return out


def node_type(node: SlurmNode, part_types: dict[str, str]) -> str | None:
    """A node's GPU type: its typed gres, else the type of one of its partitions."""
    if node.gpu_type in CATALOG:
        return node.gpu_type
    for p in node.partitions:
        if p in part_types:
            return part_types[p]
    return None


def cluster_spec(nodes: tuple[SlurmNode, ...], part_types: dict[str, str], cluster: str | None,
                 network: str) -> ClusterSpec:
    """The estimator's view of the cluster: the configured spec, else one from Slurm's nodes."""
    if cluster:
        return load_cluster(cluster)
    groups: dict[str, list[int]] = {}
    for n in nodes:
        t = node_type(n, part_types)
        if t is not None and n.gpus > 0:
            groups.setdefault(t, []).append(n.gpus)
    parts = type_partitions(part_types)
    return cluster_from_dict({
        "name": "slurm", "network": {"kind": network},
        "node_groups": [{"gpu_type": t, "nodes": len(c), "gpus_per_node": max(c),
                         "partition": parts.get(t, t)} for t, c in sorted(groups.items())]})


def requested_gpus(job: SlurmJob) -> int | None:
    """The GPU count of a job's own Slurm request, or None when it asked for none."""
    if job.gpus_per_job:
        return job.gpus_per_job
    if job.gpus_per_node:
        return job.gpus_per_node * max(1, job.node_count)
    return None


def same_shape(a: Cell, b: Cell) -> bool:
    """Same GPU type, count and stage count (the per-node layout aside)."""
    return (a.gpu_type, a.num_gpus, a.num_stages) == (b.gpu_type, b.num_gpus, b.num_stages)


def best_estimate_for(view: JobView, cell: Cell) -> CellEstimate | None:
    """The estimate of ``cell``, or of a feasible Cell of the same shape."""
    exact = view.estimate_for(cell)
    if exact is not None:
        return exact
    return next((e for e in view.feasible_estimates() if same_shape(e.cell, cell)), None)


@dataclass(frozen=True)
class ManagedJob:
    """An elastic job with a valid spec, as Slurm shows it and as the policy sees it."""

    slurm: SlurmJob
    spec: ElasticSpec
    view: JobView

    def run_iterations(self, now_s: float) -> float:
        """Iterations the current run has done, estimated from its run time."""
        a = self.view.assignment
        if a is None or not self.slurm.start_time_s:
            return 0.0
        est = best_estimate_for(self.view, a.cell)
        if est is None or not est.feasible or est.iteration_time_s <= 0:
            return 0.0
        return max(0.0, now_s - self.slurm.start_time_s) / est.iteration_time_s


@functools.lru_cache(maxsize=4096)
def estimate_key(spec: ElasticSpec, cluster: ClusterSpec, plan_space: str,
                 micro_batches: int | None, max_gpus: int) -> str:
    """The estimate cache's key: everything the estimates depend on."""
    groups = [(g.gpu_type, g.nodes, g.gpus_per_node, g.network.kind, g.network.bandwidth_gbps)
              for g in cluster.node_groups]
    return json.dumps([spec.model, spec.global_batch, spec.num_gpus, spec.gpu_type, plan_space,
                       micro_batches, max_gpus, groups])


def running_assignment(job: SlurmJob, pc: PlanComment, node_types: dict[str, str],
                       part_types: dict[str, str]) -> Assignment | None:
    """The Cell and placement a running job holds (None when Slurm's record is incomplete)."""
    per_node = job.granted_gpus_per_node
    if not per_node or len(per_node) != len(job.nodes):
        return None
    gtype = job.granted_gpu_type or part_types.get(job.partition)
    if gtype is None or any(node_types.get(n) != gtype for n in job.nodes):
        return None
    parts = pc.cell_parts()
    stages = parts[2] if parts and parts[0] == gtype and parts[1] == sum(per_node) else 1
    cell = Cell(gtype, sum(per_node), max(per_node), stages)
    return Assignment(cell, tuple(sorted(zip(job.nodes, per_node))))


def reserved_cell(job: SlurmJob, part_types: dict[str, str]) -> Cell | None:
    """The GPUs a pending job will take once Slurm starts it, as a Cell (None: none known).

    A job the daemon released carries its Cell in AdminComment; any other (an elastic job
    with a spec error, released as submitted) takes what it asked Slurm for.
    """
    parts = parse_plan_comment(job.admin_comment).cell_parts()
    if parts is not None:
        return Cell(parts[0], parts[1], max(1, job.gpus_per_node or parts[1]), parts[2])
    gtype = job.gpu_type_requested or part_types.get(job.partition)
    gpus = requested_gpus(job)
    if gtype is None or not gpus:
        return None
    return Cell(gtype, gpus, max(1, job.gpus_per_node or gpus), 1)


def build_snapshot(now_s: float, nodes: tuple[SlurmNode, ...], managed: list[ManagedJob],
                   reserved: list[Cell], part_types: dict[str, str], trigger: str,
                   round_s: float, restart_cost_s: float, policy_state: object) -> Snapshot:
    """The policy's input: typed nodes with what unmanaged jobs hold, and the managed jobs.

    GPUs in use that no managed running job accounts for (plain jobs, elastic jobs with a
    spec error, jobs completing) are unmanaged; so are GPUs on nodes that are down or
    drained, and GPUs ``reserved`` for jobs Slurm is about to start (released by the
    daemon, with a Cell or as submitted).
    """
    held_by_managed: Counter[str] = Counter()
    for m in managed:
        if m.view.assignment is not None:
            for name, gpus in m.view.assignment.placement:
                held_by_managed[name] += gpus
    typed = [(n, node_type(n, part_types)) for n in nodes]
    typed = [(n, t) for n, t in typed if t is not None and n.gpus > 0]
    unmanaged: dict[str, int] = {}
    for n, _ in typed:
        used = n.gpus if not n.is_usable else n.gpus_used
        unmanaged[n.name] = min(n.gpus, max(0, used - held_by_managed[n.name]))
    free = FreeGpus([(n.name, t, n.gpus) for n, t in typed],
                    {n.name: n.gpus - unmanaged[n.name] - held_by_managed[n.name] for n, _ in typed})
    for cell in reserved:
        placement = free.place(cell, strict=False)
        if placement is not None:
            free.take(placement)
            for name, gpus in placement:
                unmanaged[name] += gpus
    views = tuple(NodeView(n.name, t, n.gpus, unmanaged[n.name]) for n, t in typed)
    jobs = tuple(sorted((m.view for m in managed), key=lambda v: (v.submit_time_s, int(v.job_id))))
    return Snapshot(now_s, views, jobs, trigger, round_s, restart_cost_s, policy_state)


def start_update(assignment: Assignment, m: ManagedJob, type_parts: dict[str, str],
                 reason: str, policy_name: str, remat: bool = True) -> JobUpdate | None:
    """The pending-job update that gives ``m`` its Cell (None: no partition has the type).

    The AdminComment carries the plan string the runner reads (``estimator.plan_string``:
    cell, per-stage dp × tp, micro-batches, rematerialization, stage boundaries).
    """
    cell = assignment.cell
    partition = type_parts.get(cell.gpu_type)
    if partition is None:
        return None
    counts = [g for _, g in assignment.placement]
    if counts and min(counts) == max(counts):
        per_node, num_nodes = counts[0], len(counts)
    else:
        per_node = min(cell.gpus_per_node, cell.num_gpus)
        num_nodes = -(-cell.num_gpus // per_node)
    est = best_estimate_for(m.view, cell)
    pc = parse_plan_comment(m.slurm.admin_comment)
    layers = None
    if est and est.stages:
        layers = ",".join(str(b) for b in (est.stages[0].layer_start, *(s.layer_end for s in est.stages)))
    text = format_plan_comment(PlanComment(
        requested=pc.requested, cell=cell.label(),
        plan=plan_label(est.stages) if est else None,
        micro_batches=est.micro_batches if est else None,
        remat=remat if est else None, layers=layers,
        samples_per_s=est.samples_per_s if est and est.feasible else None,
        why=reason or f"chosen by {policy_name}"))
    return JobUpdate(partition=partition, gpus_per_node=per_node, num_nodes=num_nodes,
                     admin_comment=text, start_now=True)


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

    @property
    def total_s(self) -> float:
        return self.observe_s + self.estimate_s + self.decide_s + self.act_s


@dataclass
class _Acts:
    """Actions of one round, collected while acting."""

    taken: list[tuple[str, int]] = field(default_factory=list)


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
        env: variables for the daemon's own Slurm commands (the arrival poll), e.g.
            ``{"SLURM_CONF": ...}``; None inherits the environment, as the client should.
    """

    def __init__(self, config: DaemonConfig, client: SlurmClient, store: Store,
                 clock: Clock | None = None, metrics: Metrics | None = None,
                 out: Callable[[str], None] = print,
                 reload: Callable[[], DaemonConfig] | None = None,
                 env: dict[str, str] | None = None):
        self.client = client
        self.store = store
        self._wake = threading.Event()
        self.clock = clock or WallClock(sleep=self._wake.wait)
        self.metrics = metrics or Metrics(None)
        self.out = out
        self._reload = reload
        self._env = env
        self._stop = False
        self._reload_requested = False
        self._policy_state: object = None
        self._known_ids: set[int] = set()
        self._estimates = EstimateCache(store)
        self._spec_cache: dict[int, tuple[ElasticSpec | None, str | None]] | None = None
        self._submit_s: dict[int, float] = {}
        self._new_specs = 0
        self._pruned_s = 0.0
        self.config = config
        self.policy: Policy = make_policy(config.policy, **dict(config.policy_options))

    # -- control ------------------------------------------------------------------------
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
        if new.state_db != self.config.state_db:
            log.warning(kv("config_reload_ignored", key="state_db", why="restart to move the state file"))
            new = replace(new, state_db=self.config.state_db)
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
                if report.unread_specs:  # a backlog of new jobs: take the next batch soon
                    backoff_s = min(self.config.interval_s, max(self.config.poll_s, 1.0))
            except SlurmExtError as e:
                ok = False
                self.metrics.error("slurm")
                self.metrics.round_done(self.clock.now_s() - started_s, "slurm_error")
                backoff_s = min(self.config.backoff_max_s,
                                max(self.config.interval_s / 10, 2 * backoff_s, 1.0))
                log.error(kv("slurm_unreachable", error=e, retry_in_s=backoff_s))
            except Exception as e:  # the service must outlive any single bad round
                ok = False
                self.metrics.error("round")
                self.metrics.round_done(self.clock.now_s() - started_s, "error")
                log.exception(kv("round_failed", error=repr(e)))
            if once:
                return 0 if ok else 1
            next_s = started_s + (backoff_s or self.config.interval_s)
            trigger = self._wait_for_next(next_s, poll=ok)
        log.info(kv("daemon_stopped"))
        return 0

    def _wait_for_next(self, next_s: float, poll: bool) -> str:
        """Sleep until ``next_s``, polling for new elastic jobs; returns the next trigger."""
        while not self._stop and not self._reload_requested:
            now_s = self.clock.now_s()
            if now_s >= next_s:
                return TRIGGER_ROUND
            step_s = next_s - now_s
            if poll and self.config.poll_s > 0:
                step_s = min(step_s, self.config.poll_s)
            self._wake.clear()
            self.clock.sleep_until(now_s + step_s)
            if poll and self.config.poll_s > 0 and not self._stop and self._new_elastic_job():
                return TRIGGER_ARRIVAL
        return TRIGGER_ROUND

    def _new_elastic_job(self) -> bool:
        try:
            text = run_command(pending_listing_argv(), self.config.slurm_timeout_s, env=self._env).stdout
        except SlurmExtError as e:
            log.debug(kv("poll_failed", error=e))
            return False
        new = [j for j in parse_pending_listing(text) if j not in self._known_ids]
        if new:
            log.info(kv("elastic_job_arrived", job_ids=",".join(map(str, new[:10]))))
        return bool(new)

    # -- recovery -----------------------------------------------------------------------
    def recover(self) -> int:
        """Finish or undo actions a previous run left open; returns the entries handled."""
        entries = self.store.open_entries()
        if not entries:
            return 0
        jobs = {j.job_id: j for j in self.client.jobs()}
        for step in plan_recovery(entries, jobs):
            e = step.entry
            log.warning(kv("recover", job_id=e.job_id, kind=e.kind, step=step.step, why=step.why))
            if self.config.dry_run:
                self.out(f"dry-run: recover job={e.job_id} kind={e.kind} step={step.step} ({step.why})")
                continue
            try:
                if step.step == journal.REAPPLY:
                    self.client.update_pending(e.job_id, e.update)
                    self.client.release(e.job_id)
                elif step.step == journal.RELEASE_ONLY:
                    self.client.release(e.job_id)
                self.store.close_entry(e.entry_id, journal.DONE, self.clock.now_s(), f"recovered: {step.why}")
            except SlurmExtError as err:
                self.store.close_entry(e.entry_id, journal.FAILED, self.clock.now_s(), str(err))
                log.error(kv("recover_failed", job_id=e.job_id, error=err))
        return len(entries)

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
        part_types = partition_types(nodes, cfg.partition_map())
        cluster = cluster_spec(nodes, part_types, cfg.cluster, cfg.network)
        elastic = [j for j in active if j.is_elastic]
        if self._spec_cache is None:  # once per process: what earlier runs parsed
            self._spec_cache = {job_id: (None if sj is None else ElasticSpec.from_json(sj), err)
                                for job_id, (sj, err) in self.store.specs().items()}
        active_ids = {j.job_id for j in active}
        if trigger == TRIGGER_ROUND and any(
                spec is not None and job_id not in active_ids
                for job_id, (spec, _) in self._spec_cache.items()):
            trigger = TRIGGER_COMPLETION  # a managed job ended since the last round
        specs, errors = self._specs(elastic, now_s)
        managed, launching, more_errors = self._managed(elastic, specs, nodes, part_types, cluster, now_s)
        errors += more_errors
        acts = _Acts()
        for job, message in errors:
            self._handle_spec_error(job, message, acts)
        # Jobs Slurm is about to start hold their GPUs already, as far as the policy goes.
        about_to_start = launching + [j for j, _ in errors if j.state == "PENDING"]
        reserved = [c for c in (reserved_cell(j, part_types) for j in about_to_start) if c is not None]
        snapshot = build_snapshot(now_s, nodes, managed, reserved, part_types, trigger,
                                  cfg.interval_s, cfg.restart_cost_s, self._policy_state)
        t2 = time.perf_counter()
        decision = self.policy.decide(snapshot)
        self.metrics.decision()
        try:
            validate_decision(snapshot, decision)
        except DecisionError as e:
            self.metrics.error("policy")
            log.error(kv("decision_rejected", policy=self.policy.name, error=e))
            decision = Decision(())
        self._policy_state = decision.policy_state
        t3 = time.perf_counter()
        self._act(snapshot, decision, {m.view.job_id: m for m in managed}, part_types, acts)
        if not cfg.dry_run:
            self.store.forget_jobs_except(active_ids)
            if now_s - self._pruned_s > PRUNE_EVERY_S:
                self.store.prune_journal(now_s - JOURNAL_KEEP_S)
                self._pruned_s = now_s
        self._spec_cache = {j: v for j, v in self._spec_cache.items() if j in active_ids}
        self._submit_s = {j: v for j, v in self._submit_s.items() if j in active_ids}
        t4 = time.perf_counter()
        report = RoundReport(trigger, len(active), len(elastic), len(snapshot.jobs), len(errors),
                             tuple(acts.taken), t1 - t0, t2 - t1, t3 - t2, t4 - t3,
                             self._new_specs, len(elastic) - len(specs) - len(errors))
        self.metrics.jobs({"active": len(active), "elastic": len(elastic), "managed": len(snapshot.jobs)})
        log.info(kv("round_done", trigger=trigger, jobs=report.jobs, elastic=report.elastic,
                    managed=report.managed, spec_errors=report.spec_errors,
                    actions=len(report.actions), seconds=report.total_s))
        return report

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
        try:
            script = self.client.batch_script(job.job_id) if job.batch else None
        except SlurmExtError as e:
            log.warning(kv("batch_script_unreadable", job_id=job.job_id, error=e))
            script = None
        pc = parse_plan_comment(job.admin_comment)
        try:
            spec = parse_spec(job.comment, script, requested_gpus(job),
                              pc.requested or job.gpu_type_requested)
            check_model(spec, model_loader_for(job.user))
        except ElasticSpecError as e:
            log.warning(kv("spec_error", job_id=job.job_id, user=job.user, error=e))
            return None, str(e)
        return spec.to_json(), None

    def _managed(self, elastic: list[SlurmJob], specs: dict[int, ElasticSpec],
                 nodes: tuple[SlurmNode, ...], part_types: dict[str, str], cluster: ClusterSpec,
                 now_s: float) -> tuple[list[ManagedJob], list[SlurmJob], list[tuple[SlurmJob, str]]]:
        """Managed jobs with their estimates; jobs Slurm is about to start; estimation errors."""
        cfg = self.config
        candidates = [j for j in elastic if j.job_id in specs]
        new = {j.job_id: float(j.submit_time_s) for j in candidates if j.job_id not in self._submit_s}
        if new:  # the original submit time survives requeues (which reset Slurm's)
            self._submit_s.update(self.store.submit_times(new) if not cfg.dry_run else new)
        submit_s = self._submit_s
        progress = self.store.progress()
        node_types = {n.name: node_type(n, part_types) for n in nodes}
        managed: list[ManagedJob] = []
        launching: list[SlurmJob] = []
        errors: list[tuple[SlurmJob, str]] = []
        for job in candidates:
            spec = specs[job.job_id]
            pc = parse_plan_comment(job.admin_comment)
            if job.state == "RUNNING":
                assignment = running_assignment(job, pc, node_types, part_types)
                if assignment is None:  # counted as unmanaged usage through the nodes' gres
                    log.info(kv("running_job_not_managed", job_id=job.job_id, nodes=",".join(job.nodes),
                                granted=",".join(map(str, job.granted_gpus_per_node)),
                                gpu_type=job.granted_gpu_type))
                    continue
                state = RUNNING
            elif is_held(job):
                assignment, state = None, PENDING
            elif job.state == "PENDING" and pc.cell is not None and not self._launch_stale(job, now_s):
                launching.append(job)  # released by us; Slurm starts it when it can
                continue
            elif job.state == "PENDING":
                assignment, state = None, PENDING
            else:
                continue  # completing, suspended, ...: its GPUs show in the nodes' gres
            jspec = JobSpec(spec.model, spec.global_batch, spec.num_gpus, spec.gpu_type)
            try:
                est = {}
                for space in (cfg.plan_space, "dp-only"):
                    options = EstimateOptions(plan_space=space, micro_batches=cfg.micro_batches,
                                              max_gpus=cfg.max_gpus)
                    est[space] = self._estimates.get(
                        estimate_key(spec, cluster, space, cfg.micro_batches, cfg.max_gpus),
                        lambda o=options: estimate_job(jspec, cluster, o).cells, now_s)
                if not any(e.feasible for e in est[cfg.plan_space]):
                    why = next((e.reason for e in est[cfg.plan_space] if e.reason), "no Cell enumerated")
                    raise SpecError("model", spec.model, f"no Cell of this cluster fits it ({why})")
            except (SpecError, ValueError, KeyError, ArithmeticError) as e:
                message = f"cannot estimate: {e}"
                if not cfg.dry_run:
                    self.store.put_spec(job.job_id, None, message, now_s)
                self._spec_cache[job.job_id] = (None, message)
                errors.append((job, message))
                continue
            started_s = float(job.start_time_s or job.submit_time_s)
            view = JobView(
                job_id=str(job.job_id), user=job.user, spec=jspec,
                submit_time_s=submit_s.get(job.job_id, float(job.submit_time_s)), state=state,
                assignment=assignment, iterations_done=progress.get(job.job_id, 0.0),
                iterations_total=spec.iterations, restarts=job.restart_count,
                last_change_s=started_s if state == RUNNING else submit_s.get(job.job_id, started_s),
                deadline_s=spec.deadline_s, guaranteed=spec.guaranteed,
                estimates=est[cfg.plan_space], dp_only_estimates=est["dp-only"])
            m = ManagedJob(job, spec, view)
            if state == RUNNING:
                m = ManagedJob(job, spec, replace(view, iterations_done=min(
                    float(spec.iterations), view.iterations_done + m.run_iterations(now_s))))
            managed.append(m)
        return managed, launching, errors

    def _launch_stale(self, job: SlurmJob, now_s: float) -> bool:
        """A released job Slurm will not start as planned: decide it afresh.

        Either Slurm says it never will (``BadConstraints``, ...), or it has waited more
        than ``LAUNCH_TIMEOUT_ROUNDS`` rounds for GPUs the policy thought were free.
        """
        if job.reason in STUCK_REASONS:
            return True
        starts = [e for e in self.store.entries(job.job_id) if e.kind in (journal.START, journal.RESCALE)]
        limit_s = max(LAUNCH_TIMEOUT_MIN_S, LAUNCH_TIMEOUT_ROUNDS * self.config.interval_s)
        return bool(starts) and now_s - starts[-1].created_s > limit_s

    # -- acting -------------------------------------------------------------------------
    def _take(self, kind: str, job_id: int, update: JobUpdate | None, release: bool, acts: _Acts,
              describe: str) -> bool:
        """Journal, apply, close one pending-job action; True when it was applied."""
        if self.config.dry_run:
            self.out(f"dry-run: {kind} job={job_id} {describe}")
            acts.taken.append((kind, job_id))
            return True
        entry = self.store.intend(job_id, kind, update, self.clock.now_s())
        try:
            if update is not None:
                self.client.update_pending(job_id, update)
            if release:
                self.client.release(job_id)
        except SlurmExtError as e:
            self.store.close_entry(entry, journal.FAILED, self.clock.now_s(), str(e))
            self.metrics.error("action")
            log.error(kv("action_failed", kind=kind, job_id=job_id, error=e))
            return False
        self.store.close_entry(entry, journal.DONE, self.clock.now_s())
        self.metrics.action(kind)
        acts.taken.append((kind, job_id))
        log.info(kv("action", kind=kind, job_id=job_id, detail=describe))
        return True

    def _handle_spec_error(self, job: SlurmJob, message: str, acts: _Acts) -> None:
        pc = parse_plan_comment(job.admin_comment)
        wanted = format_plan_comment(PlanComment(requested=pc.requested, error=message))
        held = is_held(job) and job.state == "PENDING"
        if job.admin_comment == wanted and not held:
            return
        update = JobUpdate(admin_comment=wanted, start_now=False) if job.admin_comment != wanted else None
        if held:
            self._take(journal.RELEASE, job.job_id, update, True, acts,
                       f"spec error, released as submitted: {message}")
        elif update is not None:
            self._take(journal.ANNOTATE, job.job_id, update, False, acts, f"spec error: {message}")

    def _act(self, snapshot: Snapshot, decision: Decision, views_by_id: dict[str, ManagedJob],
             part_types: dict[str, str], acts: _Acts) -> None:
        type_parts = type_partitions(part_types)
        rescales: list[tuple[Action, JobUpdate | None]] = []
        starts: list[tuple[SlurmJob, JobUpdate]] = []
        for action in implied_actions(snapshot, decision):
            view = views_by_id[action.job_id]
            job: SlurmJob = view.slurm
            if action.kind == MOVE or (action.kind == RESIZE and same_shape(action.before.cell, action.after.cell)):
                continue  # Slurm picks the nodes; a new layout alone is not worth a restart
            update = None
            if action.after is not None:
                update = start_update(action.after, view, type_parts, action.reason,
                                              self.policy.name)
                if update is None:
                    log.warning(kv("no_partition", job_id=job.job_id, gpu_type=action.after.cell.gpu_type))
                    continue
            if action.kind == START:
                starts.append((job, update))
            elif action.kind in (RESIZE, CHANGE_TYPE, SUSPEND):
                rescales.append((action, update))
        if rescales:  # first, so that the GPUs they give back are free for the starts
            self._rescale(rescales, views_by_id, acts)
        for job, update in starts:
            self._take(journal.START, job.job_id, update, is_held(job), acts, update.admin_comment)
        self._annotate_waiting(snapshot, decision, views_by_id, acts)

    def _annotate_waiting(self, snapshot, decision: Decision, views_by_id: dict, acts: _Acts) -> None:
        """Hold pending elastic jobs the policy leaves waiting and say why, within a budget."""
        budget = self.config.max_annotations_per_round
        wanted = decision.as_dict()
        for jv in snapshot.jobs:
            d = wanted.get(jv.job_id)
            if jv.assignment is not None or (d is not None and d.assignment is not None):
                continue
            job: SlurmJob = views_by_id[jv.job_id].slurm
            pc = parse_plan_comment(job.admin_comment)
            why = (d.reason if d and d.reason else "waiting for GPUs")
            text = format_plan_comment(PlanComment(requested=pc.requested, why=why))
            held = is_held(job)
            if held and text == job.admin_comment:
                continue
            if budget <= 0:
                break
            budget -= 1
            if self.config.dry_run:
                self.out(f"dry-run: annotate job={job.job_id} {text}")
                continue
            try:
                self.client.update_pending(job.job_id, JobUpdate(admin_comment=text, start_now=False))
                if not held:
                    self.client.hold(job.job_id)
            except SlurmExtError as e:
                log.warning(kv("annotate_failed", job_id=job.job_id, error=e))

    def _rescale(self, items: list[tuple[Action, JobUpdate | None]], views_by_id: dict, acts: _Acts) -> None:
        """USR1 → wait for requeue-held (or force it) → update → release, for all at once."""
        if self.config.dry_run:
            for action, update in items:
                self.out(f"dry-run: {action.kind} job={action.job_id} signal USR1, requeue held, "
                         f"then {update.admin_comment if update else 'stay held'}")
                acts.taken.append((action.kind, int(action.job_id)))
            return
        entries: dict[int, tuple[int, Action, JobUpdate | None]] = {}
        for action, update in items:
            job_id = int(action.job_id)
            kind = journal.SUSPEND if update is None else journal.RESCALE
            now_s = self.clock.now_s()
            entry = self.store.intend(job_id, kind, update, now_s)
            view = views_by_id[action.job_id]
            self.store.add_progress(job_id, view.run_iterations(now_s), now_s)
            try:
                self.client.signal_batch(job_id, "USR1")
            except SlurmExtError as e:
                log.warning(kv("signal_failed", job_id=job_id, error=e))
            entries[job_id] = (entry, action, update)
            log.info(kv("rescale_signalled", job_id=job_id, kind=action.kind, why=action.reason))
        waiting = self._wait_held(set(entries), self.config.rescale_timeout_s)
        if self._stop:  # leave the entries open: the next start finishes them (recover)
            log.warning(kv("rescale_interrupted", job_ids=",".join(map(str, sorted(entries)))))
            return
        for job_id in sorted(waiting):
            log.warning(kv("rescale_forced", job_id=job_id, why="no requeue after USR1"))
            try:
                self.client.requeue_hold(job_id)
            except SlurmExtError as e:
                log.error(kv("requeue_hold_failed", job_id=job_id, error=e))
        if waiting:
            still = self._wait_held(waiting, REQUEUE_HOLD_WAIT_S)
            for job_id in still:
                entry, _, _ = entries.pop(job_id)
                self.store.close_entry(entry, journal.FAILED, self.clock.now_s(), "never came back held")
        states = self._job_states(set(entries)) if entries else {}
        for job_id, (entry, action, update) in sorted(entries.items()):
            if states.get(job_id, ("GONE", False))[0] not in ACTIVE_STATES:
                self.store.close_entry(entry, journal.ABANDONED, self.clock.now_s(), "job ended")
                continue
            try:
                if update is not None:
                    self.client.update_pending(job_id, update)
                    self.client.release(job_id)
                else:
                    pc = parse_plan_comment(views_by_id[action.job_id].slurm.admin_comment)
                    self.client.update_pending(job_id, JobUpdate(
                        admin_comment=format_plan_comment(PlanComment(requested=pc.requested, why=action.reason or "suspended")),
                        start_now=False))
            except SlurmExtError as e:
                self.store.close_entry(entry, journal.FAILED, self.clock.now_s(), str(e))
                log.error(kv("rescale_failed", job_id=job_id, error=e))
                continue
            self.store.close_entry(entry, journal.DONE, self.clock.now_s())
            self.metrics.action(action.kind)
            acts.taken.append((action.kind, job_id))
            log.info(kv("action", kind=action.kind, job_id=job_id, why=action.reason))

    def _job_states(self, job_ids: set[int]) -> dict[int, tuple[str, bool]]:
        """Job id → (state, held) of the given jobs, from the cheap listing (gone: absent)."""
        out = run_command(job_states_argv(job_ids), self.config.slurm_timeout_s, env=self._env,
                          check=False)
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            raise SlurmCommandError(out.argv, out.returncode, out.stderr)
        return parse_job_states(out.stdout)

    def _wait_held(self, job_ids: set[int], timeout_s: float) -> set[int]:
        """Wait until each job is held or gone; returns the ones still running at the deadline."""
        deadline_s = self.clock.now_s() + timeout_s
        waiting = set(job_ids)
        while waiting and not self._stop:
            try:
                states = self._job_states(waiting)
            except SlurmExtError as e:
                log.warning(kv("poll_failed", error=e))
                states = {j: ("UNKNOWN", False) for j in waiting}
            for job_id in sorted(waiting):
                state, held = states.get(job_id, ("GONE", False))
                if state not in ACTIVE_STATES or (held and state != "RUNNING"):
                    waiting.discard(job_id)
            if not waiting or self.clock.now_s() >= deadline_s:
                break
            time.sleep(RESCALE_POLL_S)
        return waiting
