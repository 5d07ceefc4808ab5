"""Fitting a GPU type's efficiency parameters to what a profile measured, and reading
profiled layer times.

The parameters are those of ``estimator.compute`` (fractions of datasheet peaks, a work
size at which half the rate is reached, a per-layer overhead), so a fit on a site's own
device keeps their physical meaning:

- **matmuls** in the compute dtype: ``t = (F + h) / R`` — the roofline's occupancy term —
  gives the attained rate ``R`` (``matmul_frac = R / peak``) and the half-rate work ``h``
  (``half_rate_gflop``);
- **fp32 matmuls** at full precision: ``conv_frac`` of the plain fp32 rate;
- **the copy**: ``t = bytes / B + c`` gives ``memory_frac = B / datasheet bandwidth``;
- **layers** (when the profile timed a model's layers): ``layer_overhead_s`` is the median
  of what the layers took beyond the roofline per pass, never below 0.

Each fit is robust least squares on relative errors (soft-L1), so a few noisy timings do
not move it. ``inter_node_frac`` (training's share of the profiled network) is kept from
the type's earlier parameters: a profile measures collectives alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from estimator.compute import Efficiency, layer_time_s
from estimator.gpus import GpuType
from estimator.memory import MemoryOptions
from estimator.profile_store import KernelRow, LayerRow, LayerTiming, model_fingerprint

# Passes of one layer measured as forward + backward: the backward costs two forwards.
FORWARD_BACKWARD_PASSES = 3.0
# The profile times the runner's layers, in its precision (``MemoryOptions.tf32``).
RUNNER_TF32 = MemoryOptions().tf32


@dataclass(frozen=True)
class RateFit:
    """``t = (work + half_work) / rate``: a rate (work per second) and the work at which
    half of it is reached."""

    rate: float
    half_work: float
    median_rel_error: float


def fit_rate(work: Sequence[float], seconds: Sequence[float]) -> RateFit:
    """Robust fit of ``t = (w + h) / R`` (R > 0, h ≥ 0) to measured (work, seconds)."""
    w, t = np.asarray(work, float), np.asarray(seconds, float)
    if len(w) == 0 or np.any(t <= 0):
        raise ValueError("need positive timings")
    if len(w) == 1:
        return RateFit(float(w[0] / t[0]), 0.0, 0.0)
    # The largest work's rate w/t is a lower bound of R. The calibration sizes are chosen to
    # reach at least half the rate (h ≤ the largest work), so R ≤ 2 × that bound: noisy
    # timings that do not grow with the work cannot send the fit off to infinity.
    # Parameters in log space keep R > 0 and h > 0.
    r_min = float(w.max() / t[w.argmax()])
    h_max = float(w.max())
    h0 = min(max(float(np.median(t * r_min - w)), h_max * 1e-6), h_max * 0.5)

    def residuals(x):
        rate, half = math.exp(x[0]), math.exp(x[1])
        return ((w + half) / rate - t) / t

    lower = [math.log(r_min), math.log(h_max * 1e-9)]
    upper = [math.log(2.0 * r_min), math.log(h_max)]
    start = [math.log(r_min * (1.0 + h0 / h_max)), math.log(h0)]
    sol = least_squares(residuals, np.clip(start, lower, np.nextafter(upper, -np.inf)), bounds=(lower, upper),
                        loss="soft_l1", f_scale=0.05)
    rate, half = math.exp(sol.x[0]), math.exp(sol.x[1])
    err = float(np.median(np.abs(residuals(sol.x))))
    return RateFit(rate, half, err)


def fit_efficiency(gpu: GpuType, compute_dtype: str, kernels: Iterable[KernelRow],
                   layers: Iterable[LayerRow] = (), models: dict | None = None,
                   base: Efficiency | None = None) -> tuple[Efficiency, float]:
    """The GPU type's efficiency parameters from a profile, and the fit's median relative
    error over every kernel and layer it used.

    Args:
        gpu: the catalog entry (datasheet peaks).
        compute_dtype: the dtype the profile's matmul kernels ran in (``bf16``, ``fp16``).
        kernels: the profile's calibration kernels.
        layers: the profile's layer rows (for ``layer_overhead_s``).
        models: ``{model fingerprint: ModelSpec}`` of the models the layer rows name.
        base: parameters to keep where the profile says nothing (default: the type's
            current ones from ``estimator.compute``).
    """
    from estimator.compute import efficiency as current
    base = base or current(gpu)
    kernels = list(kernels)
    errors: list[float] = []
    eff = base
    mm = [k for k in kernels if k.kernel == "matmul" and k.dtype == compute_dtype]
    if mm:
        fit = fit_rate([k.flops for k in mm], [k.seconds for k in mm])
        eff = replace(eff, matmul_frac=fit.rate / (gpu.peak_tflops(compute_dtype) * 1e12),
                      half_rate_gflop=fit.half_work / 1e9)
        errors += [abs((k.flops + fit.half_work) / fit.rate - k.seconds) / k.seconds for k in mm]
    mm32 = [k for k in kernels if k.kernel == "matmul" and k.dtype == "fp32"]
    if mm32:
        fit = fit_rate([k.flops for k in mm32], [k.seconds for k in mm32])
        eff = replace(eff, conv_frac=fit.rate / (gpu.fp32_tflops * 1e12))
        errors += [abs((k.flops + fit.half_work) / fit.rate - k.seconds) / k.seconds for k in mm32]
    copies = [k for k in kernels if k.kernel == "copy"]
    if copies:
        fit = fit_rate([k.bytes for k in copies], [k.seconds for k in copies])
        eff = replace(eff, memory_frac=fit.rate / (gpu.memory_bandwidth_gbytes_s * 1e9))
        errors += [abs((k.bytes + fit.half_work) / fit.rate - k.seconds) / k.seconds for k in copies]
    overheads, pairs = [], []
    for row in layers:
        spec = (models or {}).get(row.model_fingerprint)
        if spec is None or row.layer_index >= spec.num_layers:
            continue
        layer = spec.layers[row.layer_index]
        roofline = layer_time_s(layer, gpu, replace(eff, layer_overhead_s=0.0), spec.dtype,
                                row.samples, row.tp, FORWARD_BACKWARD_PASSES, tf32=RUNNER_TF32)
        overheads.append((row.forward_backward_s - roofline) / FORWARD_BACKWARD_PASSES)
        pairs.append((layer, spec.dtype, row))
    if overheads:
        eff = replace(eff, layer_overhead_s=max(0.0, statistics.median(overheads)))
        for layer, dtype, row in pairs:
            t = layer_time_s(layer, gpu, eff, dtype, row.samples, row.tp, FORWARD_BACKWARD_PASSES, tf32=RUNNER_TF32)
            errors.append(abs(t - row.forward_backward_s) / row.forward_backward_s)
    return eff, (statistics.median(errors) if errors else 0.0)


def profiled_layer_s(timing: LayerTiming, samples: float, remat: bool) -> float:
    """Seconds of one layer's forward and backward (plus the recomputed forward under
    remat) for ``samples`` samples on one device, from its profiled timings.

    Between measured sample counts the time is interpolated linearly; past the largest it
    grows at the last interval's per-sample cost (at least the average cost per sample
    of the largest measurement's share above the smallest); below the smallest it scales
    proportionally.
    """
    fb = _interpolate(timing.samples, timing.forward_backward_s, samples)
    return fb + (_interpolate(timing.samples, timing.forward_s, samples) if remat else 0.0)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    if x >= xs[-1]:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        # Timing jitter can flatten the last interval: at least the average cost per
        # sample above the smallest measurement.
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), (ys[-1] - ys[0]) / (xs[-1] - xs[0]), 0.0)
        return ys[-1] + slope * (x - xs[-1])
    return float(np.interp(x, xs, ys))


def fingerprints(model_specs: Iterable) -> dict:
    """``{fingerprint: ModelSpec}`` for the models a profile's layer rows may name."""
    return {model_fingerprint(m): m for m in model_specs}
