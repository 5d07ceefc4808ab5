"""Observing Slurm: pure functions from Slurm's jobs and nodes to the policy's Snapshot.

The cluster's GPU types by partition, the estimator's view of the cluster, the Cells
running and reserved jobs hold, when plain jobs free their GPUs, and the Snapshot itself.
Nothing here talks to Slurm: the daemon reads it through its client and hands it in.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from estimator.cells import Cell, CellEstimate
from estimator.cluster import ClusterSpec, cluster_from_dict, load_cluster
from estimator.contract import (PLAN_SOURCES, RUNNER_PLAN_SOURCES, PlanComment, RunnerReport,
                                format_plan_comment, parse_plan_comment)
from estimator.errors import SpecError, yaml_problem
from estimator.gpus import CATALOG
from estimator.models import BUILTIN_MODELS, MAX_MODEL_FILE_BYTES, load_model, model_from_yaml
from estimator.plan_string import PlanString, parse_plan
from estimator.profile_store import store_version
from estimator.refine import Measurement
from policy.forecast import GpuRelease
from policy.interface import Assignment, DerivedCache, JobView, NodeView, Snapshot
from policy.placement import FreeGpus
from slurm_ext import store as journal
from slurm_ext.jobspec import ElasticSpec
from slurm_ext.slurm_client import COMPLETING, HELD_FOR_RESCALE, JobUpdate, SlurmJob, SlurmNode
from slurm_ext.user_files import read_user_file


@functools.lru_cache(maxsize=8192)
def plan_comment(text: str) -> PlanComment:
    """`parse_plan_comment`, memoized: thousands of waiting jobs share a few AdminComments."""
    return parse_plan_comment(text)


def kv(event: str, **fields: object) -> str:
    """One structured log line: ``event=round_done jobs=12 why="no GPUs"``."""
    parts = [f"event={event}"]
    for k, v in fields.items():
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        if not text or any(c in text for c in ' "='):
            text = '"' + text.replace('"', "'") + '"'
        parts.append(f"{k}={text}")
    return " ".join(parts)


# Starts of one job on one GPU type Slurm refuses (its account not allowed in the
# partition, a GRES no node has) since the last start it accepted, before the job is
# offered only other types' Cells, and runs as submitted when no other type fits: the
# policy would choose the same again.
START_REFUSALS = 3
# How a failed action's journal note begins when Slurm gave no answer (a timeout, slurmctld
# down): no refusal, it counts neither way.
NO_ANSWER = "no answer: "


def _answered_starts(entries) -> list:
    """The starts in the journal ``entries`` that Slurm answered (accepted or refused)."""
    return [e for e in entries if e.kind == journal.START and not e.note.startswith(NO_ANSWER)]


def refused_starts(entries) -> tuple[int, str]:
    """How many of a job's last starts in the journal ``entries`` Slurm refused in a row
    (those it did not answer aside), and the last refusal's message."""
    starts = _answered_starts(entries)
    refused = 0
    while refused < len(starts) and starts[-1 - refused].state == journal.FAILED:
        refused += 1
    return refused, starts[-1].note if refused else ""


def refused_gpu_types(entries) -> dict[str, int]:
    """For each GPU type, the job's starts on it Slurm refused since the last start it
    accepted (those it did not answer aside)."""
    refused: Counter = Counter()
    for e in _answered_starts(entries):
        if e.state != journal.FAILED:
            refused.clear()
            continue
        parts = plan_comment(e.update.admin_comment).cell_parts() if e.update and e.update.admin_comment else None
        refused[parts[0] if parts else ""] += 1
    return dict(refused)


def last_release(entries):
    """The journal's last start, rescale or release of a job (None: there is none)."""
    return next((e for e in reversed(entries) if e.kind in (journal.START, journal.RESCALE, journal.RELEASE)), None)


def cell_gpus(job: SlurmJob) -> int:
    """GPUs of the Cell the daemon gave ``job`` (its AdminComment), 0 when none."""
    parts = plan_comment(job.admin_comment).cell_parts()
    return parts[1] if parts else 0


