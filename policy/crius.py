"""Crius's scheduling policy (Algorithm 1 of the Crius paper), and its deadline-aware mode.

Each job is offered Cells (GPU type × GPU count × stage count); the snapshot carries their
estimates (counts {N/2, N, 2N} × every GPU type × stage counts, from the estimator). One
``decide`` call runs the paper's event handlers over the snapshot:

1. **Arrival / pending restart** (Alg. 1, ``OnArrival``): pending jobs in submission order
   take the fastest feasible Cell that fits on free GPUs.
2. **Opportunistic execution** (§ "Opportunistic execution"): a pending job that does not
   fit leaves the free GPUs to later jobs, which run *opportunistically*; when it could start
   on the GPUs those later jobs hold, they yield (are suspended) and it starts.
3. **Resource scaling search** (Alg. 1, ``ScaleDownOrChangeType``): otherwise a bounded
   breadth-first search (depth ``search_depth``, default 3) over plans that halve one running
   job's GPU count (one branch per GPU type, the largest jobs first) or move one job to
   another GPU type, keeping the feasible plan of largest gain — the total change of
   normalized throughput, the arrival's own normalized throughput included. A plan is applied
   only when its gain is positive.
4. **Departure** (Alg. 1, ``OnDeparture``): after pending jobs were restarted, running jobs
   scale up (to the next larger count of their Cells) in order of marginal normalized gain per
   GPU, while that gain outweighs the restart it costs.

A job's normalized throughput is its samples/s over that of the Cell it asked for (the
requested type and count; the best Cell of the requested count when the type was free).

``deadline_aware=True`` (``crius-ddl``) admits a job only on Cells that finish it by its
deadline (restart cost included), never scales a running job onto a Cell that would miss
its deadline (unless every Cell would: a late job runs best effort, and a faster Cell only
makes it less late), and drops — reports and never starts — a job no Cell can finish in
time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from estimator.cells import CellEstimate
from policy._solver import FitIndex, RateTable, checked_decision, fits, requested_count
from policy.interface import (DROPPED_PREFIX, TRIGGER_ARRIVAL, TRIGGER_COMPLETION, Assignment, Decision, JobView,
                              Snapshot)
from policy.placement import FreeGpus

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class CriusState:
    """What Crius carries from one decision to the next.

    Attributes:
        searched: pending jobs whose arrival search already ran (a search runs once per
            arrival; departures re-run it for the head of the queue only).
        dropped: jobs crius-ddl dropped because no Cell meets their deadline.
    """

    searched: frozenset[str] = frozenset()
    dropped: frozenset[str] = frozenset()


@dataclass
class _Plan:
    """One node of the scaling search: a trial world and the gain it has so far."""

    free: FreeGpus
    assign: dict[str, Assignment]
    gain: float
    steps: tuple[str, ...] = ()
    changed: set[str] = field(default_factory=set)


class CriusPolicy:
    """Crius: Cells with resource scaling, a bounded search, and opportunistic execution.

    Args:
        search_depth: levels of the scale-down / type-change search (the paper's 3).
        deadline_aware: the crius-ddl mode.
        restart_searches: how many pending jobs at the head of the queue re-run the search
            when GPUs are released; keeps a decision fast on long queues.
        max_plans: plans one decision may expand in all searches together.
        reclaim_heads: pending jobs at the head of the queue that may make later
            (opportunistic) jobs yield, per decision.
    """

    name = "crius"
    # Crius tunes a job's plan inside its Cell with the Cell-guided pruned search.
    plan_tuning = "pruned"
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = "none: its Cell-guided plan search is the runtime's own, charged to every policy"

    def __init__(self, search_depth: int = 3, deadline_aware: bool = False,
                 restart_searches: int = 2, max_plans: int = 1500, reclaim_heads: int = 4):
        self.reclaim_heads = reclaim_heads
        self.search_depth = search_depth
        self.deadline_aware = deadline_aware
        self.restart_searches = restart_searches
        self.max_plans = max_plans

    def decide(self, snapshot: Snapshot) -> Decision:
        """One pass of Crius's event handlers over the snapshot (see the module docstring)."""
        return _Round(self, snapshot).run()


class CriusDdlPolicy(CriusPolicy):
    """crius-ddl: Crius admitting only what meets its deadline, dropping what cannot."""

    name = "crius-ddl"

    def __init__(self, search_depth: int = 3, restart_searches: int = 2, max_plans: int = 1500,
                 reclaim_heads: int = 4):
        super().__init__(search_depth, True, restart_searches, max_plans, reclaim_heads)


class _Assignments(dict):
    """Job → Assignment or None, knowing which jobs hold one (few, among thousands queued)."""

    def __init__(self, items):
        super().__init__(items)
        self.holding = {i for i, a in self.items() if a is not None}

    def __setitem__(self, job_id: str, a: Assignment | None) -> None:
        super().__setitem__(job_id, a)
        if a is None:
            self.holding.discard(job_id)
        else:
            self.holding.add(job_id)


class _Round:
    """The working state of one decision; discarded afterwards."""

    def __init__(self, policy: CriusPolicy, snapshot: Snapshot):
        self.p = policy
        self.snap = snapshot
        state = snapshot.policy_state if isinstance(snapshot.policy_state, CriusState) else CriusState()
        self.searched = set(state.searched)
        self.dropped = set(state.dropped)
        self.jobs = {j.job_id: j for j in snapshot.jobs}
        self.order = [j.job_id for j in snapshot.jobs]
        self.rank = {i: k for k, i in enumerate(self.order)}
        self.cache = snapshot.derived_cache()
        self.tables = {j.job_id: RateTable.of(j, False, self.cache) for j in snapshot.jobs}
        # Jobs of one spec share their estimates object (the daemon's and the simulator's
        # caches hand out one per spec): their reference rate and candidates are computed once.
        self._by_spec: dict[tuple, tuple] = {}
        self._late: dict[str, bool] = {}  # jobs no Cell of which meets their deadline any more
        self.ref = {j.job_id: self._shared(j, "ref", self._reference_rate) for j in snapshot.jobs}
        self.free = FreeGpus.from_snapshot(snapshot)
        self.index = FitIndex(self.free)
        self._no_fit: dict[tuple[int, int], tuple] = {}
        self.assign = _Assignments((j.job_id, j.assignment) for j in snapshot.jobs)
        self.reasons: dict[str, str] = {}
        self.plans_left = policy.max_plans
        self.types = tuple(sorted(self.free.by_type))

    # ---- throughput bookkeeping -------------------------------------------------------

    def _reference_rate(self, job: JobView) -> float:
        t = self.tables[job.job_id]  # tables are memoized: same table and spec, same answer
        return self.cache.get("crius_reference", (t,), (job.spec,), lambda: self._reference_rate_of(job, t))

    @staticmethod
    def _reference_rate_of(job: JobView, t: RateTable) -> float:
        n = requested_count(job, t)
        if job.spec.gpu_type and n and t.rate(job.spec.gpu_type, n) > 0:
            return t.rate(job.spec.gpu_type, n)
        at_n = [t.rate(g, c) for (g, c) in t.options if c == n]
        best = t.best()
        return max(at_n, default=0.0) or (best.samples_per_s if best else 1.0)

    def _norm(self, job_id: str, a: Assignment | None) -> float:
        if a is None:
            return 0.0
        return self.tables[job_id].rate_of_cell(a.cell) / self.ref[job_id]

    def _meets_deadline(self, job: JobView, e: CellEstimate, restart: bool = True) -> bool:
        if not self.p.deadline_aware or job.deadline_s is None:
            return True
        cost = self.snap.restart_cost_s if restart else 0.0
        return self.snap.now_s + cost + job.remaining_iterations * e.iteration_time_s <= job.deadline_s

    def _deadline_allows(self, job: JobView, e: CellEstimate) -> bool:
        """Whether crius-ddl may move a running job to ``e``: it meets the job's deadline,
        or no Cell of the job does any more (a late job runs best effort: a faster Cell
        only makes it less late)."""
        if self._meets_deadline(job, e):
            return True
        late = self._late.get(job.job_id)
        if late is None:
            fastest = self.tables[job.job_id].fastest
            here = next((o for o in fastest if job.assignment is not None and o.cell == job.assignment.cell), None)
            late = self._late[job.job_id] = not any(self._meets_deadline(job, o) for o in fastest) and not (
                here is not None and self._meets_deadline(job, here, restart=False))  # staying needs no restart
        return late

    def _shared(self, job: JobView, what: str, compute):
        """``compute(job)``, once per (estimates object, spec): it depends on nothing else."""
        key = (what, id(job.estimates), job.spec)
        hit = self._by_spec.get(key)
        if hit is not None and hit[0] is job.estimates:
            return hit[1]
        value = compute(job)
        self._by_spec[key] = (job.estimates, value)  # holding the estimates keeps the id valid
        return value

    def _candidates(self, job: JobView) -> tuple[CellEstimate, ...]:
        """The job's feasible Cells (deadline-meeting in crius-ddl), fastest first. A first
        start is not charged a restart (its launch is not a checkpoint and resume); a job
        that has run is never dropped: with no Cell meeting its deadline, it runs best
        effort on any."""
        every = self.tables[job.job_id].fastest
        if not self.p.deadline_aware or job.deadline_s is None:
            return every
        ran = job.has_run
        meets = tuple(e for e in every if self._meets_deadline(job, e, restart=ran))
        return meets if meets or not ran else every

    # ---- the round ----------------------------------------------------------------------

    def run(self) -> Decision:
        arrivals_only = self.snap.trigger == TRIGGER_ARRIVAL
        departure = self.snap.trigger == TRIGGER_COMPLETION
        restart_budget = self.p.restart_searches
        # Only the head of the queue reclaims GPUs from opportunistic jobs: they are the
        # blockers the paper's opportunistic execution lets later jobs run ahead of.
        reclaim_budget = self.p.reclaim_heads
        for job_id in self.order:
            job = self.jobs[job_id]
            if job_id in self.dropped and self.assign[job_id] is None:
                self.reasons[job_id] = f"{DROPPED_PREFIX}: no Cell finishes it by its deadline"  # every round
                continue
            if self.assign[job_id] is not None:
                continue
            cands = self._candidates(job)
            if not cands:
                if self.p.deadline_aware and job.deadline_s is not None and self.tables[job_id].options:
                    self.dropped.add(job_id)
                    self.reasons[job_id] = f"{DROPPED_PREFIX}: no Cell finishes it by its deadline"
                else:
                    self.reasons[job_id] = "waiting: no feasible Cell"
                continue
            if self._start_on_free(job, cands):
                continue
            if reclaim_budget > 0:
                reclaim_budget -= 1
                if self._start_by_reclaiming(job, cands):
                    continue
            new = job_id not in self.searched
            if new or (departure and restart_budget > 0):
                restart_budget -= 0 if new else 1
                if self._search_and_apply(job, cands):
                    continue
                if self.plans_left > 0:  # searched in full; one the shared budget cut is searched again
                    self.searched.add(job_id)
            best = cands[0].cell
            why = f"waiting for {best.num_gpus} {best.gpu_type} (best Cell {best.label()})"
            earlier = self.reasons.get(job_id, "")
            self.reasons[job_id] = f"{earlier}; {why}" if earlier.startswith("yielded") else why
        if not arrivals_only:
            # GPU types a waiting job could start on are reserved for it: scaling a running
            # job onto them would let earlier jobs grow forever ahead of a large blocked one.
            waiting: set[str] = set()
            seen: set[int] = set()
            for i in self.order:
                if self.assign[i] is None and i not in self.dropped and len(waiting) < len(self.types):
                    cands = self._candidates(self.jobs[i])
                    if id(cands) not in seen:  # shared by every job of one spec
                        seen.add(id(cands))
                        waiting.update(e.cell.gpu_type for e in cands)
            self._scale_up(reserved=waiting)
        live = set(self.order)
        state = CriusState(frozenset(self.searched & live), frozenset(self.dropped & live))
        return checked_decision(self.snap, self.assign, self.reasons, state)

    def _start(self, job_id: str, e: CellEstimate, placement, reason: str) -> None:
        self.free.take(placement)
        self.index.invalidate()
        self.assign[job_id] = Assignment(e.cell, placement)
        self.reasons[job_id] = reason

    def _start_on_free(self, job: JobView, cands) -> bool:
        """Alg. 1 OnArrival: the fastest feasible Cell that fits on free GPUs."""
        # Jobs of one spec share their candidates: once none fits, none fits for the next
        # job of that spec either, until the free GPUs change (a long queue is mostly
        # repeats of a few hundred specs).
        key = (id(cands), self.index.version)
        if key in self._no_fit:
            return False
        for e in cands:
            if self.index.fits(e.cell):
                p = self.free.place(e.cell)
                if p is not None:
                    break
        else:
            self._no_fit[key] = cands  # holding cands keeps its id valid
            return False
        best = " (best)" if e is cands[0] else f" (best {cands[0].cell.label()} does not fit)"
        self._start(job.job_id, e, p, f"started on {e.cell.label()}{best}")
        return True

    def _start_by_reclaiming(self, job: JobView, cands) -> bool:
        """Opportunistic execution: later jobs running on GPUs this job waits for yield."""
        rank = self.rank[job.job_id]  # the few running jobs, not all queued ones, in order
        # A job admitted for its deadline does not yield: suspended, it could miss it.
        later = sorted((i for i in self.assign.holding if self.rank[i] > rank and i not in self.dropped
                        and not (self.p.deadline_aware and self.jobs[i].deadline_s is not None)),
                       key=self.rank.__getitem__)
        if not later:
            return False
        for e in cands:
            on_type = [i for i in reversed(later) if self.assign[i].cell.gpu_type == e.cell.gpu_type]
            trial = self.free.copy()
            yielded = []
            for i in on_type:
                trial.release(self.assign[i].placement)
                yielded.append(i)
                if fits(trial, e.cell):
                    break
            p = trial.place(e.cell) if yielded else None
            if p is None:
                continue
            # Keep only the yields the placement needs: later jobs off its nodes keep running.
            used = {n for n, _ in p}
            needed = [i for i in yielded if used & {n for n, _ in self.assign[i].placement}]
            self.index.invalidate()
            for i in needed:
                self.free.release(self.assign[i].placement)
                self.assign[i] = None
                self.reasons[i] = f"yielded to earlier job {job.job_id} (opportunistic run ends)"
            p = self.free.place(e.cell)
            if p is None:  # the pruned yields did not leave the layout free; yield them all
                for i in yielded:
                    if self.assign[i] is not None:
                        self.free.release(self.assign[i].placement)
                        self.assign[i] = None
                        self.reasons[i] = f"yielded to earlier job {job.job_id} (opportunistic run ends)"
                p = self.free.place(e.cell)
            if p is None:
                continue
            self._start(job.job_id, e, p, f"started on {e.cell.label()}; later opportunistic jobs yielded")
            return True
        return False

    # ---- Alg. 1 ScaleDownOrChangeType: bounded breadth-first search ----------------------

    def _search_and_apply(self, job: JobView, cands) -> bool:
        root = _Plan(self.free.copy(), {i: a for i, a in self.assign.items() if a is not None}, 0.0)
        frontier = [root]
        target_types = frozenset(c.cell.gpu_type for c in cands)
        best: tuple[float, _Plan, CellEstimate] | None = None
        for _ in range(self.p.search_depth):
            nxt = []
            for plan in frontier:
                for child in self._children(plan, target_types):
                    self.plans_left -= 1
                    e = next((c for c in cands if fits(child.free, c.cell)), None)
                    if e is not None:
                        total = child.gain + e.samples_per_s / self.ref[job.job_id]
                        if best is None or total > best[0] + 1e-12:
                            best = (total, child, e)
                    else:
                        nxt.append(child)
                    if self.plans_left <= 0:
                        break
                if self.plans_left <= 0:
                    break
            frontier = nxt
            if not frontier or self.plans_left <= 0:
                break
        if best is None or best[0] <= 0:
            return False
        total, plan, e = best
        placement = plan.free.place(e.cell)
        if placement is None:
            return False
        for i in plan.changed:
            self.assign[i] = plan.assign[i]
            self.reasons[i] = f"rescaled to {plan.assign[i].cell.label()} for job {job.job_id}"
        self.free = plan.free
        self.index.free = self.free
        self.index.invalidate()
        self._start(job.job_id, e, placement,
                    f"started on {e.cell.label()} after {', '.join(plan.steps)} (gain {total:+.2f})")
        return True

    def _children(self, plan: _Plan, target_types: frozenset[str]) -> list[_Plan]:
        by_type: dict[str, list[tuple[str, Assignment]]] = {}
        for i, a in plan.assign.items():
            by_type.setdefault(a.cell.gpu_type, []).append((i, a))
        free_by_type = {t: plan.free.free_of_type(t) for t in self.types}
        out = []
        for gtype in self.types:
            c = self._shrink_one(plan, gtype, by_type.get(gtype, []))
            if c is not None:
                out.append(c)
        c = self._change_type_one(plan, free_by_type, target_types)
        if c is not None:
            out.append(c)
        return out

    def _shrink_one(self, plan: _Plan, gtype: str, on_type: list) -> _Plan | None:
        """Halve one job of ``gtype``: among the largest ones, the one that loses least."""
        if not on_type:
            return None
        largest = max(a.cell.num_gpus for _, a in on_type)
        best = None
        for i, a in on_type:
            if a.cell.num_gpus < max(2, largest // 2):
                continue
            smaller = [n for n in self.tables[i].counts(gtype) if n < a.cell.num_gpus]
            if not smaller:
                continue
            opts = [o for o in self.tables[i].options[(gtype, max(smaller))]
                    if self._deadline_allows(self.jobs[i], o)]
            if not opts:
                continue
            delta = (opts[0].samples_per_s - self.tables[i].rate_of_cell(a.cell)) / self.ref[i]
            key = (delta, -self.rank[i])
            if best is None or key > best[0]:
                best = (key, i, a, opts)
        if best is None:
            return None
        (delta, _), i, a, opts = best
        free = plan.free.copy()
        free.release(a.placement)
        for o in opts:
            p = free.place(o.cell)
            if p is not None:
                free.take(p)
                return self._child(plan, free, i, Assignment(o.cell, p), delta,
                                   f"{i} {a.cell.num_gpus}→{o.cell.num_gpus} {gtype}")
        return None

    def _change_type_one(self, plan: _Plan, free_by_type: dict[str, int],
                         target_types: frozenset[str]) -> _Plan | None:
        """Move one job off a type the arrival can use, same count: the move of largest gain."""
        best = None
        for i, a in plan.assign.items():
            if a.cell.gpu_type not in target_types:
                continue
            t = self.tables[i]
            n = a.cell.num_gpus
            cur = None
            for gtype in self.types:
                if gtype == a.cell.gpu_type or free_by_type[gtype] < n:
                    continue
                opts = t.options.get((gtype, n))
                if not opts:
                    continue
                cur = t.rate_of_cell(a.cell) if cur is None else cur
                delta = (opts[0].samples_per_s - cur) / self.ref[i]
                if best is not None and (delta, -self.rank[i]) <= best[0]:
                    continue
                fitting = next((o for o in opts if self._deadline_allows(self.jobs[i], o)
                                and fits(plan.free, o.cell)), None)
                if fitting is not None:
                    d = (fitting.samples_per_s - cur) / self.ref[i]
                    best = ((d, -self.rank[i]), i, a, fitting, d)
        if best is None:
            return None
        _, i, a, o, delta = best
        free = plan.free.copy()
        p = free.place(o.cell)
        if p is None:
            return None
        free.release(a.placement)
        free.take(p)
        return self._child(plan, free, i, Assignment(o.cell, p), delta,
                           f"{i} {a.cell.gpu_type}→{o.cell.gpu_type}")

    @staticmethod
    def _child(plan: _Plan, free: FreeGpus, job_id: str, a: Assignment, delta: float, step: str) -> _Plan:
        assign = dict(plan.assign)
        assign[job_id] = a
        return _Plan(free, assign, plan.gain + delta, plan.steps + (step,), plan.changed | {job_id})

    # ---- Alg. 1 OnDeparture: scale up running jobs -------------------------------------

    def _scale_up(self, reserved: set[str]) -> None:
        """Give free GPUs to running jobs, largest normalized gain per added GPU first.

        A job grows to the next larger count of its type, or returns to its fastest Cell
        when a search moved it to another type to admit someone (else it would stay on the
        slower type for the rest of its run).

        Args:
            reserved: GPU types that waiting jobs could use; no job grows onto them.
        """
        offers = []
        for i, a in self.assign.items():
            if a is None:
                continue
            t = self.tables[i]
            job = self.jobs[i]
            cur = t.rate_of_cell(a.cell)
            if cur <= 0:
                continue
            shapes = []
            bigger = [n for n in t.counts(a.cell.gpu_type) if n > a.cell.num_gpus]
            if bigger:
                shapes.append((a.cell.gpu_type, min(bigger)))
            if t.fastest and t.fastest[0].cell.gpu_type != a.cell.gpu_type:
                shapes.append((t.fastest[0].cell.gpu_type, t.fastest[0].cell.num_gpus))
            for gtype, n in shapes:
                if gtype in reserved:
                    continue
                opts = [o for o in t.options[(gtype, n)] if self._deadline_allows(job, o)]
                if not opts or opts[0].samples_per_s <= cur:
                    continue
                # Worth a restart only when the faster Cell wins back the restart's cost.
                rem = job.remaining_iterations * job.spec.global_batch
                if rem / cur - rem / opts[0].samples_per_s <= self.snap.restart_cost_s:
                    continue
                added = n - (a.cell.num_gpus if gtype == a.cell.gpu_type else 0)
                gain = (opts[0].samples_per_s - cur) / self.ref[i] / max(1, added)
                offers.append((-gain, self.rank[i], i, a, opts, added))
        # Every shape is an offer of its own: when a job's best shape has no free GPUs,
        # its next one (e.g. growing on its own type) still gets its turn.
        offers.sort(key=lambda x: x[:2])
        self.index.invalidate()
        grown: set = set()
        for _, _, i, a, opts, added in offers:
            if i in grown or self.free.free_of_type(opts[0].cell.gpu_type) < added:
                continue
            self.free.release(a.placement)
            for o in opts:
                p = self.free.place(o.cell)
                if p is not None:
                    self.free.take(p)
                    self.assign[i] = Assignment(o.cell, p)
                    how = "scaled up" if o.cell.gpu_type == a.cell.gpu_type else "moved back"
                    self.reasons[i] = f"{how} {a.cell.label()}→{o.cell.label()} on free GPUs"
                    grown.add(i)
                    break
            else:
                self.free.take(a.placement)

