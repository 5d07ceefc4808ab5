"""cells-ilp's integer program: one option (a Cell or waiting) per job, the most total value
within each GPU type's free GPUs, whole nodes' shares and the users' GPU shares.

Solved with PuLP, HiGHS first (in process, handed the current allocation as a MIP start),
then CBC; the round's policy (``policy.cells_ilp``) falls back to its greedy rule when
neither answers or the time limit cut the search short.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING

from policy.placement import FreeGpus

if TYPE_CHECKING:
    from policy.cells_ilp import _Option

log = logging.getLogger(__name__)


def solve_choice(options: dict[str, list[_Option]], free: FreeGpus, users: dict[str, str],
                 share_left: dict[str, float], time_limit_s: float,
                 solvers: tuple[str, ...] = ("highs", "cbc")) -> tuple[dict[str, _Option] | None, str]:
    """The option per job that maximizes the total value within capacity; (None, why) if no solver answers.

    Args:
        options: job id → its options (wait included); exactly one is chosen per job.
        free: free GPUs per node the chosen Cells may use.
        users: job id → user, for ``share_left``.
        share_left: user → GPUs the user may still get.
        time_limit_s: seconds each solver may take.
        solvers: which solvers to try, in order.
    """
    flat: list[_Option] = [o for opts in options.values() for o in opts]
    if not flat:
        return {}, "ILP"
    if all(o.cell is None for o in flat):
        return {o.job_id: o for o in flat}, "ILP"
    rows: list[tuple[list[int], list[float], str, float]] = []
    by_job: dict[str, list[int]] = {}
    for k, o in enumerate(flat):
        by_job.setdefault(o.job_id, []).append(k)
    for ks in by_job.values():
        rows.append((ks, [1.0] * len(ks), "==", 1.0))
    for gtype in sorted({o.cell.gpu_type for o in flat if o.cell is not None}):
        ks = [k for k, o in enumerate(flat) if o.cell is not None and o.cell.gpu_type == gtype]
        rows.append((ks, [float(flat[k].cell.num_gpus) for k in ks], "<=", float(free.free_of_type(gtype))))
        # Cells needing s GPUs per node only use nodes with s free, in multiples of s.
        shares = sorted({min(flat[k].cell.gpus_per_node, flat[k].cell.num_gpus) for k in ks} - {1})
        names = free.by_type.get(gtype, ())
        for s in shares:
            sub = [k for k in ks if min(flat[k].cell.gpus_per_node, flat[k].cell.num_gpus) >= s]
            room = sum(free.free[n] // s * s for n in names)
            rows.append((sub, [float(flat[k].cell.num_gpus) for k in sub], "<=", float(room)))
    for user, gpus in sorted(share_left.items()):
        ks = [k for k, o in enumerate(flat) if o.cell is not None and users.get(o.job_id) == user]
        if ks:
            rows.append((ks, [float(flat[k].cell.num_gpus) for k in ks], "<=", float(gpus)))
    best = {}
    for k, o in enumerate(flat):  # ties: the first listed (the current Cell, then by shape)
        if o.job_id not in best or o.value > flat[best[o.job_id]].value:
            best[o.job_id] = k
    if _feasible(list(best.values()), rows):
        # Every job can have its best option at once: that is the optimum, no solve needed.
        return {flat[k].job_id: flat[k] for k in best.values()}, "ILP"
    start = _warm_start(flat)
    for name in solvers:
        try:
            got = _solve_pulp(flat, rows, start, name, time_limit_s)
        except Exception as e:  # a missing or crashing solver must not stop a round
            log.warning("solver %s failed: %s", name, e)
            continue
        if got is not None and _feasible(got[0], rows):
            return {flat[k].job_id: flat[k] for k in got[0]}, "ILP" if got[1] else "ILP (time limit)"
    return None, "greedy"


def _warm_start(flat: list[_Option]) -> list[int]:
    """The current allocation: a running job's own Cell, else wait."""
    current: dict[str, int] = {}
    for k, o in enumerate(flat):
        if o.current or (o.cell is None and o.job_id not in current):
            current[o.job_id] = k
    return sorted(current.values())


def _solve_pulp(flat, rows, start: list[int], solver: str, time_limit_s: float) -> tuple[list[int], bool] | None:
    """(chosen indices, proven optimal) from one solver, or None when it has no answer."""
    import pulp

    prob = pulp.LpProblem("cells_ilp", pulp.LpMaximize)
    if hasattr(prob, "add_variable"):  # PuLP ≥ 3.3 attaches variables to the model
        xs = [prob.add_variable(f"x{k}", 0, 1, cat="Binary") for k in range(len(flat))]
    else:
        xs = [pulp.LpVariable(f"x{k}", 0, 1, cat="Binary") for k in range(len(flat))]
    prob += pulp.lpSum(o.value * xs[k] for k, o in enumerate(flat))
    for r, (ks, coefs, sense, bound) in enumerate(rows):
        expr = pulp.LpAffineExpression([(xs[k], c) for k, c in zip(ks, coefs)])
        prob += ((expr == bound) if sense == "==" else (expr <= bound)), f"r{r}"
    on = set(start)
    for k, x in enumerate(xs):
        x.setInitialValue(1 if k in on else 0)
    if solver == "highs":
        # One thread: the program is small, and worker threads only wait on a busy machine.
        s = _WarmHighs(msg=False, timeLimit=time_limit_s, gapRel=1e-4, threads=1)
    else:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))), warmStart=True)
    if not s.available():
        return None
    prob.solve(s)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    return [k for k, x in enumerate(xs) if x.varValue is not None and x.varValue > 0.5], optimal


def _feasible(chosen: list[int], rows) -> bool:
    on = set(chosen)
    for ks, coefs, sense, bound in rows:
        v = sum(c for k, c in zip(ks, coefs) if k in on)
        if (sense == "<=" and v > bound + 1e-6) or (sense == "==" and abs(v - bound) > 1e-6):
            return False
    return True


@functools.lru_cache(maxsize=1)
def _highs_class():
    import pulp

    base = getattr(pulp, "HiGHS", None)
    if base is None:
        return None

    class WarmHighs(base):
        """PuLP's in-process HiGHS, handed the variables' initial values as a MIP start."""

        def callSolver(self, lp):
            try:
                import highspy

                values = [float(v.varValue or 0.0) for v in lp.variables()]
                sol = highspy.HighsSolution()
                sol.col_value = values
                sol.value_valid = True
                lp.solverModel.setSolution(sol)
            except Exception as e:  # a start is an optimization only
                log.debug("no MIP start: %s", e)
            lp.solverModel.run()

    return WarmHighs


def _WarmHighs(**kwargs):
    cls = _highs_class()
    if cls is None:
        raise RuntimeError("PuLP has no HiGHS interface")
    return cls(**kwargs)
