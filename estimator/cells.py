"""Cells (GPU type × GPU count × stage count) and their estimates.

This module holds the vocabulary only; estimation lives in ``estimator.estimate``.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    """A GPU type, a GPU count laid out as whole or partial nodes, and a stage count."""

    gpu_type: str
    num_gpus: int
    gpus_per_node: int
    num_stages: int

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.num_gpus // self.gpus_per_node))

    def label(self) -> str:
        """Compact form used in AdminComment and logs: ``a100x8:s2``."""
        return f"{self.gpu_type}x{self.num_gpus}:s{self.num_stages}"


def gpus_per_node_of(num_gpus: int, node_size: int) -> int:
    """GPUs per node of a Cell of ``num_gpus`` (a power of two) on nodes of ``node_size``:
    the largest power of two up to both, so that the count lays out on whole such groups
    (8 GPUs on 6-GPU nodes: 2 nodes of 4, not 2 of 6)."""
    most = max(1, min(num_gpus, node_size))
    return 1 << (most.bit_length() - 1)


def stage_label(dp: int, tp: int, ep: bool = False) -> str:
    """One stage as plan strings write it: ``dp2tp2``, ``dp4tp1ep``."""
    return f"dp{dp}tp{tp}{'ep' if ep else ''}"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: layers [layer_start, layer_end) on dp × tp GPUs.

    ``ep``: the stage's MoE experts are sharded over all its dp × tp GPUs (expert
    parallelism, GShard's layout), each token routed to its experts' GPU by an all-to-all;
    without it they are sharded over tp only and replicated across dp.
    """

    layer_start: int
    layer_end: int
    dp: int
    tp: int
    ep: bool = False

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp

    def label(self) -> str:
        """``dp4tp1``, or ``dp4tp1ep`` with expert parallelism (the plan string's stage)."""
        return stage_label(self.dp, self.tp, self.ep)

    def as_row(self) -> list:
        """``[layer_start, layer_end, dp, tp]`` (and ``True`` when ``ep``): ``StagePlan(*row)``
        reads it back; rows written before ``ep`` read the same."""
        return [self.layer_start, self.layer_end, self.dp, self.tp] + ([True] if self.ep else [])

    def to_json(self) -> dict:
        out = {"layers": [self.layer_start, self.layer_end], "dp": self.dp, "tp": self.tp}
        if self.ep:
            out["ep"] = True
        return out


@dataclass(frozen=True)
class CellEstimate:
    """The best plan found for one Cell and what it costs.

    ``fidelity`` names what produced the time (``analytic``, ``compiled``, ``measured``)
    and ``memory_fidelity`` what produced the memory (``analytic``, ``compiled``,
    ``profiled``, or ``measured`` by the runner on GPUs);
    ``comm_source`` says whether communication came from the measured table or the
    latency-bandwidth model. ``remat``, ``zero_level`` and ``offload`` are the plan's
    memory choices, ``host_memory_gb`` the host memory per GPU it needs (process and
    checkpoint staging, plus offloaded states), ``runnable`` whether the runner can run
    it today and ``plan`` its plan string.
    """

    cell: Cell
    stages: tuple[StagePlan, ...]
    micro_batches: int
    iteration_time_s: float
    samples_per_s: float
    peak_memory_gb: float
    feasible: bool
    reason: str
    fidelity: str = "analytic"  # of iteration_time_s and samples_per_s
    comm_source: str = "table"
    memory_fidelity: str = "analytic"  # of peak_memory_gb
    remat: bool = True
    zero_level: int = 0  # ZeRO stage of the plan (0: replicated states)
    offload: bool = False  # ZeRO-Offload of master weights and optimizer states to the host
    host_memory_gb: float = 0.0  # host memory per GPU the plan needs
    runnable: bool = True  # whether the runner can run the plan today
    plan: str = ""  # the plan string (``estimator.plan_string``), "" when there is none

    def to_json(self) -> dict:
        c = self.cell
        return {
            "gpu_type": c.gpu_type,
            "num_gpus": c.num_gpus,
            "num_nodes": c.num_nodes,
            "gpus_per_node": min(c.gpus_per_node, c.num_gpus),
            "num_stages": c.num_stages,
            "stages": [s.to_json() for s in self.stages],
            "micro_batches": self.micro_batches,
            "iteration_time_s": round(self.iteration_time_s, 6) if self.feasible else None,
            "samples_per_s": round(self.samples_per_s, 4) if self.feasible else None,
            "peak_memory_gb": round(self.peak_memory_gb, 3),
            "feasible": self.feasible,
            "reason": self.reason,
            "fidelity": self.fidelity,
            "memory_fidelity": self.memory_fidelity,
            "comm_source": self.comm_source,
            "remat": self.remat,
            "zero_level": self.zero_level,
            "offload": self.offload,
            "host_memory_gb": round(self.host_memory_gb, 3),
            "runnable": self.runnable,
            "plan": self.plan or None,
        }
