"""Compute model: a roofline per kernel class, its parameters derived from each GPU's datasheet.

A layer's time is its matmul-class FLOPs at the attained fraction of the GPU's peak tensor
rate, plus the bytes its memory-bound kernels (elementwise, normalisation, softmax) and its
weight reads move at the attained fraction of memory bandwidth, plus a fixed launch
overhead per layer pass. Small kernels reach less of the peak: the attained rate falls off
as work / (work + half_rate_gflop), and the work that half-fills a GPU grows with its SM
count. Convolutions (``LayerSpec.kernels``) are costed kernel by kernel, their occupancy
from their output elements (the thread blocks that tile the output), not their FLOPs.

The per-type parameters (``Efficiency``) are not fitted per type: ``datasheet_efficiency``
derives them from the GPU's datasheet (peaks, memory bandwidth, SM count, fp32 issue rate,
NVLink or PCIe-only nodes) and one set of ``SharedPhysics`` fitted across every measured
GPU type. A type nobody measured gets its own datasheet's physics. A site's profile or the
online refit may still override one type's ``Efficiency`` (``efficiency(gpu, table)``).
How the shared set was fitted, on which rows, and the accuracy on the others, a held-out
GPU type included: ``benchmarks/estimator_accuracy.py`` and ``docs/estimator.md``.
"""

from dataclasses import dataclass

from estimator.gpus import CATALOG, GpuType
from estimator.models import DTYPE_BYTES, LayerSpec


@dataclass(frozen=True)
class Efficiency:
    """Attained fractions of datasheet peaks on one GPU type."""

    matmul_frac: float  # of the fp16/bf16 tensor rate, transformer matmuls
    conv_frac: float  # of the plain fp32 rate, fp32 convolutions and matmuls
    memory_frac: float  # of memory bandwidth, memory-bound kernels
    layer_overhead_s: float  # launches and synchronisation per layer per pass
    # Work per kernel (GFLOP of one layer pass on one GPU) at which half the attainable rate
    # is reached: small micro-batches on many GPUs leave the GPU under-occupied.
    half_rate_gflop: float = 0.0
    # Attained fraction of the profiled inter-node collective bandwidth during training
    # (microbenchmarks run alone; training shares PCIe and the NIC with everything else).
    inter_node_frac: float = 1.0
    # Convolutions (layers with ``LayerSpec.kernels``): the output elements of one kernel
    # that half-fill the GPU (0: their FLOPs against ``half_rate_gflop``, as matmuls).
    conv_half_outputs: float = 0.0


@dataclass(frozen=True)
class SharedPhysics:
    """Efficiency parameters shared by every GPU type; ``datasheet_efficiency`` turns them
    into one type's ``Efficiency`` with that type's datasheet."""

    matmul_frac: float  # of the fp16/bf16 tensor peak
    fp32_issue_frac: float  # of the fp32 rate the GPU can issue (``GpuType.fp32_issue_frac``)
    memory_frac: float  # of memory bandwidth
    layer_overhead_s: float  # per layer per pass: host and launch cost, not the GPU's
    half_rate_gflop_per_sm: float  # kernel work that half-fills the GPU, per SM
    inter_node_frac_nvlink: float  # training's share of the profiled inter-node bandwidth
    inter_node_frac_pcie: float  # the same where the node's GPUs, NIC and host share PCIe
    # Convolution output elements that half-fill the GPU, thousands per SM (a thread block's
    # output tile is 64×64 to 128×128 elements).
    conv_half_outputs_k_per_sm: float = 0.0


def datasheet_efficiency(gpu: GpuType, physics: "SharedPhysics | None" = None) -> Efficiency:
    """One GPU type's parameters from its datasheet and the shared physics."""
    p = FITTED_PHYSICS if physics is None else physics
    return Efficiency(p.matmul_frac, p.fp32_issue_frac * gpu.fp32_issue_frac, p.memory_frac,
                      p.layer_overhead_s, p.half_rate_gflop_per_sm * gpu.sm_count,
                      p.inter_node_frac_pcie if gpu.pcie_only else p.inter_node_frac_nvlink,
                      p.conv_half_outputs_k_per_sm * 1e3 * gpu.sm_count)


