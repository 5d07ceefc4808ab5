"""The precision the runner trains in: an fp16 model's compute dtype per GPU generation,
and fp16's dynamic loss scaling (jmp's ``DynamicLossScale``).

Weights, optimizer states and gradient sums are fp32 whatever the model's dtype. An fp16
model computes in bf16 where the tensor cores take bf16 (``training_arch``), and in fp16
with loss scaling where they take fp16 only (Volta).

An fp16 model's gradients are small: the loss is a mean over the global batch's tokens, so
the gradient each token's logits receive, and most activation gradients behind them, fall
below fp16's smallest normal (6e-5) or its smallest subnormal (6e-8) and round to zero.
The backward pass is therefore seeded with the loss times a scale (``2**15`` to start);
the weight gradients, accumulated in fp32 for the fp32 master weights, are divided by it
before the update. A step whose scaled gradients overflowed (any inf or NaN on any device)
is skipped everywhere, and the scale halves; after ``LOSS_SCALE_PERIOD_STEPS`` good steps
in a row it doubles. Each skip is logged; ``SKIPS_AT_SCALE_ONE_LIMIT`` skips in a row at
scale 1 (the gradients not finite even unscaled: the model diverged) stop the training.
The scale and its count of good steps travel in the checkpoint's metadata, so a resumed
job neither repeats the search nor loses the steps it took.

Models in bf16 and fp32 are not scaled: bf16 has fp32's range.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from types import MappingProxyType

import jax
import jax.numpy as jnp
import jmp
import numpy as np
from jax import lax

from estimator.gpus import CATALOG
from job_scripts.checkpoint import CheckpointError

log = logging.getLogger(__name__)

INITIAL_LOSS_SCALE = 2.0**15
LOSS_SCALE_PERIOD_STEPS = 2000  # good steps in a row before the scale doubles (jmp's and Megatron's default)
SKIPS_AT_SCALE_ONE_LIMIT = 8
# The scale a timed step runs at (tuning, benchmarks): 1, so that no timed step overflows
# and skips its update, which would make it cheaper than a training step.
TIMING_LOSS_SCALE = MappingProxyType({"scale": 1.0, "good_steps": 0})
# Device kinds' words for GPUs of a catalog type's generation and tensor cores.
DEVICE_WORDS = {"v100s": "v100", "gv100": "v100"}


def training_arch(arch, gpu_name: str, bf16_tensor_cores: bool | None = None):
    """The architecture the runner trains on ``gpu_name``: an fp16 model in bf16 where the
    tensor cores take bf16 (Ampere and later: the same rate and bytes, so the estimates
    hold, and fp32's range, so no loss scaling and no skipped steps); in fp16 with dynamic
    loss scaling (below) where they take fp16 only (Volta, Turing), on which bf16 would
    run at the CUDA cores' fp32 rate. ``bf16_tensor_cores``: what the device itself says
    (``device_takes_bf16``), which decides; without it, the catalog type's, and a type
    outside the catalog counts as a recent one."""
    if bf16_tensor_cores is None:
        gpu = CATALOG.get((gpu_name or "").strip().lower())
        bf16_tensor_cores = gpu is None or gpu.bf16_tensor_cores
    if arch.compute_dtype != "fp16" or not bf16_tensor_cores:
        return arch
    return replace(arch, compute_dtype="bf16")


def device_takes_bf16(device) -> bool | None:
    """Whether a GPU's tensor cores take bf16, from its CUDA compute capability (8.0 and
    later: Ampere on; a T4's 7.5 or a V100's 7.0 take fp16 only); None where the device
    does not say (a CPU, a platform without one)."""
    try:
        return int(str(getattr(device, "compute_capability", "")).split(".")[0]) >= 8
    except ValueError:
        return None


def catalog_type_of_device(device_kind: str) -> str | None:
    """The catalog GPU type a device's kind names as a word (``NVIDIA A100-SXM4-40GB`` →
    a100, not a10; ``Tesla V100S-PCIE-32GB`` and ``Quadro GV100``, Volta too, → v100), or
    None (a CPU)."""
    for word in re.findall(r"[a-z0-9]+", device_kind.lower()):
        word = DEVICE_WORDS.get(word, word)
        if word in CATALOG:
            return word
    return None


class DivergedError(RuntimeError):
    """The model diverged: an fp16 model's gradients stayed non-finite without loss
    scaling, or a bf16 or fp32 model's loss is not finite."""


