"""0/1 programs: the one solver back end of every policy that solves one (cells-ilp, Sia).

A program is a set of binary variables 0 … n−1, a linear objective and linear rows
``(coefficients, sense, bound)`` with sense ``<=``, ``>=`` or ``==``. The solvers are tried
in order, each under the same time limit:

- ``highs``: HiGHS in process, the model handed over in one piece through ``highspy``
  (HiGHS's own Python API). Building it through PuLP's expression objects cost most of a
  round's budget on a few hundred jobs. A start (a feasible assignment, e.g. the current
  allocation) is passed as a MIP start.
- ``cbc``: CBC, the command-line solver bundled with PuLP, warm-started the same way; it
  counts whole seconds.

An answer is used only when it satisfies every row. ``None`` when no solver answers in
time: the caller falls back to a greedy rule, so a round never blocks.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import warnings
from dataclasses import dataclass

log = logging.getLogger(__name__)

Row = tuple[dict[int, float], str, float]  # (variable → coefficient, sense, bound)
SOLVERS = ("highs", "cbc")
DEFAULT_GAP_REL = 1e-4  # HiGHS's own default relative MIP gap
# Descriptor 1 is the process's: the daemon's rounds and its forecast thread may both solve.
_STDOUT_FD_LOCK = threading.Lock()


@dataclass(frozen=True)
class Solution:
    """The variables set to 1, whether the solver proved them optimal (False: the time
    limit cut its search short, the answer is feasible), and which solver answered."""

    chosen: tuple[int, ...]
    optimal: bool
    solver: str


def solve_binary_program(objective: dict[int, float], rows: list[Row], num_vars: int, maximize: bool,
                         time_limit_s: float, start: list[int] | None = None,
                         solvers: tuple[str, ...] = SOLVERS, gap_rel: float = DEFAULT_GAP_REL,
                         max_nodes: int | None = None) -> Solution | None:
    """Solve the program (see the module docstring); None when no solver answers.

    Args:
        objective: variable index → coefficient (absent: 0).
        rows: the constraints.
        num_vars: variables are 0 … num_vars−1.
        maximize: maximize (True) or minimize (False).
        time_limit_s: seconds each solver may take.
        start: indices set to 1 in a known assignment, handed to the solvers as a start.
        solvers: which to try, in order (``highs``, ``cbc``).
        gap_rel: the relative gap at which a solver may stop and call its answer optimal.
        max_nodes: a deterministic budget: branch-and-bound nodes each solver may explore
            (None: no budget beyond the time limit). Unlike a time limit, the answer does
            not depend on how busy the machine is.
    """
    unknown = [name for name in solvers if name not in _SOLVE]
    if unknown:
        raise ValueError(f"unknown solver {unknown[0]!r}; known: {', '.join(SOLVERS)}")
    for name in solvers:
        try:
            got = _SOLVE[name](objective, rows, num_vars, maximize, time_limit_s, start, gap_rel, max_nodes)
        except Exception as e:  # a missing or crashing solver must not stop a round
            log.warning("solver %s failed: %s", name, e)
            continue
        if got is not None and satisfies(got[0], rows):
            return Solution(tuple(got[0]), got[1], name)
    return None


def satisfies(chosen, rows: list[Row]) -> bool:
    """Whether setting ``chosen`` to 1 (the rest 0) meets every row."""
    on = set(chosen)
    for coefs, sense, bound in rows:
        v = sum(c for i, c in coefs.items() if i in on)
        if (sense == "<=" and v > bound + 1e-6) or (sense == ">=" and v < bound - 1e-6) \
                or (sense == "==" and abs(v - bound) > 1e-6):
            return False
    return True


def quiet_highs():
    """A ``highspy.Highs`` with its output off. HiGHS's C++ prints its banner on file
    descriptor 1 when a process makes its first instance, before any option can be set: while
    an instance is made, descriptor 1 points at /dev/null, so stdout stays the command's own
    (the JSON of `simulate --json -`)."""
    import highspy

    with _STDOUT_FD_LOCK:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


def _solve_highs(objective, rows, num_vars, maximize, time_limit_s, start, gap_rel,
                 max_nodes=None) -> tuple[list[int], bool] | None:
    import highspy

    h = quiet_highs()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", 1)  # the program is small; worker threads only wait on a busy machine
    h.setOptionValue("mip_rel_gap", float(gap_rel))
    if max_nodes is not None:
        h.setOptionValue("mip_max_nodes", int(max_nodes))
    lp = highspy.HighsLp()
    lp.num_col_ = num_vars
    lp.num_row_ = len(rows)
    lp.col_cost_ = [objective.get(i, 0.0) for i in range(num_vars)]
    lp.col_lower_ = [0.0] * num_vars
    lp.col_upper_ = [1.0] * num_vars
    inf = highspy.kHighsInf
    lows, ups, first, index, value = [], [], [0], [], []
    for coefs, sense, bound in rows:
        lows.append(bound if sense in (">=", "==") else -inf)
        ups.append(bound if sense in ("<=", "==") else inf)
        for i, c in sorted(coefs.items()):
            index.append(i)
            value.append(c)
        first.append(len(index))
    lp.row_lower_, lp.row_upper_ = lows, ups
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = num_vars, len(rows)
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = first, index, value
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_vars
    lp.sense_ = highspy.ObjSense.kMaximize if maximize else highspy.ObjSense.kMinimize
    h.passModel(lp)
    if start is not None:
        try:
            sol = highspy.HighsSolution()
            on = set(start)
            sol.col_value = [1.0 if i in on else 0.0 for i in range(num_vars)]
            sol.value_valid = True
            h.setSolution(sol)
        except Exception as e:  # a start is an optimization only
            log.debug("no MIP start: %s", e)
    h.run()
    if h.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        return None
    optimal = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return [i for i, x in enumerate(h.getSolution().col_value) if x > 0.5], optimal


def _solve_cbc(objective, rows, num_vars, maximize, time_limit_s, start, gap_rel,
               max_nodes=None) -> tuple[list[int], bool] | None:
    import pulp

    prob = pulp.LpProblem("policy", pulp.LpMaximize if maximize else pulp.LpMinimize)
    if hasattr(prob, "add_variable"):  # PuLP ≥ 3.3 attaches variables to the model
        xs = [prob.add_variable(f"x{i}", 0, 1, cat="Binary") for i in range(num_vars)]
    else:
        xs = [pulp.LpVariable(f"x{i}", 0, 1, cat="Binary") for i in range(num_vars)]
    prob += pulp.LpAffineExpression([(xs[i], c) for i, c in objective.items()])
    for k, (coefs, sense, bound) in enumerate(rows):
        expr = pulp.LpAffineExpression([(xs[i], c) for i, c in coefs.items()])
        prob += ((expr <= bound) if sense == "<=" else (expr >= bound) if sense == ">=" else (expr == bound)), f"c{k}"
    if start is not None:
        on = set(start)
        for i, x in enumerate(xs):
            x.setInitialValue(1 if i in on else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))),
                                   warmStart=start is not None, gapRel=gap_rel, maxNodes=max_nodes)
    if not solver.available():
        return None
    prob.solve(solver)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    return ([i for i, x in enumerate(xs) if x.varValue is not None and x.varValue > 0.5],
            prob.sol_status == pulp.LpSolutionOptimal)


_SOLVE = {"highs": _solve_highs, "cbc": _solve_cbc}

__all__ = ["SOLVERS", "Row", "Solution", "satisfies", "solve_binary_program"]