# Fitted with `python benchmarks/estimator_accuracy.py --fit` on its fixed fit subset (a
# third of the measured table, chosen by a hash of each row's key) of all four measured
# types at once; the other rows measure accuracy, and leaving one type out of the fit
# measures what a type nobody measured gets. The launch overhead is held at 59.5 µs, not
# fitted (the table does not determine it; the H100's and H200's measured steps want it).
FITTED_PHYSICS = SharedPhysics(0.691, 0.7957, 0.9222, 59.5e-6, 0.7221, 1.0, 0.2004, 19.0616)

# What every catalog type gets without a profile or a refit.
FITTED_EFFICIENCY: dict[str, Efficiency] = {name: datasheet_efficiency(g) for name, g in CATALOG.items()}


def efficiency(gpu: GpuType, table: dict[str, Efficiency] | None = None) -> Efficiency:
    """The type's parameters: ``table``'s entry when it has one (a profile, a refit, a fit
    in progress), else the type's datasheet physics."""
    if table is not None and gpu.name in table:
        return table[gpu.name]
    return FITTED_EFFICIENCY.get(gpu.name) or datasheet_efficiency(gpu)


def layer_time_s(layer: LayerSpec, gpu: GpuType, eff: Efficiency, dtype: str, samples: float,
                 tp: int, passes: float, flops_scale: float = 1.0, *, tf32: bool = False) -> float:
    """Seconds for ``passes`` forward-equivalents of one layer over ``samples`` on tp GPUs.

    A backward pass costs two forward passes; rematerialization adds one. ``flops_scale``
    corrects the layer's FLOPs (compiled / formula) when a compiler counted them. ``tf32``:
    the program runs fp32 convolutions and matmuls on the tensor cores in TF32 where the
    GPU has them (``MemoryOptions.tf32``), at the tensor cores' attained fraction;
    otherwise on the CUDA cores.
    """
    if dtype == "fp32" and tf32 and gpu.tf32_tflops > gpu.fp32_tflops:
        rate = gpu.tf32_tflops * 1e12 * eff.matmul_frac
    elif dtype == "fp32":
        rate = gpu.fp32_tflops * 1e12 * eff.conv_frac
    else:
        rate = gpu.peak_tflops(dtype) * 1e12 * eff.matmul_frac
    if layer.kernels and eff.conv_half_outputs > 0:
        # Convolutions, kernel by kernel: a kernel fills the GPU with its output tiles, so
        # its occupancy is its output elements e / (e + half), not its FLOPs; a late 3×3
        # convolution of a wide network has many FLOPs per output and few outputs per sample.
        flops_s = 0.0
        for kernel_flop, outputs in layer.kernels:
            e = outputs * samples / tp
            flops_s += kernel_flop * samples / tp * flops_scale / rate * (1.0 + eff.conv_half_outputs / e)
    else:
        work_flop = layer.flops_fwd * samples / tp * flops_scale
        occupancy = work_flop / (work_flop + eff.half_rate_gflop * 1e9) if work_flop > 0 else 1.0
        flops_s = work_flop / (rate * occupancy)
    shared = layer.activation_bytes_tp_shared / max(layer.activation_bytes, 1.0)
    moved = layer.elementwise_bytes * samples * (shared + (1.0 - shared) / tp)
    # Every pass reads the layer's weights (its tp shard) once; the backward pass also writes
    # their gradients: one weight's worth per forward-equivalent. What makes a micro-batch of
    # a few tokens per expert, or a few images per GPU, memory-bound.
    moved += layer.params * DTYPE_BYTES.get(dtype, 2) / tp
    memory_s = moved / (gpu.memory_bandwidth_gbytes_s * 1e9 * eff.memory_frac)
    return passes * (flops_s + memory_s + eff.layer_overhead_s)
