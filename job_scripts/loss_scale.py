"""Dynamic loss scaling for fp16 training, with jmp's ``DynamicLossScale``.

An fp16 model's gradients are small: the loss is a mean over the global batch's tokens, so
the gradient each token's logits receive, and most activation gradients behind them, fall
below fp16's smallest normal (6e-5) or its smallest subnormal (6e-8) and round to zero.
The backward pass is therefore seeded with the loss times a scale (``2**15`` to start);
the weight gradients, accumulated in fp32 for the fp32 master weights, are divided by it
before the update. A step whose scaled gradients overflowed (any inf or NaN on any device)
is skipped everywhere, and the scale halves; after ``LOSS_SCALE_PERIOD`` good steps in a
row it doubles. The scale and its count of good steps travel in the checkpoint's metadata,
so a resumed job neither repeats the search nor loses the steps it took.

Models in bf16 and fp32 are not scaled: bf16 has fp32's range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp
import numpy as np
from jax import lax

from job_scripts.checkpoint import CheckpointError

INITIAL_LOSS_SCALE = 2.0**15
LOSS_SCALE_PERIOD = 2000  # good steps in a row before the scale doubles (jmp's and Megatron's default)


def new_loss_scale(sharding, saved: dict | None = None, period: int = LOSS_SCALE_PERIOD) -> jmp.DynamicLossScale:
    """The loss scale to start from: a checkpoint's (``to_json``), else (None: a fresh
    start, or a checkpoint of a run in bf16) the initial one,
    placed replicated by ``sharding`` (every process passes the same values)."""
    try:
        scale = float(saved["scale"]) if saved is not None else INITIAL_LOSS_SCALE
        good_steps = int(saved["good_steps"]) if saved is not None else 0
    except (KeyError, TypeError, ValueError):
        scale, good_steps = float("nan"), 0
    if not (np.isfinite(scale) and scale >= 1.0) or not 0 <= good_steps < period:
        raise CheckpointError(f"the checkpoint's loss scale {saved!r} is not one: "
                              "expected {'scale': ≥ 1, 'good_steps': 0 … %d}" % (period - 1))
    return jmp.DynamicLossScale(jax.device_put(np.float32(scale), sharding),
                                jax.device_put(np.int32(good_steps), sharding), period=period)


def as_arrays(loss_scale: jmp.DynamicLossScale) -> tuple[jax.Array, jax.Array]:
    """The scale and its good steps, as a jitted program takes and returns them."""
    return loss_scale.loss_scale, loss_scale.counter


def from_arrays(scale: jax.Array, good_steps: jax.Array, period: int) -> jmp.DynamicLossScale:
    """``as_arrays``' inverse."""
    return jmp.DynamicLossScale(scale, good_steps, period=period)


def to_json(loss_scale: jmp.DynamicLossScale) -> dict:
    """The scale and its good steps, for a checkpoint's metadata (reads the device)."""
    return {"scale": float(loss_scale.loss_scale), "good_steps": int(loss_scale.counter)}


def finite_everywhere(buffers: dict, axes: tuple[str, ...]) -> jax.Array:
    """Inside ``shard_map``: whether every device's ``buffers`` are all finite (one bool
    that all devices agree on, so all take the same branch, and the same collectives)."""
    local = jmp.all_finite(buffers).astype(jnp.int32)
    return lax.pmin(local, axes) > 0


def unscale(buffers: dict, loss_scale: jmp.DynamicLossScale) -> dict:
    """Gradient buffers divided by the scale, each in its own dtype."""
    inv = 1.0 / loss_scale.loss_scale
    return {dt: b * inv.astype(b.dtype) for dt, b in buffers.items()}