def is_held(job: SlurmJob) -> bool:
    """Held, including requeued-held after a rescale signal (``SPECIAL_EXIT``)."""
    return job.is_held or job.state in HELD_FOR_RESCALE


# -- observing: pure functions from Slurm's jobs and nodes to the policy's Snapshot ---


def model_loader_for(user: str) -> Callable[[str], object]:
    """``load_model`` that reads a model file only if the job's owner could read it.

    The daemon runs as root: without this a user could name any file (``/dev/zero``, a
    file only root may read) as a model and learn from the error what it holds. The file
    is read once, through the descriptor whose owner was checked (``read_user_file``);
    a name without ``/`` must be a built-in (never a file in the daemon's directory).
    """
    def load(name: str) -> object:
        if "/" not in name:
            if name.strip().lower() not in BUILTIN_MODELS:
                raise SpecError("model", name, f"not a built-in model ({', '.join(BUILTIN_MODELS)}); give one, "
                                               "or an absolute path to a YAML file")
            return load_model(name)
        return model_from_yaml(_model_file_text(user, name), name)
    return load


def _model_file_text(user: str, path: str) -> str:
    """A model file's YAML, read as ``user`` could (SpecError naming the model; OSError)."""
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        raise SpecError("model", path, "give a model YAML file (.yaml or .yml)")
    try:
        return read_user_file(path, MAX_MODEL_FILE_BYTES, owner=user).decode()
    except SpecError as e:
        raise SpecError("model", path, e.hint) from None
    except UnicodeDecodeError as e:
        raise SpecError("model", path, yaml_problem(e)) from None


def model_text_for(user: str, model: str) -> str | None:
    """A model file's YAML as its job's owner could read it ("" for a built-in; None when it
    cannot be read so): what the online refit keeps instead of the path."""
    if "/" not in model:
        return ""
    try:
        return _model_file_text(user, model)
    except (OSError, SpecError):
        return None


def partition_types(nodes: tuple[SlurmNode, ...], configured: dict[str, str]) -> dict[str, str]:
    """Partition → GPU type: the configured map, else each partition whose GPU nodes share
    a type (a node without GPUs, a login or CPU node, does not make it mixed)."""
    if configured:
        return dict(configured)
    seen: dict[str, set] = {}
    for n in nodes:
        if n.gpus <= 0:
            continue
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


def steerable_nodes(nodes: tuple[SlurmNode, ...], part_types: dict[str, str], method: str,
                    managed: list[ManagedJob]) -> tuple[SlurmNode, ...]:
    """The nodes a start can reach: those in a partition (a node defined in slurm.conf but
    in none runs no job), and under ``steering: partition`` only those of a type with a
    partition of its own (a job given such a Cell would stay held for ever; its GPUs are
    not the policy's to hand out). A node a managed job runs on stays (it was reachable
    when the job started)."""
    reachable = type_partitions(part_types) if method == "partition" else None
    running = {name for m in managed if m.view.assignment is not None for name in m.view.assignment.nodes}
    return tuple(n for n in nodes if n.name in running or (
        n.partitions and (reachable is None or node_type(n, part_types) in reachable)))


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
    if not groups and (unknown := sorted({str(n.gpu_type) for n in nodes if n.gpus > 0})):
        raise SpecError("partitions", unknown, f"no GPU node of a type the estimator knows ({', '.join(CATALOG)}): "
                                               "name each GPU partition's type under partitions: in the config "
                                               "(docs/admin.md)")
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
    return exact if exact is not None else view.feasible_like(cell)


# How far past its last report a runner's step is extrapolated at its measured speed.
PROGRESS_EXTRAPOLATE_S = 120.0


@dataclass(frozen=True)
class RunnerProgress:
    """The step a job's runner last reported (``measured.json``), when, and its speed."""

    step: int
    at_s: float
    iteration_time_s: float

    def steps_at(self, now_s: float) -> float:
        """The step now: the reported one plus what the measured speed did since (for a
        bounded time: a runner that stopped reporting is not assumed to go on)."""
        since_s = min(max(0.0, now_s - self.at_s), PROGRESS_EXTRAPOLATE_S)
        return self.step + since_s / self.iteration_time_s