def new_loss_scale(sharding, saved: dict | None = None) -> jmp.DynamicLossScale:
    """The loss scale to start from: a checkpoint's (``to_json``), else (None: a fresh
    start, or a checkpoint of a run in bf16) the initial one,
    placed replicated by ``sharding`` (every process passes the same values)."""
    try:
        scale = float(saved["scale"]) if saved is not None else INITIAL_LOSS_SCALE
        good_steps = int(saved["good_steps"]) if saved is not None else 0
    except (KeyError, TypeError, ValueError):
        scale, good_steps = float("nan"), 0
    if not (np.isfinite(scale) and scale >= 1.0) or not 0 <= good_steps < LOSS_SCALE_PERIOD_STEPS:
        raise CheckpointError(f"the checkpoint's loss scale {saved!r} is not one (expected {{'scale': ≥ 1, "
                              f"'good_steps': 0 … {LOSS_SCALE_PERIOD_STEPS - 1}}}): mend its meta/metadata "
                              "or use a new checkpoint directory")
    return from_arrays(jax.device_put(np.float32(scale), sharding), jax.device_put(np.int32(good_steps), sharding))


def as_arrays(loss_scale: jmp.DynamicLossScale) -> tuple[jax.Array, jax.Array]:
    """The scale and its good steps, as a jitted program takes and returns them."""
    return loss_scale.loss_scale, loss_scale.counter


def from_arrays(scale: jax.Array, good_steps: jax.Array) -> jmp.DynamicLossScale:
    """``as_arrays``' inverse."""
    return jmp.DynamicLossScale(scale, good_steps, period=LOSS_SCALE_PERIOD_STEPS)


def to_json(loss_scale: jmp.DynamicLossScale) -> dict:
    """The scale and its good steps, for a checkpoint's metadata (reads the device)."""
    return {"scale": float(loss_scale.loss_scale), "good_steps": int(loss_scale.counter)}


def check_step(step: int, finite: bool, scale: float, skips_at_one: int) -> int:
    """After a scaled step that ran with loss scale ``scale``: log it if it was skipped,
    and return how many steps in a row were skipped at scale 1 (``skips_at_one`` before it).

    Raises:
        DivergedError: ``SKIPS_AT_SCALE_ONE_LIMIT`` of them.
    """
    if finite:
        return 0
    log.warning("step %d skipped: its fp16 gradients overflowed at loss scale %g (the scale halves)", step, scale)
    skips_at_one = skips_at_one + 1 if scale <= 1.0 else 0
    if skips_at_one >= SKIPS_AT_SCALE_ONE_LIMIT:
        raise DivergedError(f"{skips_at_one} steps in a row (to step {step}) had non-finite fp16 gradients "
                            "even unscaled: the model diverged; training stopped, its last checkpoint kept")
    return skips_at_one


def finite_everywhere(buffers: dict, axes: tuple[str, ...]) -> jax.Array:
    """Inside ``shard_map``: whether every device's ``buffers`` are all finite (one bool
    that all devices agree on, so all take the same branch, and the same collectives)."""
    local = jmp.all_finite(buffers).astype(jnp.int32)
    return lax.pmin(local, axes) > 0


def unscale(buffers: dict, loss_scale: jmp.DynamicLossScale) -> dict:
    """Gradient buffers divided by the scale, each in its own dtype."""
    inv = 1.0 / loss_scale.loss_scale
    return {dt: b * inv.astype(b.dtype) for dt, b in buffers.items()}
