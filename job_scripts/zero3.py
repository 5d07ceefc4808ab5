"""ZeRO-3: a stage's weights split over its data-parallel group, gathered layer by layer.

Under ZeRO-3 (Rajbhandari et al., 2020) a device keeps 1/dp of its stage's float32
weights, as it keeps 1/dp of the optimizer state and of the gradient accumulator. The
split is per layer (:class:`~job_scripts.packing.Chunking`, one region per layer): rank r
keeps chunk r of every layer's weights, so one layer's weights are gathered alone, right
before the layer runs, and freed after it:

- forward: the layer's chunk is cast to the compute dtype and all-gathered over dp
  (:func:`gather_layer`), unpacked and run;
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

    def layer_leaves(self, index: int, region: jax.Array) -> list:
        """Layer ``index`` (of the stage)'s weight arrays, in order, from its gathered region."""
        _, size = self.chunking.regions[index]
        return unpack(self._layer_layouts[index], {SEGMENT_DTYPE: region[:size]})

    def layer_tree(self, index: int, leaves: list):
        return jax.tree.unflatten(self.base.treedefs[index], leaves)

    def pack_pieces(self, pieces: list[jax.Array], lengths: dict[str, int]) -> dict:
        """A device's buffer from its per-layer chunks (gradients), padded to ``lengths``."""
        n = lengths[SEGMENT_DTYPE] - self.chunking.length
        parts = list(pieces) + ([jnp.zeros((n,), jnp.float32)] if n else [])
        return {SEGMENT_DTYPE: jnp.concatenate(parts) if len(parts) > 1 else parts[0]}

    def local_of_packed(self, packed: dict, dp_rank, lengths: dict[str, int]) -> dict:
        """A fresh device buffer from the stage's whole packed weights (initialisation)."""
        return self.pack_pieces([self.chunking.local_of_packed(packed[SEGMENT_DTYPE], dp_rank)], lengths)


def gathered_layer(layer, weights, axes: tuple[str, ...], split: int, dtype, remat: bool):
    """``layer(leaves, state, x) -> (y, new state)``, which takes a layer's weight arrays,
    as a function of this device's chunk ``piece`` of them instead: ``weights(region)``
    unpacks the gathered flat region into those arrays. The forward gathers the region (in
    ``dtype``, over the ``split`` devices of ``axes``) and runs the layer, keeping its
    inputs (``remat``) or the residuals of its backward less the gathered weights; the
    backward gathers the region again, runs the layer's backward (recomputing its forward
    under remat) and reduce-scatters the weights' gradient in float32 (each device gets
    its chunk of the dp sum).

    Optimization barriers order the collectives with the layer chain: a layer's gather
    waits for its input (forward) or its output's cotangent (backward), and its input's
    cotangent waits for its reduce-scatter. Without them XLA's GPU scheduler was free to
    gather every layer's weights at the start of the backward and reduce-scatter every
    layer's gradient at its end (the GPU-target compile of gpt-760m on 8 devices held all
    24 blocks' gathered weights and float32 gradients at once: 4.9 GB against 2.9)."""
    gather = _Gather(axes, split, dtype, weights, remat)

    def run(piece, state, x):
        leaves = jax.eval_shape(weights, jax.ShapeDtypeStruct((piece.shape[0] * split,), dtype))
        converted, traced = _explicit_closure(layer, leaves, state, x)
        return _gathered(converted, gather, piece, state, x, traced)
    return run


class _Gather:
    """What one gathered layer's forward and backward share. Without remat, ``kept``: the
    structure of the layer's vjp and, per residual, its index among the gathered weights
    (taken again in the backward) or None (kept)."""

    def __init__(self, axes, split: int, dtype, weights, remat: bool):
        self.axes, self.split, self.dtype, self.weights, self.remat = axes, split, dtype, weights, remat
        self.kept = None

    def leaves(self, piece):
        return self.weights(lax.all_gather(piece.astype(self.dtype), self.axes, tiled=True))

    def reduce(self, g_leaves, chunk: int):
        """This device's chunk of the dp sum of the weights' gradient, in float32."""
        flat = jnp.concatenate([jnp.ravel(g) for g in g_leaves])
        flat = jnp.pad(flat, (0, chunk * self.split - flat.shape[0]))
        return lax.psum_scatter(flat.astype(jnp.float32), self.axes, scatter_dimension=0, tiled=True)


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


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gathered(layer, gather, piece, state, x, consts):
    return layer(gather.leaves(piece), state, x, *consts)


def _gathered_forward(layer, gather, piece, state, x, consts):
    # Kept: the inputs themselves (a pipeline recognises its weights among them and does
    # not stash them), not the barrier's copies.
    after, h = lax.optimization_barrier((piece, x))
    leaves = gather.leaves(after)
    if gather.remat:
        return layer(leaves, state, h, *consts), (piece, (state, x, consts))
    out, vjp = jax.vjp(lambda ws, s, xx, cs: layer(ws, s, xx, *cs), leaves, state, h, consts)
    residuals = jax.tree.leaves(vjp)
    kinds = [next((k for k, w in enumerate(leaves) if r is w), None) for r in residuals]
    gather.kept = (jax.tree.structure(vjp), kinds)
    return out, (piece, tuple(r for r, k in zip(residuals, kinds) if k is None))


def _gathered_backward(layer, gather, saved, cotangent):
    piece, rest, cotangent = lax.optimization_barrier((*saved, cotangent))
    leaves = gather.leaves(piece)
    if gather.remat:
        state, x, consts = rest
        _, vjp = jax.vjp(lambda ws, s, xx, cs: layer(ws, s, xx, *cs), leaves, state, x, consts)
    else:
        treedef, kinds = gather.kept
        kept = iter(rest)
        vjp = jax.tree.unflatten(treedef, [leaves[k] if k is not None else next(kept) for k in kinds])
    g_leaves, g_state, g_x, g_consts = vjp(cotangent)
    g_piece, g_x = lax.optimization_barrier((gather.reduce(g_leaves, piece.shape[0]), g_x))
    return g_piece, g_state, g_x, g_consts


_gathered.defvjp(_gathered_forward, _gathered_backward)
