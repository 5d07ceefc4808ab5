"""Node placement: map a Cell onto nodes of its GPU type without over-committing any node.

The rule is Frenzy's heterogeneity-aware scheduling (HAS) restricted to one GPU type per
job: whole free nodes first, then best-fit partial nodes (the node whose free GPUs exceed
the need by the least), and a power-of-two GPU count on every node so that the data- and
tensor-parallel groups of a plan divide evenly.

``place`` honours the Cell's layout (``gpus_per_node``): ``num_gpus / gpus_per_node``
nodes with ``gpus_per_node`` GPUs each, which is the layout the Cell was estimated (and,
in simulation, measured) for. ``place(..., strict=False)`` falls back to any power-of-two
split when the exact layout is not free; ``layout_of`` then tells what was obtained.

A ``FreeGpus`` is the per-node free count a policy works against during one decision; it
is a plain local value (the policy copies it from the snapshot and spends it).
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.cells import Cell
from policy.interface import Assignment, Placement, Snapshot, node_index


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _floor_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


@dataclass(frozen=True)
class Fragmentation:
    """How scattered the free GPUs of one type are.

    Attributes:
        gpu_type: the GPU type.
        free_gpus: free GPUs in all.
        free_whole_nodes: nodes with every GPU free.
        free_on_partial_nodes: free GPUs on nodes that are partly in use.
        largest_free_block: the most free GPUs on one node.
        fragmentation_frac: free_on_partial_nodes / free_gpus (0 when nothing is free):
            the share of free capacity that cannot host a whole-node layout.
    """

    gpu_type: str
    free_gpus: int
    free_whole_nodes: int
    free_on_partial_nodes: int
    largest_free_block: int
    fragmentation_frac: float


class FreeGpus:
    """Free GPUs per node, grouped by GPU type, for placing several jobs in one decision.

    Args:
        nodes: (name, gpu_type, capacity) per node; capacity is what managed jobs may use.
        free: name → free GPUs now (defaults to the capacity).
    """

    def __init__(self, nodes: list[tuple[str, str, int]], free: dict[str, int] | None = None):
        self.capacity: dict[str, int] = {name: cap for name, _, cap in nodes}
        self.free: dict[str, int] = dict(free) if free is not None else dict(self.capacity)
        self.type_of: dict[str, str] = {name: gtype for name, gtype, _ in nodes}
        by_type: dict[str, list[str]] = {}
        for name, gtype, _ in nodes:
            by_type.setdefault(gtype, []).append(name)
        self.by_type: dict[str, tuple[str, ...]] = {t: tuple(sorted(v)) for t, v in by_type.items()}

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, keep_running: bool = True) -> "FreeGpus":
        """Free GPUs of a snapshot's nodes.

        Args:
            snapshot: the policy's input.
            keep_running: subtract what running managed jobs hold (True), or treat every
                managed GPU as free, for a policy that re-plans everything (False).
        """
        index = node_index(snapshot.nodes)
        self = object.__new__(cls)
        self.capacity, self.type_of, self.by_type = index.capacity, index.type_of, index.by_type
        self.free = snapshot.free_gpus() if keep_running else dict(index.capacity)
        return self

    def copy(self) -> "FreeGpus":
        """An independent free map over the same nodes (the node lookups are shared)."""
        other = object.__new__(FreeGpus)
        other.capacity, other.type_of, other.by_type = self.capacity, self.type_of, self.by_type
        other.free = dict(self.free)
        return other

    def free_of_type(self, gpu_type: str) -> int:
        return sum(self.free[n] for n in self.by_type.get(gpu_type, ()))

    def total_free(self) -> int:
        """Free GPUs of every type together."""
        return sum(self.free.values())

    def all_free(self, placement: Placement) -> bool:
        """Every GPU of ``placement`` is free."""
        return all(self.free[n] >= g for n, g in placement)

    def node_size(self, gpu_type: str) -> int:
        """The largest node capacity of a type (0 when the cluster has none)."""
        return max((self.capacity[n] for n in self.by_type.get(gpu_type, ())), default=0)

    def take(self, placement: Placement) -> None:
        """Mark ``placement``'s GPUs used.

        Raises:
            ValueError: a node would go below zero free GPUs (an over-commit).
        """
        for name, gpus in placement:
            if self.free[name] < gpus:
                raise ValueError(f"node {name}: {gpus} GPUs wanted, {self.free[name]} free")
        for name, gpus in placement:
            self.free[name] -= gpus

    def release(self, placement: Placement) -> None:
        """Give ``placement``'s GPUs back (never above a node's capacity)."""
        for name, gpus in placement:
            self.free[name] = min(self.capacity[name], self.free[name] + gpus)

    def place(self, cell: Cell, strict: bool = True) -> Placement | None:
        """Where ``cell`` fits now, or None; nothing is taken (call ``take``).

        Args:
            cell: the Cell to place; its ``gpus_per_node`` is the wanted layout
                (values above ``num_gpus`` mean all GPUs on one node).
            strict: only the Cell's layout (True), or any power-of-two split (False).
        """
        names = self.by_type.get(cell.gpu_type)
        if not names or cell.num_gpus <= 0:
            return None
        per_node = min(cell.gpus_per_node, cell.num_gpus)
        if self.free_of_type(cell.gpu_type) < cell.num_gpus:
            return None
        if cell.num_gpus % per_node == 0 and _is_power_of_two(per_node):
            exact = self._place_layout(names, per_node, cell.num_gpus // per_node)
            if exact is not None or strict:
                return exact
        elif strict:
            return None
        return self._place_any(names, cell.num_gpus)

    def _place_layout(self, names: list[str], per_node: int, num_nodes: int) -> Placement | None:
        # Best fit: nodes whose free count exceeds per_node by the least come first, so a
        # whole-node layout takes whole free nodes and a small job fills a partial node.
        fits = [(self.free[n] - per_node, n) for n in names if self.free[n] >= per_node]
        if len(fits) < num_nodes:
            return None
        fits.sort()
        return tuple(sorted((n, per_node) for _, n in fits[:num_nodes]))

    def _place_any(self, names: list[str], num_gpus: int) -> Placement | None:
        free = {n: self.free[n] for n in names if self.free[n] > 0}
        chosen: dict[str, int] = {}
        remaining = num_gpus
        # Whole free nodes first, largest first, while the job needs at least a node.
        for n in sorted(free, key=lambda n: (-self.capacity[n], n)):
            cap = self.capacity[n]
            if free[n] == cap and cap <= remaining and _is_power_of_two(cap):
                chosen[n] = cap
                free[n] = 0
                remaining -= cap
        while remaining > 0:
            # Best fit for the whole remainder, else the biggest power-of-two chunk.
            candidates = [n for n in free if free[n] >= remaining and n not in chosen]
            if candidates:
                n = min(candidates, key=lambda n: (free[n] - remaining, n))
                chunk = _floor_power_of_two(remaining)
            else:
                open_nodes = [n for n in free if free[n] > 0 and n not in chosen]
                if not open_nodes:
                    return None
                n = min(open_nodes, key=lambda n: (-_floor_power_of_two(free[n]), n))
                chunk = min(_floor_power_of_two(free[n]), _floor_power_of_two(remaining))
            chosen[n] = chunk
            free[n] -= chunk
            remaining -= chunk
        return tuple(sorted(chosen.items()))

    def fragmentation(self) -> tuple[Fragmentation, ...]:
        """Per GPU type, how scattered the free GPUs are."""
        out = []
        for gtype in sorted(self.by_type):
            names = self.by_type[gtype]
            free = sum(self.free[n] for n in names)
            whole = sum(1 for n in names if self.free[n] == self.capacity[n] and self.capacity[n] > 0)
            partial = sum(self.free[n] for n in names if 0 < self.free[n] < self.capacity[n])
            largest = max((self.free[n] for n in names), default=0)
            out.append(Fragmentation(gtype, free, whole, partial, largest,
                                     partial / free if free else 0.0))
        return tuple(out)


def layout_of(placement: Placement) -> tuple[int, int]:
    """(num_nodes, gpus_per_node) of a placement; uneven splits report the largest share."""
    if not placement:
        return (0, 0)
    return (len(placement), max(g for _, g in placement))


def place_cell(snapshot: Snapshot, cell: Cell, strict: bool = True) -> Placement | None:
    """Where ``cell`` fits among the snapshot's free GPUs now (one-off convenience)."""
    return FreeGpus.from_snapshot(snapshot).place(cell, strict)