def runner_progress(measured_text: str, job: SlurmJob) -> RunnerProgress | None:
    """The current run's progress from its runner's ``measured.json``; None when the file
    is another job's or an earlier run's, or has no step."""
    r = RunnerReport.from_text(measured_text)
    if r is None or r.job_id != str(job.job_id) or r.restart_count != job.restart_count:
        return None
    if r.step is None or r.step < 0 or not (r.step_at_s or 0) > 0 or not (r.iteration_time_s or 0) > 0:
        return None
    return RunnerProgress(r.step, r.step_at_s, r.iteration_time_s)


@dataclass(frozen=True)
class ManagedJob:
    """An elastic job with a valid spec, as Slurm shows it and as the policy sees it."""

    slurm: SlurmJob
    spec: ElasticSpec
    view: JobView
    # The AdminComment that shows the plan the job's runner runs (running_plan_comment),
    # when it differs from the job's; written for display only, never a reason to act.
    running_comment: str | None = None
    # Iterations counted before the current run (the journal's), and the step the
    # current run's runner reported, when it did.
    progress_before: float = 0.0
    runner: RunnerProgress | None = None
    # Why its guaranteed=yes does not bind (the admin's list refused it), shown with its why.
    guarantee_note: str | None = None

    def why(self, reason: str) -> str:
        """``reason``, and the guarantee note when there is one."""
        return f"{reason}; {self.guarantee_note}" if self.guarantee_note else reason

    def run_iterations(self, now_s: float) -> float:
        """Iterations the current run has done: from the step its runner reports, else
        estimated from its run time. With a reported step this is relative to the
        journal's count and so corrects it (negative when that count ran ahead)."""
        if self.runner is not None:
            return self.runner.steps_at(now_s) - self.progress_before
        a = self.view.assignment
        if a is None or not self.slurm.start_time_s:
            return 0.0
        est = best_estimate_for(self.view, a.cell)
        if est is None or not est.feasible or est.iteration_time_s <= 0:
            return 0.0
        return max(0.0, now_s - self.slurm.start_time_s) / est.iteration_time_s


@functools.lru_cache(maxsize=4096)
def measurement_from_text(text: str, cell_label: str | None, allow_cpu: bool) -> Measurement | None:
    """The runner's ``measured.json`` as a Measurement of the job's current Cell, or None.

    A file of another Cell (written before a rescale), from CPU fake devices (unless
    allowed: lab and tests), or that does not parse, says nothing about the current Cell.
    """
    r = RunnerReport.from_text(text)
    if r is None or cell_label is None or r.cell != cell_label:
        return None
    if not 0 < (r.iteration_time_s or 0) < math.inf or not (r.steps_measured or 0) >= 1:
        return None
    if r.platform != "gpu" and not allow_cpu:
        return None
    return Measurement(r.cell, r.iteration_time_s, r.steps_measured, r.peak_memory_gb)


# A measured speed already shown is rewritten only when it moved by more than this: the
# runner rewrites measured.json at every checkpoint, an AdminComment is one scontrol call.
SPS_REFRESH_FRAC = 0.1


@dataclass(frozen=True)
class RunningPlan:
    """What the runner's ``measured.json`` says runs: the plan, where it came from, its speed."""

    plan: PlanString
    source: str  # one of RUNNER_PLAN_SOURCES
    samples_per_s: float | None
    platform: str | None
    restart_count: int | None


def running_plan_from_text(text: str) -> RunningPlan | None:
    """The running plan in a ``measured.json`` text, or None when the file does not say.

    None for anything malformed: not JSON, no valid ``plan`` string, a ``plan`` whose Cell
    is not ``cell``, an unknown ``plan_source`` (a runner that does not report it).
    """
    r = RunnerReport.from_text(text)
    if r is None or r.cell is None or r.plan is None:
        return None
    try:
        plan = parse_plan(r.plan)
    except SpecError:
        return None
    if plan.cell_label != r.cell or r.plan_source not in RUNNER_PLAN_SOURCES:
        return None
    sps = r.samples_per_s if r.samples_per_s is not None and r.samples_per_s > 0 else None
    return RunningPlan(plan, r.plan_source, sps, r.platform, r.restart_count)


