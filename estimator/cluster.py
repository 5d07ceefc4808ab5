"""Cluster specs: how many nodes of each GPU type, GPUs per node, and the network.

A spec loads from YAML::

    name: my-cluster
    network: {kind: infiniband, bandwidth_gbytes_s: 25}   # between nodes, per node, one direction
    node_groups:
      - {gpu_type: a100, nodes: 80, gpus_per_node: 4}
      - {gpu_type: a40, nodes: 160, gpus_per_node: 2, partition: a40, network: {kind: default}}

Errors name the bad field (``node_groups[1].nodes``).
"""

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from estimator.cells import gpus_per_node_of
from estimator.errors import SpecError, yaml_problem
from estimator.yaml_text import load_yaml
from estimator.gpus import gpu_type

log = logging.getLogger(__name__)

# Network kinds and their default per-node bandwidth, GB/s one direction. `default` is the
# Ethernet of the measured clusters (10 GbE class); `infiniband` HDR 200 Gb/s.
NETWORK_DEFAULT_GBYTES_S = {"default": 1.25, "ethernet": 1.25, "infiniband": 25.0, "roce": 12.5}


@dataclass(frozen=True)
class Network:
    kind: str = "default"
    bandwidth_gbytes_s: float = NETWORK_DEFAULT_GBYTES_S["default"]


@dataclass(frozen=True)
class NodeGroup:
    """Identical nodes of one GPU type."""

    gpu_type: str
    nodes: int
    gpus_per_node: int
    partition: str
    network: Network

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_names(self) -> tuple[str, ...]:
        return tuple(f"{self.partition}-{i + 1}" for i in range(self.nodes))


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    node_groups: tuple[NodeGroup, ...]

    @property
    def gpu_types(self) -> tuple[str, ...]:
        seen: list[str] = []
        for g in self.node_groups:
            if g.gpu_type not in seen:
                seen.append(g.gpu_type)
        return tuple(seen)

    def total_gpus(self, gpu_type_name: str | None = None) -> int:
        return sum(
            g.total_gpus for g in self.node_groups
            if gpu_type_name is None or g.gpu_type == gpu_type_name
        )

    def group(self, gpu_type_name: str, gpus_per_node: int | None = None, num_gpus: int | None = None
              ) -> NodeGroup:
        """The (first) node group of a GPU type; with ``gpus_per_node``, the first of the
        type's groups whose nodes have that many GPUs, else (with ``num_gpus``) the first
        whose nodes lay that count out so (``cells.gpus_per_node_of``: 8 GPUs as 2 × 4 on
        6-GPU nodes), if any."""
        groups = [g for g in self.node_groups if g.gpu_type == gpu_type_name]
        if not groups:
            having = [name for name, c in BUILTIN_CLUSTERS.items() if gpu_type_name in c.gpu_types]
            raise SpecError("gpu_type", gpu_type_name, f"cluster {self.name} has {', '.join(self.gpu_types)}; name a "
                            "cluster that has it (a cluster YAML" + (f", or {', '.join(having)}" if having else "")
                            + ")")
        return next((g for g in groups if g.gpus_per_node == gpus_per_node), None) or next(
            (g for g in groups if num_gpus and gpus_per_node_of(num_gpus, g.gpus_per_node) == gpus_per_node),
            groups[0])

    def holds_layout(self, gpu_type_name: str, num_gpus: int, gpus_per_node: int) -> bool:
        """The type has enough nodes of at least ``gpus_per_node`` GPUs for the count."""
        return -(-num_gpus // gpus_per_node) <= sum(g.nodes for g in self.node_groups
                                                    if g.gpu_type == gpu_type_name and g.gpus_per_node >= gpus_per_node)

    def node_sizes(self, gpu_type_name: str) -> tuple[int, ...]:
        """The GPUs per node of a type's node groups, distinct, in the groups' order."""
        return tuple(dict.fromkeys(g.gpus_per_node for g in self.node_groups if g.gpu_type == gpu_type_name))


def _network(raw: object, where: str) -> Network:
    if raw is None:
        return Network()
    if not isinstance(raw, dict):
        raise SpecError(where, raw, "give a mapping {kind: ..., bandwidth_gbytes_s: ...}")
    unknown = set(raw) - {"kind", "bandwidth_gbytes_s", "bandwidth_gbps"}
    if unknown:
        first = sorted(unknown, key=str)[0]
        raise SpecError(f"{where}.{first}", raw[first], "unknown key; known: kind, bandwidth_gbytes_s")
    kind = str(raw.get("kind", "default")).lower()
    if kind not in NETWORK_DEFAULT_GBYTES_S:
        raise SpecError(f"{where}.kind", kind, f"use one of {', '.join(NETWORK_DEFAULT_GBYTES_S)}")
    # bandwidth_gbps: the key's earlier name (it always held GB/s, not Gbit/s).
    key = "bandwidth_gbps" if "bandwidth_gbps" in raw and "bandwidth_gbytes_s" not in raw else "bandwidth_gbytes_s"
    if key == "bandwidth_gbps":
        log.warning("%s.bandwidth_gbps is deprecated: it is read as GB/s; rename it bandwidth_gbytes_s", where)
    bw = raw.get(key, NETWORK_DEFAULT_GBYTES_S[kind])
    if not isinstance(bw, (int, float)) or isinstance(bw, bool) or not 0 < bw < math.inf:
        raise SpecError(f"{where}.{key}", bw, "give a positive number of GB/s (gigabytes per second)")
    return Network(kind, float(bw))