def job_fitting_idle_gpus(snapshot: Snapshot) -> str | None:
    """A waiting job one of whose feasible Cells fits the GPUs free now, or None."""
    free = FreeGpus.from_snapshot(snapshot)
    for job in snapshot.jobs:
        if job.assignment is None and any(job.can_run(e.cell) and free.place(e.cell) is not None
                                          for e in job.feasible_estimates()):
            return job.job_id
    return None


def name_beneficiaries(snapshot: Snapshot, final: dict[str, Assignment | None], reasons: dict[str, str]) -> None:
    """Append "for job X" to the reason of a running job that was moved or suspended when
    jobs now placed on the nodes it left got its GPUs (what a user reading squeue asks)."""
    newcomers: dict[str, list[str]] = {}
    for j in snapshot.jobs:
        got = final.get(j.job_id)
        if got is not None and got != j.assignment:
            for node, _ in got.placement:
                newcomers.setdefault(node, []).append(j.job_id)
    for j in snapshot.jobs:
        if j.assignment is None or j.job_id not in final or final[j.job_id] == j.assignment:
            continue
        takers = sorted({k for node, _ in j.assignment.placement for k in newcomers.get(node, ()) if k != j.job_id})
        if takers and j.job_id in reasons:
            reasons[j.job_id] += " for job " + ", ".join(takers[:3]) + (" …" if len(takers) > 3 else "")
