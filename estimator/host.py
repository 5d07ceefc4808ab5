"""Host-side facts per GPU type: host memory, its bandwidth and the PCIe link per GPU.

ZeRO-Offload (``estimator.memory``) moves the master weights, the optimizer states and the
update to the host: the Cell estimate needs how much host memory a GPU's share of the node
has, how fast the host's memory streams the update, and how fast gradients and weights
cross PCIe. Defaults describe the usual servers of each generation (datasheets):

- PCIe per GPU, one direction, achievable: Gen3 x16 12 GB/s (v100), Gen4 x16 24 GB/s
  (a100, a40, a10, l20), Gen5 x16 48 GB/s (h100, h200), about 75 % of the link's rate.
- Host memory bandwidth per node, achievable by a streaming update: two sockets of
  8-channel DDR4-3200 ≈ 300 GB/s; DDR5-4800 (h100, h200 servers) ≈ 600 GB/s; shared by the
  node's GPUs.
- Host memory per GPU: 1 TB per 8-GPU node (DGX A100, DGX H100 have 1 TB / 2 TB), i.e.
  128 GB per GPU; a site with other figures passes its own ``HostSpec``.
"""

from dataclasses import dataclass

from estimator.gpus import gpu_type


@dataclass(frozen=True)
class HostSpec:
    """Per-GPU share of a node's host."""

    memory_gb_per_gpu: float = 128.0
    memory_bandwidth_gbytes_s_per_node: float = 300.0
    pcie_gbytes_s: float = 24.0  # per GPU, one direction


_PCIE_GBYTES_S = {"v100": 12.0, "h100": 48.0, "h200": 48.0}
_DDR5_TYPES = ("h100", "h200")


def default_host(gpu_name: str) -> HostSpec:
    """The usual host of a GPU type's servers."""
    g = gpu_type(gpu_name)
    return HostSpec(memory_gb_per_gpu=128.0,
                    memory_bandwidth_gbytes_s_per_node=600.0 if g.name in _DDR5_TYPES else 300.0,
                    pcie_gbytes_s=_PCIE_GBYTES_S.get(g.name, 24.0))
