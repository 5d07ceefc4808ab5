"""ZeRO-3: a stage's weights split over its data-parallel group, gathered layer by layer.

Under ZeRO-3 (Rajbhandari et al., 2020) a device keeps 1/dp of its stage's float32
weights, as it keeps 1/dp of the optimizer state and of the gradient accumulator. The
split is per layer (:class:`~job_scripts.packing.Chunking`, one region per layer): rank r
keeps chunk r of every layer's weights, so one layer's weights are gathered alone, right
before the layer runs, and freed after it:

- forward: the layer's chunk is cast to the compute dtype and all-gathered over dp
  (:func:`gathered_layer`), unpacked and run;
- backward: under remat the layer's forward is recomputed, gather included; the
  gathered weights' gradient is reduce-scattered over dp in float32, so each device
  receives its chunk of the data-parallel sum and no whole gradient is ever held.

The step therefore holds one layer's gathered weights and gradient at a time (two
gathers and a reduce-scatter of each layer per micro-batch), and the optimizer steps each
device's chunks with no gather after it (``FlatOptArrays.update(split_weights=True)``).
Without remat the gathered weights would be kept from a layer's forward to its backward,
all layers at once: the runner runs ZeRO-3 with remat only (``job_scripts.plan``).

A checkpoint names the same arrays as every other plan's; :class:`SplitParams` tells a
reader where each rank saved which part (``segments_json``: the per-layer regions).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax

from job_scripts.flat_optimizer import SEGMENT_DTYPE, SplitBuffers
from job_scripts.packing import Chunking, FlatLayout, Slot, unpack
from job_scripts.stage_arrays import StageArrays


def layer_chunking(params: StageArrays, split: int) -> Chunking:
    """Each layer's weights (contiguous in the stage's float32 buffer) as one region."""
    regions, i = [], 0
    for count in params.counts:
        slots = params.layout.slots[i:i + count]
        i += count
        start = slots[0].offset if slots else 0
        regions.append((start, sum(s.size for s in slots)))
    return Chunking(tuple(regions), split)


class SplitParams(SplitBuffers):
    """A stage's weights under ZeRO-3: each device holds chunk ``dp rank`` of every layer's
    (``chunking``), in a buffer of ``chunk`` elements (the pipeline's joint length)."""

    def __init__(self, base: StageArrays, chunking: Chunking, chunk: int):
        dtypes = {dt for dt, n in base.layout.lengths if n}
        if dtypes - {SEGMENT_DTYPE}:
            raise ValueError(f"ZeRO-3 splits {SEGMENT_DTYPE} weights; this stage has {sorted(dtypes)}")
        self.base, self.chunking, self.chunk, self.segments = base, chunking, chunk, 1
        self.leaves = base.leaves
        self.layout = base.layout
        self.local_lengths = {SEGMENT_DTYPE: chunk}
        # Per layer, its slots relative to its region (what a gathered region unpacks to).
        self._layer_layouts, i = [], 0
        for count, (start, size) in zip(base.counts, chunking.regions):
            slots = tuple(Slot(s.dtype, s.offset - start, s.shape) for s in base.layout.slots[i:i + count])
            self._layer_layouts.append(FlatLayout(slots, ((SEGMENT_DTYPE, size),)))
            i += count

    def to_json(self) -> list[dict]:
        return self.base.to_json()

    # -- inside the step

    def pieces(self, params_b: dict) -> list[jax.Array]:
        """Per layer, this device's chunk of its weights (slices of the device's buffer)."""
        buf = params_b[SEGMENT_DTYPE]
        return [lax.slice_in_dim(buf, at, at + c) for at, c in zip(self.chunking.offsets, self.chunking.chunks)]

    def layer_weights(self, index: int, region: jax.Array):
        """Layer ``index`` (of the stage)'s weight tree from its gathered region."""
        _, size = self.chunking.regions[index]
        leaves = unpack(self._layer_layouts[index], {SEGMENT_DTYPE: region[:size]})
        return jax.tree.unflatten(self.base.treedefs[index], leaves)

    def pack_pieces(self, pieces: list[jax.Array], lengths: dict[str, int]) -> dict:
        """A device's buffer from its per-layer chunks (gradients), padded to ``lengths``."""
        n = lengths[SEGMENT_DTYPE] - self.chunking.length
        parts = list(pieces) + ([jnp.zeros((n,), jnp.float32)] if n else [])
        return {SEGMENT_DTYPE: jnp.concatenate(parts) if len(parts) > 1 else parts[0]}

    def local_of_packed(self, packed: dict, dp_rank, lengths: dict[str, int]) -> dict:
        """A fresh device buffer from the stage's whole packed weights (initialisation)."""
        return self.pack_pieces([self.chunking.local_of_packed(packed[SEGMENT_DTYPE], dp_rank)], lengths)


def gathered_layer(layer, axes: tuple[str, ...], split: int, dtype):
    """``layer(region, state, x) -> (y, new state)``, which takes a layer's whole weights
    as one flat ``region``, as a function of this device's chunk ``piece`` instead, under
    rematerialization: the forward gathers the region (in ``dtype``, over the ``split``
    devices of ``axes``) and keeps only its inputs; the backward gathers it again, runs
    the layer's backward and reduce-scatters the region's gradient in float32 (each device
    gets its chunk of the dp sum).

    Optimization barriers order the collectives with the layer chain: a layer's gather
    waits for its input (forward) or its output's cotangent (backward), and its input's
    cotangent waits for its reduce-scatter. Without them XLA's GPU scheduler was free to
    gather every layer's weights at the start of the backward and reduce-scatter every
    layer's gradient at its end (the GPU-target compile of gpt-760m on 8 devices held all
    24 blocks' gathered weights and float32 gradients at once: 4.9 GB against 2.9)."""
    def run(piece, state, x):
        region = jax.ShapeDtypeStruct((piece.shape[0] * split,), dtype)
        converted, traced = _explicit_closure(layer, region, state, x)
        return _gathered(converted, axes, dtype, piece, state, x, traced)
    return run


def _explicit_closure(fn, *example):
    """``fn`` as a function of its arguments and of the traced values it closes over (the
    last layer's labels), and those values: the backward of a pipeline's stage runs in
    another trace than its forward, so they must travel as inputs (``jax.closure_convert``
    hoists only floating-point ones)."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*example)
    is_traced = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    traced = tuple(c for c, t in zip(closed.consts, is_traced) if t)
    out_tree = jax.tree.structure(shape)

    def converted(*args_and_traced):
        args, values = args_and_traced[:len(example)], iter(args_and_traced[len(example):])
        consts = [next(values) if t else c for c, t in zip(closed.consts, is_traced)]
        out = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(closed.jaxpr, consts))(*jax.tree.leaves(args))
        return jax.tree.unflatten(out_tree, out)
    return converted, traced


def _gather(piece, axes, dtype):
    return lax.all_gather(piece.astype(dtype), axes, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gathered(layer, axes, dtype, piece, state, x, consts):
    return layer(_gather(piece, axes, dtype), state, x, *consts)


def _gathered_forward(layer, axes, dtype, piece, state, x, consts):
    # Kept: the inputs themselves (a pipeline recognises its weights among them and does
    # not stash them), not the barrier's copies.
    after, h = lax.optimization_barrier((piece, x))
    return layer(_gather(after, axes, dtype), state, h, *consts), (piece, state, x, consts)


def _gathered_backward(layer, axes, dtype, saved, cotangent):
    piece, state, x, consts, cotangent = lax.optimization_barrier((*saved, cotangent))
    _, vjp = jax.vjp(lambda region, s, h, cs: layer(region, s, h, *cs), _gather(piece, axes, dtype), state, x, consts)
    g_region, g_state, g_x, g_consts = vjp(cotangent)
    g_piece = lax.psum_scatter(g_region.astype(jnp.float32), axes, scatter_dimension=0, tiled=True)
    g_piece, g_x = lax.optimization_barrier((g_piece, g_x))
    return g_piece, g_state, g_x, g_consts


_gathered.defvjp(_gathered_forward, _gathered_backward)
