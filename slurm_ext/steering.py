"""How a pending elastic job is steered to the GPU type of its Cell, and what CPUs and
host memory per GPU it gets.

Three methods, per job:

- **partition**: one partition per GPU type; the job moves to the type's partition with an
  untyped GPU count (every Slurm version; the layout the lab and most sites use).
- **gres**: inside a partition of mixed GPU types, the job's GPU request is retyped
  (``Gres=gpu:a100:4``). Slurm can retype a pending job's GRES from 23.02.6 on.
- **features**: inside a mixed partition on older Slurm (22.05 refuses to retype a
  pending job's GRES: "Invalid GRES specification"), the count stays untyped and the
  node features pick the type (``Features=a100``; nodes must carry their type as a
  feature, as the admin guide asks).

``steering: auto`` (the default) keeps a job that sits in a partition of one type on the
partition method, and steers a job in a mixed partition inside it: by GRES where Slurm
can, else by features. ``partition``, ``gres`` or ``features`` force one method.

CPUs and host memory per GPU: each GPU's share of the Cell's nodes (the fewest CPUs and
memory per GPU among the type's nodes), and never less host memory than the Cell's plan
needs per GPU (ZeRO-Offload keeps optimizer states in host memory), within what a node has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from slurm_ext.slurm_client import SlurmNode

METHODS = ("auto", "partition", "gres", "features")
TYPED_GRES_UPDATE = (23, 2, 6)  # the first Slurm that retypes a pending job's GRES


@dataclass(frozen=True)
class NodeShare:
    """Among a GPU type's nodes: the fewest CPUs and MB of memory per GPU, and the least
    memory of one node (what a job's GPUs on one node may not exceed together)."""

    cpus_per_gpu: int
    mem_per_gpu_mb: int
    node_mem_mb: int


@dataclass(frozen=True)
class Steering:
    """What steering needs to know of the cluster (built once a round, see :func:`steering`)."""

    method: str = "auto"
    slurm_version: tuple[int, int, int] = (22, 5, 0)
    type_partitions: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    partition_types: dict[str, frozenset[str]] = field(default_factory=dict, hash=False, compare=False)
    shares: dict[str, NodeShare] = field(default_factory=dict, hash=False, compare=False)
    node_partitions: dict[str, frozenset[str]] = field(default_factory=dict, hash=False, compare=False)
    # Catalog type → the GRES type names its nodes carry (a site's own, ``a100_sxm4_80gb``,
    # or None for untyped GPUs): what a retyped request must name.
    gres_types: dict[str, frozenset[str | None]] = field(default_factory=dict, hash=False, compare=False)

    @property
    def typed_gres(self) -> bool:
        return self.slurm_version >= TYPED_GRES_UPDATE


@dataclass(frozen=True)
class Steer:
    """How one job gets one GPU type: the partition to move it to (None: it stays), a
    typed GPU request or node features, and the method's name."""

    method: str
    partition: str | None = None
    gpu_type: str | None = None
    features: str | None = None


def steering(method: str, version: tuple[int, int, int], nodes: Iterable[SlurmNode],
             type_partitions: Mapping[str, str], node_type) -> Steering:
    """The round's steering facts from Slurm's nodes; ``node_type(node)`` gives a node's
    GPU type (None: no GPUs)."""
    if method not in METHODS:
        raise ValueError(f"unknown steering {method!r}; use one of {', '.join(METHODS)}")
    parts: dict[str, set[str]] = {}
    shares: dict[str, NodeShare] = {}
    node_parts: dict[str, frozenset[str]] = {}
    gres_types: dict[str, set[str | None]] = {}
    for n in nodes:
        t = node_type(n)
        if t is None or n.gpus <= 0:
            continue
        node_parts[n.name] = frozenset(n.partitions)
        gres_types.setdefault(t, set()).add(n.gpu_type)
        for p in n.partitions:
            parts.setdefault(p, set()).add(t)
        share = NodeShare(max(1, n.cpus // n.gpus), max(1, n.real_memory_mb // n.gpus), n.real_memory_mb)
        old = shares.get(t)
        shares[t] = share if old is None else NodeShare(min(old.cpus_per_gpu, share.cpus_per_gpu),
                                                         min(old.mem_per_gpu_mb, share.mem_per_gpu_mb),
                                                         min(old.node_mem_mb, share.node_mem_mb))
    return Steering(method, version, dict(type_partitions), {p: frozenset(t) for p, t in parts.items()},
                    shares, node_parts, {t: frozenset(g) for t, g in gres_types.items()})


def steer(s: Steering, job_partition: str, gpu_type: str) -> Steer | None:
    """How a job now in ``job_partition`` gets ``gpu_type`` (None: no way: no partition
    has that type).

    The partition method moves the job to the type's own partition. The others keep it in
    its partition when that has nodes of the type, else move it to a partition that has.
    """
    own = s.partition_types.get(job_partition, frozenset())
    mixed = {p for p, types in s.partition_types.items() if len(types) > 1 and gpu_type in types}
    method = s.method
    if method == "gres" and not s.typed_gres:
        method = "features"  # Slurm before 23.02.6 refuses to retype a pending job
    if method == "auto":
        # A job in a mixed partition is steered inside one (its own when it has the type);
        # a job in a partition of one type moves to the type's partition.
        if len(own) > 1 and mixed or gpu_type not in s.type_partitions:
            method = "gres" if s.typed_gres else "features"
        else:
            method = "partition"
    if method == "partition":
        part = s.type_partitions.get(gpu_type)
        # Features set by an earlier round of another method are cleared.
        return None if part is None else Steer("partition", part)
    if gpu_type in own:
        part = None
    else:
        part = min(mixed, default=None) or next(
            (p for p, types in sorted(s.partition_types.items()) if gpu_type in types), None)
        if part is None:
            return None
    # Retyped to the name the type's nodes carry; by features when they carry several (or
    # none: untyped GPUs, told apart by partition or feature only).
    names = s.gres_types.get(gpu_type, frozenset({gpu_type}))
    if method == "gres" and len(names) == 1 and None not in names:
        return Steer("gres", part, gpu_type=next(iter(names)))
    return Steer("features", part, features=gpu_type)


def steer_to_nodes(s: Steering, how: Steer, job_partition: str, nodes: tuple[str, ...]) -> Steer | None:
    """``how``, with its partition (the job's own when it names none) replaced by one that
    holds every node of ``nodes`` where it does not (a site with two partitions of a type
    on different nodes): a start pinned to nodes outside its partition never runs. None:
    no partition holds them all (the pin must go)."""
    part = how.partition or job_partition
    known = [s.node_partitions.get(n) for n in nodes]
    if not nodes or not all(known) or all(part in k for k in known):
        return how  # in it (or nothing known of a node's partitions)
    common = frozenset.intersection(*known)
    if not common:
        return None
    # Fewest GPU types first (a partition of the type alone), then by name.
    best = min(common, key=lambda p: (len(s.partition_types.get(p, ())), p))
    if len(s.partition_types.get(best, ())) == 1:
        # A partition of the type alone pins it: no features (which a later move by
        # partition would leave behind on the job, pinning the old type) or typed request.
        return Steer("partition", best)
    return Steer(how.method, best, how.gpu_type, how.features)


def per_gpu_resources(s: Steering, gpu_type: str, gpus_per_node: int,
                      host_memory_gb: float | None) -> tuple[int | None, int | None]:
    """(CPUs per GPU, MB of host memory per GPU) for a Cell of ``gpu_type`` with
    ``gpus_per_node`` GPUs on each node: each GPU's share of the type's nodes, raised to
    what the plan needs in host memory (offload) when that is more, but never more than a
    node holds for the Cell's GPUs on it; (None, None) when Slurm reports no such nodes."""
    share = s.shares.get(gpu_type)
    if share is None:
        return None, None
    mem = share.mem_per_gpu_mb
    if host_memory_gb:
        mem = max(mem, int(host_memory_gb * 1000 + 0.5))
    return share.cpus_per_gpu, max(1, min(mem, share.node_mem_mb // max(1, gpus_per_node)))