@functools.lru_cache(maxsize=4096)
def running_plan_comment(admin_comment: str, measured_text: str, allow_cpu: bool,
                         restart_count: int | None = None) -> str | None:
    """The AdminComment that shows the plan a running job really runs, or None: no change.

    The runner may tune the plan inside the allocation (same Cell, other per-stage dp × tp,
    micro-batches, remat or stage bounds). When its ``measured.json`` is of the Cell the
    AdminComment names and of the same run (``restart_count``), and its plan differs,
    the plan tokens become the running plan's, ``src`` says where it came from, and
    ``sps`` becomes the measured samples/s when the measurement is trusted (GPU, or CPU
    with ``allow_cpu``); ``requested``, ``cell`` and ``why`` are kept. A measured ``sps``
    already shown is refreshed when it moved by more than ``SPS_REFRESH_FRAC``; the
    runner's plan shown before it had a speed (written during its warm-up) gets its first. The
    daemon's own plan running as planned leaves its estimated ``sps``: nothing to write.

    Args:
        admin_comment: the job's AdminComment now.
        measured_text: the runner's ``measured.json``.
        allow_cpu: trust speeds measured on CPU fake devices (lab, tests).
        restart_count: the job's restart count in Slurm (None: do not check).
    """
    pc = parse_plan_comment(admin_comment)
    run = running_plan_from_text(measured_text)
    if pc.cell is None or pc.error is not None or run is None or run.plan.cell_label != pc.cell:
        return None  # not a planned job, or a file of another Cell (before a rescale)
    if restart_count is not None and run.restart_count != restart_count:
        return None  # written by an earlier run of the job
    p = run.plan
    layers = ",".join(map(str, p.layer_bounds)) if p.layer_bounds is not None else None
    tokens = (p.stages_label, p.micro_batches, p.remat, layers, p.zero_level, p.offload)
    trusted = run.samples_per_s is not None and (run.platform == "gpu" or allow_cpu)
    new = pc
    if tokens != (pc.plan, pc.micro_batches, pc.remat, pc.layers, pc.zero_level, pc.offload):
        # A plan read from the AdminComment keeps the source the AdminComment gave it.
        source = run.source if run.source in PLAN_SOURCES else pc.plan_source
        new = replace(pc, plan=p.stages_label, micro_batches=p.micro_batches, remat=p.remat, layers=layers,
                      zero_level=p.zero_level, offload=p.offload, plan_source=source)
        if trusted:
            new = replace(new, samples_per_s=run.samples_per_s, sps_measured=True)
    elif trusted and pc.sps_measured and pc.samples_per_s and \
            abs(run.samples_per_s - pc.samples_per_s) > SPS_REFRESH_FRAC * pc.samples_per_s:
        new = replace(pc, samples_per_s=run.samples_per_s)
    elif trusted and not pc.sps_measured and pc.plan_source in PLAN_SOURCES:
        # The runner's plan was shown before its speed was measured (a checkpoint in
        # its warm-up): its first measured speed replaces the estimate.
        new = replace(pc, samples_per_s=run.samples_per_s, sps_measured=True)
    if new == pc:
        return None
    text = format_plan_comment(new)
    return text if text != admin_comment else None


