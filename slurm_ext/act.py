"""Acting: turning the policy's implied actions into journaled Slurm commands.

- a pending elastic job the policy starts: ``scontrol update`` to the partition of the
  chosen GPU type, untyped GPUs per node, ``NumNodes=N-N``, the plan in AdminComment,
  ``StartTime=now``, then release. Starts with identical updates are released with one
  call (the update itself goes job by job: scontrol changes the node count of one job at
  a time), each journaled on its own;
- a running elastic job the policy rescales: USR1 to the batch step, and the round goes
  on. Later rounds see the job requeue itself held (exit 86), or force ``requeuehold``
  after ``rescale_timeout_s``; then comes the same update and release (or, to suspend,
  it stays held). Each step is journaled (:meth:`Actor.advance_rescales`);
- an elastic job whose spec is invalid: the error goes to its AdminComment and the job is
  released to run exactly as submitted;
- pending jobs the policy leaves waiting: held, with why in AdminComment, within a
  per-round budget; jobs with the same text are updated (and held) with one call;
- a running job whose runner tuned another plan of its Cell: its AdminComment shows the
  plan that runs (``ManagedJob.running_comment``), from what is left of that budget; the
  job itself is left as it is.

Every action is written to the journal before it is taken and closed after, so a restart
finishes or undoes half-done work (:meth:`Actor.recover`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from estimator.contract import MAX_FORECAST_CELLS, PlanComment, format_plan_comment, shown_time
from policy.clock import Clock
from policy.forecast import JobForecast
from policy.interface import (
    CHANGE_TYPE, MOVE, RESIZE, START, SUSPEND, Action, Assignment, Decision, Snapshot,
    implied_actions,
)
from slurm_ext import store as journal
from slurm_ext.config import DaemonConfig
from slurm_ext.errors import UNREACHABLE_MARKERS, SlurmCommandError, SlurmExtError
from slurm_ext.metrics import Metrics
from slurm_ext.observe import (
    NO_ANSWER, ManagedJob, best_estimate_for, finish_on_s, is_held, kv, plan_comment, same_shape,
)
from slurm_ext.slurm_client import REQUEUE_SETTLE_S, JobUpdate, SlurmClient, SlurmJob
from slurm_ext.squeue_view import plan_label
from slurm_ext.steering import Steering, per_gpu_resources, steer, steer_to_nodes
from slurm_ext.store import Store, plan_recovery

log = logging.getLogger(__name__)

# The Slurm reservation that protects the nodes a policy holds for a waiting job.
HOLD_RESERVATION = "slurm-ext-hold"
# After a forced requeue, how long a job may take to come back held before the rescale fails;
# while Slurm shows its run ending (SIGTERM, KillWait, the epilog, the final checkpoint),
# up to REQUEUE_ENDING_WAIT_S.
REQUEUE_HOLD_WAIT_S = 45.0
REQUEUE_ENDING_WAIT_S = 600.0
# A forecast shown is rewritten when it moved by more than this (or appeared, or went).
FORECAST_SHIFT_S = 60.0


def _shift(shown_s: float | None, new_s: float | None) -> float:
    """How far a forecast moved; infinite when it appeared or went."""
    if shown_s is None and new_s is None:
        return 0.0
    if shown_s is None or new_s is None:
        return math.inf
    return abs(shown_s - new_s)


def start_update(assignment: Assignment, m: ManagedJob, steering: Steering,
                 reason: str, policy_name: str, now_s: float | None = None,
                 restart_cost_s: float = 0.0) -> JobUpdate | None:
    """The pending-job update that gives ``m`` its Cell (None: no partition has the type).

    The type is reached by partition, typed GRES or node features (``slurm_ext.steering``);
    CPUs and host memory per GPU come from the Cell's nodes and plan. The AdminComment
    carries the plan string the runner reads (``estimator.plan_string``: cell, per-stage
    dp × tp, micro-batches, rematerialization, stage boundaries, and the ZeRO stage and
    offload the estimate needed to fit), as the Cell's estimate chose them. Given the
    decision's ``now_s``, it also carries the job's forecast on that Cell, so that a job
    about to (re)start shows one before the next forecast: its start now, its progress,
    and its end after ``restart_cost_s`` and its remaining iterations at its estimate
    (``finish_on_s``, the same time at which a forecast sees its GPUs come free).
    """
    cell = assignment.cell
    how = steer(steering, m.slurm.partition, cell.gpu_type)
    if how is None:
        return None
    counts = [g for _, g in assignment.placement]
    required = None
    if counts and min(counts) == max(counts):
        # The policy's placement reaches Slurm: the job may start on these nodes only, in
        # a partition that has them.
        per_node, num_nodes, required = counts[0], len(counts), assignment.nodes
        to_nodes = steer_to_nodes(steering, how, m.slurm.partition, required)
        if to_nodes is None:
            required = None  # no partition has them all: Slurm picks the nodes
        else:
            how = to_nodes
    else:
        per_node = min(cell.gpus_per_node, cell.num_gpus)
        num_nodes = -(-cell.num_gpus // per_node)
    est = best_estimate_for(m.view, cell)
    pc = plan_comment(m.slurm.admin_comment)
    forecast = {}
    if now_s is not None:
        left = m.view.iterations_total - m.view.iterations_done
        forecast = {"expected_start_s": now_s, "progress_frac": round(m.view.progress_frac, 3),
                    "expected_end_s": finish_on_s(m.view.estimates, cell, left, now_s + restart_cost_s)}
    layers = None
    if est and est.stages:
        layers = ",".join(str(b) for b in (est.stages[0].layer_start, *(s.layer_end for s in est.stages)))
    text = format_plan_comment(PlanComment(
        requested=pc.requested, cell=cell.label(),
        plan=plan_label(est.stages) if est else None,
        micro_batches=est.micro_batches if est else None,
        remat=est.remat if est else None, layers=layers,
        zero_level=est.zero_level if est else 0, offload=bool(est and est.offload),
        samples_per_s=est.samples_per_s if est and est.feasible else None,
        why=m.why(reason or f"chosen by {policy_name}"), **forecast))
    cpus, mem_mb = per_gpu_resources(steering, cell.gpu_type, per_node,
                                     est.host_memory_gb if est else None)
    features = how.features
    if features is None and len(steering.partition_types.get(m.slurm.partition, ())) > 1:
        # A job in a mixed partition may carry the type an earlier features steering set:
        # it would pin the old type (the daemon owns such a job's features).
        features = ""
    return JobUpdate(partition=how.partition, gpus_per_node=per_node, num_nodes=num_nodes,
                     admin_comment=text, required_nodes=required, gpu_type=how.gpu_type,
                     features=features, cpus_per_gpu=cpus, mem_per_gpu_mb=mem_mb, start_now=True,
                     clear_gpus_per_job=m.slurm.gpus_per_job > 0)


@dataclass
class Acts:
    """Actions of one round, collected while acting."""

    taken: list[tuple[str, int]] = field(default_factory=list)
    plans_shown: list[int] = field(default_factory=list)  # AdminComment only, not an action
    signalled: list[int] = field(default_factory=list)  # rescales started (USR1 sent)
    rescaled: list[int] = field(default_factory=list)  # rescales finished: released on the new Cell
    annotated: list[int] = field(default_factory=list)  # waiting jobs whose why was written
    forecasts_shown: list[int] = field(default_factory=list)  # AdminComments given a new forecast


def group_by(items, key) -> list[list]:
    """Items with equal keys together, in first-seen order."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


