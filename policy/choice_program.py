"""cells-ilp's integer program: one option (a Cell or waiting) per job, the most total value
within each GPU type's free GPUs, whole nodes' shares and the users' GPU shares.

Solved by ``policy.binary_program`` (HiGHS in process, handed the current allocation as a
MIP start, then CBC); the round's policy (``policy.cells_ilp``) falls back to its greedy
rule when neither answers or the time limit cut the search short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from policy.binary_program import SOLVERS, Row, satisfies, solve_binary_program
from policy.placement import FreeGpus

if TYPE_CHECKING:
    from policy.cells_ilp import _Option


def solve_choice(options: dict[str, list[_Option]], free: FreeGpus, users: dict[str, str],
                 share_left: dict[str, float], time_limit_s: float,
                 solvers: tuple[str, ...] = SOLVERS) -> tuple[dict[str, _Option] | None, str]:
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
    rows: list[Row] = []
    by_job: dict[str, list[int]] = {}
    for k, o in enumerate(flat):
        by_job.setdefault(o.job_id, []).append(k)
    for ks in by_job.values():
        rows.append(({k: 1.0 for k in ks}, "==", 1.0))
    for gtype in sorted({o.cell.gpu_type for o in flat if o.cell is not None}):
        ks = [k for k, o in enumerate(flat) if o.cell is not None and o.cell.gpu_type == gtype]
        rows.append(({k: float(flat[k].cell.num_gpus) for k in ks}, "<=", float(free.free_of_type(gtype))))
        # Cells needing s GPUs per node only use nodes with s free, in multiples of s.
        shares = sorted({min(flat[k].cell.gpus_per_node, flat[k].cell.num_gpus) for k in ks} - {1})
        names = free.by_type.get(gtype, ())
        for s in shares:
            sub = [k for k in ks if min(flat[k].cell.gpus_per_node, flat[k].cell.num_gpus) >= s]
            room = sum(free.free[n] // s * s for n in names)
            rows.append(({k: float(flat[k].cell.num_gpus) for k in sub}, "<=", float(room)))
    for user, gpus in sorted(share_left.items()):
        ks = [k for k, o in enumerate(flat) if o.cell is not None and users.get(o.job_id) == user]
        if ks:
            rows.append(({k: float(flat[k].cell.num_gpus) for k in ks}, "<=", float(gpus)))
    best = {}
    for k, o in enumerate(flat):  # ties: the first listed (the current Cell, then by shape)
        if o.job_id not in best or o.value > flat[best[o.job_id]].value:
            best[o.job_id] = k
    if satisfies(best.values(), rows):
        # Every job can have its best option at once: that is the optimum, no solve needed.
        return {flat[k].job_id: flat[k] for k in best.values()}, "ILP"
    got = solve_binary_program({k: o.value for k, o in enumerate(flat)}, rows, len(flat), True, time_limit_s,
                               start=_warm_start(flat), solvers=solvers)
    if got is None:
        return None, "greedy"
    return {flat[k].job_id: flat[k] for k in got.chosen}, "ILP" if got.optimal else "ILP (time limit)"


def _warm_start(flat: list[_Option]) -> list[int]:
    """The current allocation: a running job's own Cell, else wait."""
    current: dict[str, int] = {}
    for k, o in enumerate(flat):
        if o.current or (o.cell is None and o.job_id not in current):
            current[o.job_id] = k
    return sorted(current.values())