def estimate_key(spec: ElasticSpec, cluster: ClusterSpec, plan_space: str,
                 micro_batches: int | None, max_gpus: int, profile: str | None = None,
                 expert_parallel: bool = False) -> str:
    """The estimate cache's key: everything the estimates depend on (``profile``: the
    profile store and its version, when one is used; a model file's version)."""
    groups = [(g.gpu_type, g.nodes, g.gpus_per_node, g.network.kind, g.network.bandwidth_gbytes_s)
              for g in cluster.node_groups]
    key = [spec.model, spec.global_batch, spec.num_gpus, spec.gpu_type, plan_space,
           micro_batches, max_gpus, groups]
    # Appended only when set, so the keys of jobs without it, and the estimates the store
    # already holds under them, stay as they were before the setting existed.
    if spec.max_stages is not None:
        key.append({"max_stages": spec.max_stages})
    if spec.trainer != "runner":
        key.append({"trainer": spec.trainer})
    if profile is not None:
        key.append({"profile": profile})
    if expert_parallel:
        key.append({"expert_parallel": True})
    if spec.model.startswith("/"):  # a model file: estimates of one version of it
        try:
            st = os.stat(spec.model)
            key.append({"model_file": [st.st_mtime_ns, st.st_size]})
        except OSError:
            key.append({"model_file": None})
    return json.dumps(key)


def profile_db_if_written(path: str | None) -> str | None:
    """The configured profile store when it exists and can be read, else None: a store not
    yet written (nothing profiled so far) or not readable by this user leaves the
    estimates analytic (the daemon's rule, and ``explain``'s, which any user runs)."""
    if path is None:
        return None
    p = Path(path)
    return path if p.is_file() and os.access(p, os.R_OK) else None


def estimate_cells(job, cluster: ClusterSpec, options, warn: Callable[[str], None]) -> tuple[CellEstimate, ...]:
    """``estimate_job``'s Cells, with the profile store where it reads, else analytic: a
    damaged store, or one of a newer schema, is the site's fault, not the job's, and must
    not stop every job's estimate (``warn`` is told why)."""
    from estimator.estimate import estimate_job
    try:
        return estimate_job(job, cluster, options).cells
    except SpecError as e:
        if e.field != "profile_db" or options.profile_db is None:
            raise
        warn(f"{e}; estimates without it")
        return estimate_job(job, cluster, replace(options, profile_db=None)).cells


def profile_version(path: str | None) -> str | None:
    """The profile store and when it last changed (None: no store configured), so cached
    estimates are made anew after a profiling job or a refit writes to it."""
    if path is None:
        return None
    try:
        _, mtime_ns, _ = store_version(path)
    except SpecError:
        return f"{path}@missing"
    return f"{path}@{mtime_ns}"


def running_assignment(job: SlurmJob, pc: PlanComment, node_types: dict[str, str],
                       part_types: dict[str, str]) -> Assignment | None:
    """The Cell and placement a running job holds (None when Slurm's record is incomplete)."""
    per_node = job.granted_gpus_per_node
    if not per_node or len(per_node) != len(job.nodes):
        return None
    # Its nodes' type: Slurm's gres type may be a site name (``a100_sxm4_80gb``) that the
    # admin's partition map translates; a catalog name it grants must agree.
    types = {node_types.get(n) for n in job.nodes}
    gtype = types.pop() if len(types) == 1 else None
    if gtype is None or (job.granted_gpu_type in CATALOG and job.granted_gpu_type != gtype):
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
    parts = plan_comment(job.admin_comment).cell_parts()
    if parts is not None:
        return Cell(parts[0], parts[1], max(1, job.gpus_per_node or parts[1]), parts[2])
    requested = job.gpu_type_requested
    gtype = requested if requested in CATALOG else part_types.get(job.partition)
    gpus = requested_gpus(job)
    if gtype is None or not gpus:
        return None
    return Cell(gtype, gpus, max(1, job.gpus_per_node or gpus), 1)


def required_placement(entries) -> tuple[tuple[str, int], ...] | None:
    """Where the job's last release (a start, rescale or release entry of the journal)
    required it to run: each node of its ``ReqNodeList`` with the GPUs per node it asked
    for (None: no node named, Slurm picks)."""
    last = last_release(entries)
    update = last.update if last is not None else None
    if update is None or not update.required_nodes or not update.gpus_per_node:
        return None
    return tuple((name, update.gpus_per_node) for name in update.required_nodes)