class Actor:
    """Applies a round's actions to Slurm, journaled in the store.

    Args:
        client: the Slurm backend.
        store: the state store (journal, progress).
        clock: the clock.
        metrics: Prometheus metrics.
        out: where ``--dry-run`` prints the actions it would take.
        config: returns the current configuration (it changes on reload).
    """

    def __init__(self, client: SlurmClient, store: Store, clock: Clock, metrics: Metrics,
                 out: Callable[[str], None], config: Callable[[], DaemonConfig]):
        self.client = client
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.out = out
        self._config = config
        self.held_nodes: tuple[str, ...] | None = None  # what the hold reservation has; None: unknown

    @property
    def config(self) -> DaemonConfig:
        return self._config()

    def hold_nodes(self, nodes: tuple[str, ...], holds: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
        """Protect the nodes the policy holds (``holds``: for which jobs) with a Slurm
        reservation; none: remove it."""
        if nodes == self.held_nodes:
            return
        jobs = [job_id for job_id, _ in holds]
        if self.config.dry_run:
            self.out(f"dry-run: hold nodes={','.join(nodes) or '-'} for={','.join(jobs) or '-'}")
            return
        try:
            self.client.hold_nodes(HOLD_RESERVATION, nodes)
        except SlurmExtError as e:
            self.metrics.error("slurm")
            log.warning(kv("hold_failed", nodes=",".join(nodes) or "-", error=e))
            self.held_nodes = None
            return
        self.held_nodes = nodes
        log.info(kv("nodes_held" if nodes else "nodes_unheld", nodes=",".join(nodes) or "-",
                    jobs=",".join(jobs) or "-", reservation=HOLD_RESERVATION))

    def recover(self) -> int:
        """Finish or undo actions a previous run left open; returns the entries handled."""
        entries = self.store.open_entries()
        if not entries:
            return 0
        jobs = {j.job_id: j for j in self.client.jobs()}
        steps = plan_recovery(entries, jobs, self.store.newest_entry_ids())
        if not self.config.dry_run and any(s.step in (journal.REAPPLY, journal.RELEASE_ONLY) for s in steps):
            # A job may have been requeued just now: releasing it in that second would fail it.
            # A signal (a reload, a stop) cuts the clock's sleep short, never this wait.
            settled_s = self.clock.now_s() + REQUEUE_SETTLE_S
            self.clock.sleep_until(settled_s)
            time.sleep(max(0.0, settled_s - self.clock.now_s()))
        for step in steps:
            e = step.entry
            if self.config.dry_run:  # the service beside it may be carrying these out now
                self.out(f"dry-run: open job={e.job_id} kind={e.kind} (a daemon starting now would: "
                         f"{step.step}, {step.why})")
                continue
            log.warning(kv("recover", job_id=e.job_id, kind=e.kind, step=step.step, why=step.why))
            if step.step == journal.KEEP:
                continue  # a rescale under way: advance_rescales goes on with it
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

    def take(self, kind: str, job_id: int, update: JobUpdate | None, release: bool, acts: Acts,
             describe: str) -> bool:
        """Journal, apply, close one pending-job action; True when it was applied."""
        return bool(self.take_many(kind, [(job_id, describe)], update, release, acts))

    def take_many(self, kind: str, jobs: list[tuple[int, str]], update: JobUpdate | None,
                  release: bool, acts: Acts) -> list[int]:
        """The same pending-job action for several jobs: journal each, apply with few calls.

        Each job gets its own journal entry, written before Slurm is asked and closed
        after, so recovery sees exactly what it would see for single actions. When Slurm
        refuses the call, each job is tried on its own so that one bad job costs only
        itself. Returns the jobs the action was applied to.
        """
        if self.config.dry_run:
            for job_id, describe in jobs:
                self.out(f"dry-run: {kind} job={job_id} {describe}")
                acts.taken.append((kind, job_id))
            return [j for j, _ in jobs]
        now_s = self.clock.now_s()
        entries = {job_id: self.store.intend(job_id, kind, update, now_s) for job_id, _ in jobs}
        ids = [j for j, _ in jobs]
        errors: dict[int, SlurmExtError] = {}
        try:
            if update is not None:
                errors.update(self._each(ids, lambda js: self.client.update_pending(js, update), kind))
            if release:
                errors.update(self._each([j for j in ids if j not in errors], self.client.release, kind))
        except Exception as e:  # no answer at all (scontrol not started): nothing left open to replay
            for entry in entries.values():
                self.store.close_entry(entry, journal.FAILED, self.clock.now_s(), f"{NO_ANSWER}{e!r}")
            raise
        done = []
        for job_id, describe in jobs:
            if job_id in errors:
                err = errors[job_id]
                refused = isinstance(err, SlurmCommandError) and not any(m in err.stderr for m in UNREACHABLE_MARKERS)
                self.store.close_entry(entries[job_id], journal.FAILED, self.clock.now_s(),
                                       str(err) if refused else f"{NO_ANSWER}{err}")
                self.metrics.error("action")
                log.error(kv("action_failed", kind=kind, job_id=job_id, error=errors[job_id]))
                continue
            self.store.close_entry(entries[job_id], journal.DONE, self.clock.now_s())
            self.metrics.action(kind)
            acts.taken.append((kind, job_id))
            log.info(kv("action", kind=kind, job_id=job_id, detail=describe))
            done.append(job_id)
        return done

    @staticmethod
    def _each(job_ids: list[int], call: Callable[[int | list[int]], None], kind: str) -> dict[int, SlurmExtError]:
        """Apply ``call`` to all jobs at once; the jobs it failed for.

        When the call for all fails, each job is tried on its own so that one bad job (gone,
        no longer pending) costs only itself.
        """
        if len(job_ids) > 1:
            try:
                call(job_ids)
                return {}
            except SlurmExtError as e:
                log.warning(kv("batch_failed", kind=kind, jobs=len(job_ids), error=e))
        errors: dict[int, SlurmExtError] = {}
        for job_id in job_ids:
            try:
                call(job_id)
            except SlurmExtError as e:
                errors[job_id] = e
        return errors

    def handle_spec_error(self, job: SlurmJob, message: str, acts: Acts) -> None:
        pc = plan_comment(job.admin_comment)
        wanted = format_plan_comment(PlanComment(requested=pc.requested, error=message))
        held = is_held(job)  # requeued held (SPECIAL_EXIT) too: a suspended job must not stay held
        if job.admin_comment == wanted and not held:
            return
        update = JobUpdate(admin_comment=wanted, start_now=False) if job.admin_comment != wanted else None
        if held:
            self.take(journal.RELEASE, job.job_id, update, True, acts,
                       f"spec error, released as submitted: {message}")
        elif update is not None:
            self.take(journal.ANNOTATE, job.job_id, update, False, acts, f"spec error: {message}")

    def act(self, snapshot: Snapshot, decision: Decision, views_by_id: dict[str, ManagedJob],
            steering_of: Callable[[], Steering], policy_name: str, acts: Acts,
            forecasts: dict[str, JobForecast] | None = None, kept_back: list[SlurmJob] = ()) -> None:
        """Apply the decision's implied actions: rescales first, then starts, then holds;
        then, within what is left of the AdminComment budget, the running plans tuned in
        allocations, the times of released jobs Slurm keeps ``kept_back`` for a condition
        of their own, and the ``forecasts`` (None: none this round). ``steering_of`` is
        asked only when a job is given a Cell."""
        steering: Steering | None = None
        rescales: list[tuple[Action, JobUpdate | None]] = []
        starts: list[tuple[SlurmJob, JobUpdate]] = []
        now_s = self.clock.now_s()  # the decision's time, one for all: identical starts stay identical
        for action in implied_actions(snapshot, decision):
            view = views_by_id[action.job_id]
            job: SlurmJob = view.slurm
            if action.kind == MOVE or (action.kind == RESIZE and same_shape(action.before.cell, action.after.cell)):
                continue  # Slurm picks the nodes; a new layout alone is not worth a restart
            update = None
            if action.after is not None:
                steering = steering or steering_of()
                update = start_update(action.after, view, steering, action.reason, policy_name,
                                      now_s, self.config.restart_cost_s)
                if update is None:
                    log.warning(kv("no_partition", job_id=job.job_id, gpu_type=action.after.cell.gpu_type))
                    continue
            if action.kind == START:
                starts.append((job, update))
            elif action.kind in (RESIZE, CHANGE_TYPE, SUSPEND):
                rescales.append((action, update))
        if rescales:  # first, so that the GPUs they give back are free for the starts
            self.start_rescales(rescales, views_by_id, acts)
        # Jobs of the same spec chosen for the same Cell get the same update: one call.
        for group in group_by(starts, lambda ju: (ju[1], is_held(ju[0]))):
            update, held = group[0][1], is_held(group[0][0])
            self.take_many(journal.START, [(job.job_id, update.admin_comment) for job, _ in group],
                           update, held, acts)
        budget = self._annotate_waiting(snapshot, decision, views_by_id, acts)
        # A job rescaled this round has its new Cell's AdminComment: the old plan must not
        # overwrite it.
        rescaled = {int(action.job_id) for action, _ in rescales}
        budget = self._show_running_plans([m for m in views_by_id.values() if m.running_comment
                                           and m.slurm.job_id not in rescaled], budget, acts)
        budget = self._show_kept_back(kept_back, now_s, budget, acts)
        if forecasts:
            # A job whose AdminComment this round rewrote is shown its forecast next time.
            touched = {j for _, j in acts.taken} | set(acts.plans_shown) | set(acts.annotated)
            self._show_forecasts([m for m in views_by_id.values() if m.slurm.job_id not in touched],
                                 forecasts, budget, acts)

    def _show_running_plans(self, jobs: list[ManagedJob], budget: int, acts: Acts) -> int:
        """Write into running jobs' AdminComment the plan their runner tuned and runs.

        Only the text changes: no signal, requeue or release, so it is not journaled (the
        next round derives the same text again if this one is lost). Returns what is left
        of the budget.
        """
        jobs = sorted(jobs, key=lambda m: m.slurm.job_id)[:max(0, budget)]
        for m in jobs:
            if self._show(m.slurm.job_id, m.running_comment, "running plan", "show_plan_failed", "running_plan_shown"):
                acts.plans_shown.append(m.slurm.job_id)
        return budget - len(jobs)

    def _show_kept_back(self, jobs: list[SlurmJob], now_s: float, budget: int, acts: Acts) -> int:
        """Released jobs Slurm keeps back for a dependency, a begin time or a limit: the
        start shown at their release has passed. Show Slurm's expected start when it has
        one (a begin time), else none, and an end that far after it (they have not run
        since). Returns what is left of the budget."""
        todo = []
        for job in jobs:
            pc = plan_comment(job.admin_comment)
            start = float(job.start_time_s) if job.start_time_s > now_s and shown_time(job.start_time_s) else None
            end = None
            if start is not None and pc.expected_start_s is not None and pc.expected_end_s is not None:
                end = start + max(0.0, pc.expected_end_s - pc.expected_start_s)
                end = end if shown_time(end) else None
            if max(_shift(pc.expected_start_s, start), _shift(pc.expected_end_s, end)) > FORECAST_SHIFT_S:
                todo.append((job.job_id, format_plan_comment(replace(pc, expected_start_s=start, expected_end_s=end))))
        shown = todo[:max(0, budget)]
        self._show_times(shown, "start kept back by slurm", acts)
        return budget - len(shown)

    def _show_times(self, todo: list[tuple[int, str]], what: str, acts: Acts) -> None:
        """Write each (job, AdminComment with its times) of ``todo``."""
        for job_id, text in todo:
            if self._show(job_id, text, what, "show_forecast_failed", "forecast_shown"):
                acts.forecasts_shown.append(job_id)

    def _show(self, job_id: int, text: str, what: str, failed_event: str, shown_event: str) -> bool:
        """Write ``text`` as the job's AdminComment and nothing else (the job may run:
        StartTime must not change); True when written."""
        if self.config.dry_run:
            self.out(f"dry-run: show {what} job={job_id} {text}")
            return False
        try:
            self.client.update_pending(job_id, JobUpdate(admin_comment=text, start_now=False))
        except SlurmExtError as e:
            log.warning(kv(failed_event, job_id=job_id, error=e))
            return False
        log.info(kv(shown_event, job_id=job_id, admin_comment=text))
        return True

    def _show_forecasts(self, jobs: list[ManagedJob], forecasts: dict[str, JobForecast], budget: int,
                        acts: Acts) -> None:
        """Write each job's forecast (``start=``, ``end=``) and progress into its
        AdminComment when they moved (by more than ``FORECAST_SHIFT_S``, or a percent of
        progress), within the budget, those that moved most first. A waiting job's start
        is the forecast's next start from waiting (a job that ran when the forecast began
        and waits now: its restart); a running one's is Slurm's own StartTime."""
        todo = []
        for m in jobs:
            pc = plan_comment(m.slurm.admin_comment)
            f = forecasts.get(m.view.job_id)
            if pc.error is not None or f is None:
                continue
            # A time no text can show (past year 9999) is shown as none, and stays so.
            start = f.next_start_s if m.view.assignment is None and shown_time(f.next_start_s) else None
            end = f.end_s if shown_time(f.end_s) else None
            progress = round(m.view.progress_frac, 3)
            shift = max(_shift(pc.expected_start_s, start), _shift(pc.expected_end_s, end))
            if shift <= FORECAST_SHIFT_S and pc.progress_frac is not None and abs(pc.progress_frac - progress) < 0.01 \
                    and pc.expected_cells == f.cells[:MAX_FORECAST_CELLS]:
                continue
            new = replace(pc, expected_start_s=start, expected_end_s=end, progress_frac=progress,
                          expected_cells=f.cells)
            todo.append((-shift, m.slurm.job_id, format_plan_comment(new)))
        self._show_times([(job_id, text) for _, job_id, text in sorted(todo)[:max(0, budget)]], "forecast", acts)

    def _annotate_waiting(self, snapshot, decision: Decision, views_by_id: dict, acts: Acts) -> int:
        """Hold pending elastic jobs the policy leaves waiting and say why, within a budget.

        Most waiting jobs share their text (``why=waiting for GPUs``): jobs with the same
        text are updated with one call, and those not yet held are held with one more.
        Returns what is left of the round's budget of AdminComment-only updates.
        """
        budget = self.config.max_annotations_per_round
        wanted = decision.as_dict()
        todo: list[tuple[int, str, bool]] = []
        for jv in snapshot.jobs:
            d = wanted.get(jv.job_id)
            if jv.assignment is not None or (d is not None and d.assignment is not None):
                continue
            job: SlurmJob = views_by_id[jv.job_id].slurm
            pc = plan_comment(job.admin_comment)
            why = views_by_id[jv.job_id].why(d.reason if d and d.reason else "waiting for GPUs")
            # The forecast shown stays (it is rewritten when it moves).
            text = format_plan_comment(PlanComment(requested=pc.requested, why=why, progress_frac=pc.progress_frac,
                                                   expected_start_s=pc.expected_start_s,
                                                   expected_end_s=pc.expected_end_s,
                                                   expected_cells=pc.expected_cells))
            held = is_held(job)
            if held and text == job.admin_comment:
                continue
            if budget <= 0:
                break
            budget -= 1
            if self.config.dry_run:
                self.out(f"dry-run: annotate job={job.job_id} {text}")
                continue
            todo.append((job.job_id, text, held))
            acts.annotated.append(job.job_id)
        for group in group_by(todo, lambda t: t[1]):
            update = JobUpdate(admin_comment=group[0][1], start_now=False)
            self._annotate([j for j, _, _ in group], update, [j for j, _, held in group if not held])
        return budget

    def _annotate(self, job_ids: list[int], update: JobUpdate, to_hold: list[int]) -> None:
        try:
            self.client.update_pending(job_ids, update)
            if to_hold:
                self.client.hold(to_hold)
            return
        except SlurmExtError as e:
            if len(job_ids) == 1:
                log.warning(kv("annotate_failed", job_id=job_ids[0], error=e))
                return
            log.warning(kv("batch_failed", kind="annotate", jobs=len(job_ids), error=e))
        for job_id in job_ids:  # one by one, so that one bad job costs only itself
            try:
                self.client.update_pending(job_id, update)
                if job_id in to_hold:
                    self.client.hold(job_id)
            except SlurmExtError as e:
                log.warning(kv("annotate_failed", job_id=job_id, error=e))

    def start_rescales(self, items: list[tuple[Action, JobUpdate | None]], views_by_id: dict, acts: Acts) -> None:
        """Start rescales: journal each, count its run's progress, and send USR1 to all with
        one call. Nothing waits for the checkpoints: the next rounds see each job requeued
        held, then update and release it (:meth:`advance_rescales`)."""
        if self.config.dry_run:
            for action, update in items:
                self.out(f"dry-run: {action.kind} job={action.job_id} signal USR1, requeue held, "
                         f"then {update.admin_comment if update else 'stay held'}")
                acts.taken.append((action.kind, int(action.job_id)))
            return
        entries: dict[int, tuple[int, Action]] = {}
        for action, update in items:
            job_id = int(action.job_id)
            now_s = self.clock.now_s()
            view = views_by_id[action.job_id]
            if update is None:  # a suspension: the job stays held, and its AdminComment says why
                pc = plan_comment(view.slurm.admin_comment)
                update = JobUpdate(admin_comment=format_plan_comment(
                    PlanComment(requested=pc.requested, why=action.reason or "suspended")), start_now=False)
                kind = journal.SUSPEND
            else:
                kind = journal.RESCALE
            with self.store.transaction():  # the run's iterations are credited with its entry, or neither is
                entry = self.store.intend(job_id, kind, update, now_s)
                self.store.add_progress(job_id, view.run_iterations(now_s), now_s, entry)
            entries[job_id] = (entry, action)
        self._signal(sorted(entries))
        now_s = self.clock.now_s()
        for job_id, (entry, action) in sorted(entries.items()):
            self.store.mark_entry(entry, journal.SIGNALLED, now_s)
            acts.taken.append((action.kind, job_id))
            acts.signalled.append(job_id)
            log.info(kv("rescale_signalled", job_id=job_id, kind=action.kind, why=action.reason))

    def advance_rescales(self, jobs: dict[int, SlurmJob], acts: Acts) -> dict[int, JobUpdate]:
        """Move every open rescale (and suspension) one step on, from the jobs as this
        round read them; never waits. Each step is journaled, so a restarted daemon goes on
        where this one stopped:

        - the job ended: the entry is abandoned;
        - it came back requeued held: first noted, then, from ``REQUEUE_SETTLE_S`` later
          (a run released in the second its predecessor ended fails on its nodes), updated
          to its new Cell and released (a suspension: its AdminComment says why, it stays
          held);
        - it still runs ``rescale_timeout_s`` after the signal: its requeue is forced, and
          ``REQUEUE_HOLD_WAIT_S`` after that without coming back, the rescale failed;
        - it was journaled but never signalled (the daemon stopped in between): USR1 now.

        Returns, per job whose rescale is under way or was released just now, the update
        it has or will have: the round leaves these jobs to their rescale, and counts the
        GPUs of their new Cell as taken.
        """
        if self.config.dry_run:  # read only: what the service's rescales under way will give their jobs
            return {e.job_id: e.update for e in self.store.open_entries()
                    if e.kind in (journal.RESCALE, journal.SUSPEND) and e.job_id in jobs and jobs[e.job_id].is_active}
        out: dict[int, JobUpdate] = {}
        for e in self.store.open_entries():
            if e.kind not in (journal.RESCALE, journal.SUSPEND):
                continue
            job, now_s = jobs.get(e.job_id), self.clock.now_s()
            if job is None or not job.is_active:
                self.store.close_entry(e.entry_id, journal.ABANDONED, now_s, "job ended")
                continue
            out[e.job_id] = e.update
            if is_held(job) and not job.is_running:
                if e.note != journal.CAME_BACK:
                    self.store.mark_entry(e.entry_id, journal.CAME_BACK, now_s)
                elif now_s >= e.updated_s + REQUEUE_SETTLE_S:
                    self._finish_rescale(e, acts)
                continue
            if e.note == journal.CAME_BACK:  # requeued held, then released by someone else
                self.store.close_entry(e.entry_id, journal.ABANDONED, now_s, "released by another hand")
                del out[e.job_id]
            elif not e.note:  # journaled, but the daemon stopped before it sent USR1
                self._signal([e.job_id])
                self.store.mark_entry(e.entry_id, journal.SIGNALLED, now_s)
            elif e.note == journal.FORCED:
                ending = job.state in journal.ENDING_STATES or "COMPLETING" in job.state_flags
                if now_s >= e.updated_s + (REQUEUE_ENDING_WAIT_S if ending else REQUEUE_HOLD_WAIT_S):
                    self.store.close_entry(e.entry_id, journal.FAILED, now_s, "never came back held")
                    if job.is_running:  # the same run goes on: what the rescale credited is its own
                        self.store.take_back_progress(e.entry_id, now_s)
                    log.error(kv("rescale_failed", job_id=e.job_id, error="never came back held"))
                    del out[e.job_id]
            elif now_s >= e.updated_s + self.config.rescale_timeout_s:
                log.warning(kv("rescale_forced", job_id=e.job_id, why="no requeue after USR1"))
                try:
                    self.client.requeue_hold(e.job_id)
                except SlurmExtError as err:
                    log.error(kv("requeue_hold_failed", job_id=e.job_id, error=err))
                self.store.mark_entry(e.entry_id, journal.FORCED, now_s)
        return out

    def _finish_rescale(self, e, acts: Acts) -> None:
        """A rescaled job came back held: its new Cell, and release (a suspended one: why,
        and it stays held)."""
        try:
            self.client.update_pending(e.job_id, e.update)
            if e.kind == journal.RESCALE:
                self.client.release(e.job_id)
        except SlurmExtError as err:
            self.store.close_entry(e.entry_id, journal.FAILED, self.clock.now_s(), str(err))
            self.metrics.error("action")
            log.error(kv("rescale_failed", job_id=e.job_id, error=err))
            return
        self.store.close_entry(e.entry_id, journal.DONE, self.clock.now_s())
        self.metrics.action(e.kind)
        acts.rescaled.append(e.job_id)
        log.info(kv("action", kind=e.kind, job_id=e.job_id, detail=e.update.admin_comment))

    def _signal(self, job_ids: list[int]) -> None:
        """USR1 to the batch scripts, with one call for all.

        When Slurm refuses some of them it still signals the others: signalling those
        again could interrupt their checkpoint, so a job that missed the signal is left to
        the forced requeue after the timeout.
        """
        try:
            self.client.signal_batch(job_ids, "USR1")
        except SlurmExtError as e:
            log.warning(kv("signal_failed", job_ids=",".join(map(str, job_ids)), error=e))