def _positive_int(raw: dict, key: str, where: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(f"{where}.{key}", value, "give a positive integer")
    return value


def cluster_from_dict(raw: object, source: str = "<dict>") -> ClusterSpec:
    """Validate a parsed YAML mapping into a ClusterSpec."""
    if not isinstance(raw, dict):
        raise SpecError("cluster", source, f"holds a {type(raw).__name__}, not a cluster spec "
                        "(a mapping with name and node_groups)")
    unknown = set(raw) - {"name", "network", "node_groups"}
    if unknown:
        first = sorted(unknown, key=str)[0]
        raise SpecError(str(first), raw[first], "unknown cluster key; known: name, network, node_groups")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("name", name, "give the cluster a name")
    default_net = _network(raw.get("network"), "network")
    groups_raw = raw.get("node_groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise SpecError("node_groups", groups_raw, "list at least one {gpu_type, nodes, gpus_per_node}")
    groups = []
    for i, g in enumerate(groups_raw):
        where = f"node_groups[{i}]"
        if not isinstance(g, dict):
            raise SpecError(where, g, "give a mapping {gpu_type, nodes, gpus_per_node}")
        unknown = set(g) - {"gpu_type", "nodes", "gpus_per_node", "partition", "network"}
        if unknown:
            first = sorted(unknown, key=str)[0]
            raise SpecError(f"{where}.{first}", g[first], "unknown key")
        try:
            gt = gpu_type(str(g.get("gpu_type")))
        except SpecError as e:
            raise SpecError(f"{where}.gpu_type", g.get("gpu_type"), e.hint) from None
        nodes = _positive_int(g, "nodes", where)
        per_node = _positive_int(g, "gpus_per_node", where)
        partition = str(g.get("partition", gt.name))
        taken = next((j for j, other in enumerate(groups) if other.partition == partition), None)
        if taken is not None:  # its nodes would be named as the other group's (partition-1, ...)
            raise SpecError(f"{where}.partition", partition, f"node_groups[{taken}] has it too: give each node "
                                                             "group its own partition (e.g. a100-8 for the nodes of 8)")
        net = _network(g["network"], f"{where}.network") if "network" in g else default_net
        groups.append(NodeGroup(gt.name, nodes, per_node, partition, net))
    return ClusterSpec(name, tuple(groups))


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A built-in cluster by name, or a YAML file."""
    if name_or_path in BUILTIN_CLUSTERS:
        return BUILTIN_CLUSTERS[name_or_path]
    path = Path(name_or_path)
    if not name_or_path.strip() or not path.exists():
        raise SpecError("cluster", name_or_path,
                        f"neither a built-in ({', '.join(BUILTIN_CLUSTERS)}) nor a readable YAML file")
    try:
        raw = load_yaml(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise SpecError("cluster", name_or_path, yaml_problem(e)) from None
    except OSError as e:
        raise SpecError("cluster", name_or_path, f"cannot read: {e.strerror}") from None
    return cluster_from_dict(raw, str(path))


BUILTIN_CLUSTERS: dict[str, ClusterSpec] = {
    # The Crius/Arena papers' simulated cluster: 320 GPUs of each of four types, on the
    # networks the shipped collectives were measured on (the A40s' InfiniBand, the
    # artifact's `default` network for the rest); 25 GB/s per node where the table has
    # no curve.
    "crius-1280": cluster_from_dict({
        "name": "crius-1280",
        "network": {"kind": "default", "bandwidth_gbytes_s": 25.0},
        "node_groups": [
            {"gpu_type": "a100", "nodes": 80, "gpus_per_node": 4},
            {"gpu_type": "a40", "nodes": 160, "gpus_per_node": 2, "network": {"kind": "infiniband"}},
            {"gpu_type": "a10", "nodes": 160, "gpus_per_node": 2},
            {"gpu_type": "v100", "nodes": 20, "gpus_per_node": 16},
        ],
    }),
    # The local lab cluster (`slurm-ext lab up`): fake GPUs, one partition per type.
    "lab": cluster_from_dict({
        "name": "lab",
        "node_groups": [
            {"gpu_type": "a100", "nodes": 2, "gpus_per_node": 4},
            {"gpu_type": "v100", "nodes": 2, "gpus_per_node": 4},
            {"gpu_type": "a10", "nodes": 2, "gpus_per_node": 2},
            {"gpu_type": "h100", "nodes": 1, "gpus_per_node": 8},
        ],
    }),
}