def gpu_releases(jobs: list[SlurmJob], now_s: float) -> tuple[GpuRelease, ...]:
    """When the GPUs of running jobs the policy does not manage come free: at each job's
    end time in Slurm (start plus time limit), per node; now for a job past it (in its
    OverTimeLimit or KillWait) or completing. Running jobs without one are left out."""
    out = []
    for job in jobs:
        completing = job.state == COMPLETING or COMPLETING in job.state_flags
        if completing:
            at_s = now_s
        elif job.is_running and job.end_time_s:
            at_s = max(float(job.end_time_s), now_s)
        else:
            continue
        per_node = job.granted_gpus_per_node or (job.gpus_per_node,) * len(job.nodes)
        out += [GpuRelease(at_s, node, gpus) for node, gpus in zip(job.nodes, per_node) if gpus]
    return tuple(out)


def held_by_run(job: SlurmJob | None) -> dict[str, int]:
    """The GPUs a job's current run holds, per node (none unless it runs)."""
    return dict(zip(job.nodes, job.granted_gpus_per_node)) if job is not None and job.is_running else {}


def finish_on_s(estimates: tuple[CellEstimate, ...], cell: Cell, iterations_left: float,
                start_s: float) -> float | None:
    """When a job that starts on ``cell`` at ``start_s`` would finish: its remaining
    iterations at its estimate of that Cell, else at its fastest feasible estimate of a
    Cell of that shape (another layout over nodes; None: none), as ``policy.forecast``
    runs a started job."""
    usable = [e for e in estimates if e.feasible and e.iteration_time_s > 0]
    times = [e.iteration_time_s for e in usable if e.cell == cell] or \
        [e.iteration_time_s for e in usable if same_shape(e.cell, cell)]
    return start_s + max(0.0, iterations_left) * min(times) if times else None


def rescale_layover(cell: Cell | None, held: dict[str, int], types: dict[str, str | None]) -> dict[str, int]:
    """Where a rescale's new Cell on nodes Slurm picks most likely lands: on the GPUs its
    run is leaving (``held``, per node), on nodes of the Cell's type, at most its GPUs per
    node, the nodes it holds most of first. Per node; what is not there is placed anew."""
    out: dict[str, int] = {}
    left = cell.num_gpus if cell is not None else 0
    for name, gpus in sorted(held.items(), key=lambda item: (-item[1], item[0])):
        if left <= 0:
            break
        if types.get(name) == cell.gpu_type:
            out[name] = min(gpus, cell.gpus_per_node, left)
            left -= out[name]
    return out


def rescale_new_cell(update: JobUpdate | None, job: SlurmJob | None, types: dict[str, str | None]
                     ) -> tuple[dict[str, int], Cell | None]:
    """A rescale's new Cell: its GPUs per node on the nodes its update names, else where it
    most likely lands on the GPUs its run leaves (``rescale_layover``); and the rest of it,
    to reserve where GPUs are free (None: nothing; a suspension has no new Cell)."""
    if update is not None and update.required_nodes and update.gpus_per_node:
        return {name: update.gpus_per_node for name in update.required_nodes}, None
    cell = update_cell(update)
    new = rescale_layover(cell, held_by_run(job), types)
    rest = cell.num_gpus - sum(new.values()) if cell is not None else 0
    return new, (replace(cell, num_gpus=rest, gpus_per_node=min(cell.gpus_per_node, rest)) if rest > 0 else None)


def rescale_releases(job: SlurmJob | None, new: dict[str, int], now_s: float,
                     until_s: float | None) -> tuple[GpuRelease, ...]:
    """When a forecast sees the GPUs of a job in a rescale come free.

    Its current run is checkpointing and leaving: what it holds beyond its new Cell's
    share of each node (``new``: on the nodes its update names, ``rescale_pins``, or where
    it most likely lands, ``rescale_layover``; empty for a suspension) comes free now. The
    new Cell's GPUs there come free at ``until_s``, when it would finish on them (never,
    when not known). The rest of a new Cell is a reservation (``build_snapshot``).
    """
    held = held_by_run(job)
    out = [GpuRelease(now_s, name, gpus - new.get(name, 0)) for name, gpus in held.items()
           if gpus > new.get(name, 0)]
    if until_s is not None:
        out += [GpuRelease(until_s, name, gpus) for name, gpus in new.items() if gpus > 0]
    return tuple(out)


