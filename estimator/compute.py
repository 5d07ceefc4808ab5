"""Compute model: a roofline per kernel class with a few efficiency parameters per GPU type.

A layer's time is its matmul-class FLOPs at the attained fraction of the GPU's peak tensor
rate, plus the bytes its memory-bound (elementwise, normalisation, softmax) kernels move at
the attained fraction of memory bandwidth, plus a fixed launch overhead per layer pass.
Small kernels reach less of the peak: the attained rate falls off as
work / (work + half_rate_gflop). The parameters are physical — fractions of datasheet
peaks and a work size — so they carry to GPU types
without measurements (``DEFAULT_EFFICIENCY``). How they were fitted, on which rows, and the
accuracy on the others: ``benchmarks/estimator_accuracy.py`` and ``docs/estimator.md``.
"""

from dataclasses import dataclass

from estimator.gpus import GpuType
from estimator.models import LayerSpec


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


# Fitted with `python benchmarks/estimator_accuracy.py --fit` on its fixed fit subset (a
# third of the measured table, chosen by a hash of each row's key); the other rows measure
# accuracy. GPU types without measurements get the median of each fitted field.
FITTED_EFFICIENCY: dict[str, Efficiency] = {
    "a100": Efficiency(0.6602, 0.6559, 0.8875, 6e-6, 59.8, 0.9968),
    "v100": Efficiency(0.7945, 0.7065, 0.6329, 456e-6, 63.7, 1.0),
    "a40": Efficiency(0.6866, 0.2993, 0.9, 438e-6, 4.9, 0.1508),
    "a10": Efficiency(0.5247, 0.2173, 0.823, 140e-6, 19.1, 0.3874),
}


def unmeasured_efficiency(fitted: dict[str, Efficiency]) -> Efficiency:
    """What a GPU type without measurements gets: per field, the median of the fitted
    types' values (the upper one of an even count)."""
    return Efficiency(*(sorted(getattr(e, f) for e in fitted.values())[len(fitted) // 2]
                        for f in ("matmul_frac", "conv_frac", "memory_frac", "layer_overhead_s",
                                  "half_rate_gflop", "inter_node_frac")))


DEFAULT_EFFICIENCY = unmeasured_efficiency(FITTED_EFFICIENCY)


def efficiency(gpu: GpuType, table: dict[str, Efficiency] | None = None) -> Efficiency:
    table = FITTED_EFFICIENCY if table is None else table
    return table.get(gpu.name, DEFAULT_EFFICIENCY)


def layer_time_s(layer: LayerSpec, gpu: GpuType, eff: Efficiency, dtype: str, samples: float,
                 tp: int, passes: float, flops_scale: float = 1.0) -> float:
    """Seconds for ``passes`` forward-equivalents of one layer over ``samples`` on tp GPUs.

    A backward pass costs two forward passes; rematerialization adds one. ``flops_scale``
    corrects the layer's FLOPs (compiled / formula) when a compiler counted them.
    """
    if dtype == "fp32":
        # fp32 training ran its convolutions and matmuls on CUDA cores (no TF32).
        rate = gpu.fp32_tflops * 1e12 * eff.conv_frac
    else:
        rate = gpu.peak_tflops(dtype) * 1e12 * eff.matmul_frac
    work_flop = layer.flops_fwd * samples / tp * flops_scale
    occupancy = work_flop / (work_flop + eff.half_rate_gflop * 1e9) if work_flop > 0 else 1.0
    flops_s = work_flop / (rate * occupancy)
    shared = layer.activation_bytes_tp_shared / max(layer.activation_bytes, 1.0)
    moved = layer.elementwise_bytes * samples * (shared + (1.0 - shared) / tp)
    memory_s = moved / (gpu.memory_bandwidth_gbytes_s * 1e9 * eff.memory_frac)
    return passes * (flops_s + memory_s + eff.layer_overhead_s)