def update_cell(update: JobUpdate | None) -> Cell | None:
    """The Cell a pending-job update gives its job (its AdminComment's), or None (a
    suspension's update names none)."""
    if update is None or update.admin_comment is None:
        return None
    parts = plan_comment(update.admin_comment).cell_parts()
    if parts is None:
        return None
    return Cell(parts[0], parts[1], max(1, update.gpus_per_node or parts[1]), parts[2])


def rescale_pins(update: JobUpdate | None, job: SlurmJob | None) -> tuple[tuple[str, int], ...] | None:
    """The GPUs a rescale's new Cell takes on the nodes its update names, beyond what the
    job's current run holds there (which show as used already): (node, GPUs) pairs. None
    when the update names no nodes (a suspension, or Slurm picks them)."""
    if update is None or not update.required_nodes or not update.gpus_per_node:
        return None
    held = held_by_run(job)
    return tuple((name, update.gpus_per_node - held.get(name, 0)) for name in update.required_nodes
                 if update.gpus_per_node > held.get(name, 0))


def build_snapshot(now_s: float, nodes: tuple[SlurmNode, ...], managed: list[ManagedJob],
                   reserved: list[tuple[Cell, float | None, tuple[tuple[str, int], ...] | None]],
                   part_types: dict[str, str], trigger: str,
                   round_s: float, restart_cost_s: float, policy_state: object,
                   derived: DerivedCache | None = None, pinned: tuple[tuple[str, int], ...] = ()
                   ) -> tuple[Snapshot, tuple[GpuRelease, ...]]:
    """The policy's input: typed nodes with what unmanaged jobs hold, and the managed jobs;
    and when the ``reserved`` GPUs come free, for a forecast.

    GPUs in use that no managed running job accounts for (plain jobs, elastic jobs with a
    spec error, jobs completing) are unmanaged; so are GPUs on nodes that are down or
    drained, GPUs ``pinned`` on named nodes (a rescale's new Cell, ``rescale_pins``), and
    GPUs ``reserved`` for jobs Slurm is about to start (released by the daemon, with a
    Cell or as submitted, or a rescale's new Cell on nodes Slurm picks), placed where GPUs
    are free, or on the nodes its release required (``required_placement``). Each reserved
    Cell comes with when its job would finish on it (None: not known), which becomes a
    release of the GPUs it was placed on.
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
        used = n.gpus - n.gpus_free
        unmanaged[n.name] = min(n.gpus, max(0, used - held_by_managed[n.name]))
    gpus_of = {n.name: n.gpus for n, _ in typed}
    for name, gpus in pinned:
        if name in unmanaged:
            unmanaged[name] += max(0, min(gpus, gpus_of[name] - unmanaged[name] - held_by_managed[name]))
    free = FreeGpus([(n.name, t, n.gpus) for n, t in typed],
                    {n.name: n.gpus - unmanaged[n.name] - held_by_managed[n.name] for n, _ in typed})
    releases: list[GpuRelease] = []
    for cell, until_s, required in reserved:
        placement = free.place(cell, strict=False) if not required else \
            tuple((name, min(gpus, free.free[name])) for name, gpus in required if name in free.free)
        if placement is not None:
            free.take(placement)
            for name, gpus in placement:
                unmanaged[name] += gpus
                if until_s is not None:
                    releases.append(GpuRelease(until_s, name, gpus))
    views = tuple(NodeView(n.name, t, n.gpus, unmanaged[n.name], n.is_usable) for n, t in typed)
    jobs = tuple(sorted((m.view for m in managed), key=lambda v: (v.submit_time_s, int(v.job_id))))
    return Snapshot(now_s, views, jobs, trigger, round_s, restart_cost_s, policy_state, derived), tuple(releases)
