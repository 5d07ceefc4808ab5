"""An elementwise optimizer stepping a stage's whole flat weight buffer, its state
replicated over the stage's data-parallel group (ZeRO-0) or split over it (ZeRO-1).

A stage keeps its weights in one flat float32 buffer (``job_scripts.packing``). An
optimizer whose update is elementwise (AdamW, SGD with momentum: ``Optimizer.elementwise``)
takes the same step on that buffer as on every array in it, so the step needs no
unpacking into layers and no packing of new buffers: it reads and writes the buffers in
place. Its state is then a small tree on one flat chunk: scalars (AdamW's step count),
kept whole, and *segments*, one flat chunk per weights-shaped tree of the state (AdamW's
μ and ν, SGD's momentum). Adafactor's factored moments and per-array update clipping are
not elementwise; it keeps the per-layer state of ``job_scripts.stage_arrays``.

Under ZeRO-1 (Rajbhandari et al., 2020) each of the stage's ``dp`` devices keeps 1/dp of
the state: chunk r of ``c = L/dp`` elements of the weight buffer (its length L padded to a
multiple of dp) belongs to data-parallel rank r. The gradients are reduce-scattered
instead of all-reduced (the same bytes on a ring), each device steps its chunk, and the
new weights are all-gathered. Weights and gradients stay whole on every device.

Under ZeRO-2 the gradient accumulator is split too: each micro-batch's gradients are
summed over dp array by array as the backward pass leaves them (an all-reduce each, in
place), and a device adds only its chunk of them to its accumulator (the pipeline's
``_gradients``). The step then holds one whole gradient (the micro-batch's, unpacked) and
a 1/dp accumulator instead of two whole buffers, for an all-reduce per micro-batch in
place of one reduce-scatter per step. The chunk is built from the arrays it overlaps
only: a reduce-scatter of the packed buffer (half the bytes) or a slice of the packed sum
let XLA build most of the packed buffer whole (the GPU-target compile of gpt-760m on 4
devices: 12.2 and 10.7 GB, against 10.1 this way and 12.7 under ZeRO-1). The state is
ZeRO-1's, so checkpoints are the same.

Under ZeRO-3 (``job_scripts.zero3``) the weights are split too, per layer: the state's
segments follow the weights' split (a :class:`~job_scripts.packing.Chunking` with one
region per layer instead of one for the whole buffer), the accumulator is already each
rank's chunk of the summed gradients, and the step leaves the weights split.

A device's float32 state buffer is its segments one after the other. A checkpoint names
the same arrays as the per-layer state (``opt/layer_003/mu/wqkv``), so any plan reads any
plan's: :class:`FlatOptArrays` places each by its offset in the stage's *whole* state,
segment k of every rank after segment k−1's (``k·L + offset in the weights``); under
ZeRO-1 ``segments_json`` tells a reader where rank r saved what (``job_scripts.reshard``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from estimator.errors import SpecError
from estimator.memory import UPDATE_PIECE_MIN, UPDATE_PIECES  # ``_step_in_pieces``, as the model counts it
from job_scripts.packing import Chunking, FlatLayout, Slot, flat_layout, pack, unpack
from job_scripts.stage_arrays import Leaf, StageArrays, path_name

# What the pipeline runs: replicated states, states split over dp, gradients split too, and
# weights split too (``job_scripts.zero3``).
ZERO_LEVELS = (0, 1, 2, 3)
SEGMENT_DTYPE = "float32"


def zero_problem(optimizer) -> str:
    """Why this optimizer's state cannot be split over data parallelism ("" if it can):
    its update must be elementwise (Adafactor's factored moments and clipping are not)."""
    if not optimizer.elementwise:
        return (f"ZeRO-1 to 3 split the states of elementwise optimizers (adamw, sgd); "
                f"{optimizer.name} keeps factored ones (use zero=0)")
    return ""


@dataclass(frozen=True)
class _Part:
    """One array of the state on a chunk: a scalar (kept whole) or segment ``k``."""

    name: str  # its path in the state tree without the weights' key ("count", "mu")
    dtype: str
    segment: int | None


class SplitBuffers:
    """Named arrays kept as float32 *segments* of one length, each segment split over the
    stage's data-parallel group by a :class:`Chunking` (``split`` 1: whole on every
    device), and scalars kept whole: what a checkpoint needs of them. Set by subclasses:
    ``base`` (the per-layer :class:`StageArrays` naming the arrays), ``layout`` (the whole
    arrays: segment k from ``k · weights_length``), ``local_lengths`` (one device's
    buffers: segment k from ``k · chunk``), ``chunking`` and ``segments``."""

    base: StageArrays
    layout: FlatLayout
    local_lengths: dict[str, int]
    chunking: Chunking
    segments: int
    chunk: int  # a device's elements per segment (its chunking's, or more: padding)

    @property
    def split(self) -> int:
        return self.chunking.split

    @property
    def weights_length(self) -> int:
        return self.chunking.span

    def shards(self, leaf: Leaf) -> int:
        return self.base.shards(leaf)

    def rank(self, leaf: Leaf, position):
        return self.base.rank(leaf, position)

    def position(self, leaf: Leaf, shard: int) -> int:
        return self.base.position(leaf, shard)

    def segments_json(self) -> dict:
        """How the whole segments lie over the data-parallel ranks (empty when every device
        holds all of them): a rank's ``chunk`` per segment, the whole segment's ``span``
        and the ``regions`` of it cut separately (one under ZeRO-1 and 2, one per layer
        under ZeRO-3). Checkpoints written before ``span`` and ``regions`` were recorded
        had one region of ``dp × chunk``."""
        if self.split == 1:
            return {}
        return {SEGMENT_DTYPE: {"segments": self.segments, "chunk": self.chunk, "span": self.weights_length,
                                "regions": self.chunking.to_json()}}

    def local_of_whole(self, whole: dict[str, np.ndarray], dp_rank: int, lengths: dict[str, int]
                       ) -> dict[str, np.ndarray]:
        """One device's buffers (padded to ``lengths``) from the stage's whole arrays."""
        out = {dt: np.zeros((n,), dt) for dt, n in lengths.items()}
        c, span = self.chunk, self.weights_length
        for k in range(self.segments):
            local = self.chunking.local_of_whole(whole[SEGMENT_DTYPE][k * span:(k + 1) * span], dp_rank)
            out[SEGMENT_DTYPE][k * c:k * c + local.shape[0]] = local
        for dt, n in self.local_lengths.items():
            if dt != SEGMENT_DTYPE:
                out[dt][:n] = whole[dt][:n]
        return out

    def whole_of_locals(self, locals_: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The stage's whole arrays from the buffers of its ``split`` data-parallel ranks."""
        c, span = self.chunk, self.weights_length
        whole = {dt: np.zeros((n,), dt) for dt, n in self.layout.lengths}
        for k in range(self.segments):
            whole[SEGMENT_DTYPE][k * span:(k + 1) * span] = self.chunking.whole_of_locals(
                [bufs[SEGMENT_DTYPE][k * c:(k + 1) * c] for bufs in locals_])
        for dt, n in self.local_lengths.items():
            if dt != SEGMENT_DTYPE:
                whole[dt][:n] = locals_[0][dt][:n]
        return whole


class FlatOptArrays(SplitBuffers):
    """A stage's optimizer state on its flat weight buffer: the same named arrays as the
    per-layer :class:`StageArrays` (``base``), each device holding the state of chunk
    ``dp rank`` of ``split`` (1: the whole buffer, replicated over data parallelism).

    ``layout`` places every array in the stage's whole state (what a checkpoint
    describes); ``local_layout`` sizes one device's buffers."""

    def __init__(self, base: StageArrays, params: StageArrays, weights_length: int, split: int, optimizer,
                 chunking: Chunking | None = None, chunk: int | None = None):
        """``weights_length``: the pipeline's float32 weight buffer length, a multiple of
        ``split``; or (ZeRO-3) the stage's, split by ``chunking`` into device buffers of
        ``chunk`` elements (the pipeline's joint length)."""
        if not optimizer.elementwise:
            raise SpecError("optimizer", optimizer.name, zero_problem(optimizer))
        dtypes = {dt for dt, n in params.layout.lengths if n}
        if dtypes - {SEGMENT_DTYPE}:
            raise SpecError("optimizer", optimizer.name,
                            f"the flat update steps {SEGMENT_DTYPE} weights; this stage has {sorted(dtypes)}")
        if chunking is None and weights_length % split:
            raise ValueError(f"weight buffer of {weights_length} does not split into {split}")
        self.base, self.optimizer = base, optimizer
        self.chunking = chunking or Chunking(((0, weights_length),), split)
        self.chunk = chunk or self.chunking.length
        state = jax.eval_shape(optimizer.init, {"w": jax.ShapeDtypeStruct((self.chunk,), jnp.float32)})
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        parts, segments = [], 0
        for path, leaf in flat:
            parts.append(_Part(path_name(path[:-1] if leaf.shape else path), jnp.dtype(leaf.dtype).name,
                               segments if leaf.shape else None))
            segments += bool(leaf.shape)
        self.parts, self.segments = tuple(parts), segments
        # One device's buffers: the segments one after the other in the float32 buffer,
        # the scalars in their dtype's.
        self.local_layout = flat_layout([leaf for _, leaf in flat])
        self.local_lengths = dict(self.local_layout.lengths)
        self.leaves: list[Leaf] = base.leaves
        weights = {leaf.name: slot.offset for leaf, slot in zip(params.leaves, params.layout.slots)}
        whole = {**self.local_lengths, SEGMENT_DTYPE: segments * self.weights_length}
        self.layout = FlatLayout(tuple(self._slot(leaf, slot, weights) for leaf, slot in
                                       zip(base.leaves, base.layout.slots)), tuple(sorted(whole.items())))

    def _slot(self, leaf: Leaf, slot: Slot, weights: dict[str, int]) -> Slot:
        """Where one named state array lies in the stage's whole state: a scalar at its
        part's place (every layer's step count is the same one), an array in its segment
        at its weight's offset."""
        layer, _, rest = leaf.name.partition("/")[2].partition("/")
        for part in self.parts:
            if part.segment is None and rest == part.name:
                same = [p for p in self.parts if p.segment is None and p.dtype == part.dtype]
                return Slot(part.dtype, same.index(part), slot.shape)
            weight = f"params/{layer}/{rest[len(part.name) + 1:]}"
            if part.segment is not None and rest.startswith(part.name + "/") and weight in weights:
                return Slot(SEGMENT_DTYPE, part.segment * self.weights_length + weights[weight], slot.shape)
        raise SpecError("optimizer", self.optimizer.name, f"state {leaf.name} matches no weight of the stage")

    def to_json(self) -> list[dict]:
        return [{**entry, "offset": slot.offset} for entry, slot in zip(self.base.to_json(), self.layout.slots)]

    # -- inside the step (shard_map; dp_axes are the stage's data-parallel mesh axes)

    def init(self, lengths: dict[str, int]) -> dict:
        """This device's buffers of a fresh state (the same on every rank)."""
        state = self.optimizer.init({"w": jnp.zeros((self.chunk,), jnp.float32)})
        return pack(self.local_layout, jax.tree.leaves(state), lengths)

    def zero_chunk(self) -> dict:
        """ZeRO-2: an empty accumulator of this rank's chunk of the summed gradients."""
        return {SEGMENT_DTYPE: jnp.zeros((self.chunk,), jnp.float32)}

    def update(self, params_b: dict, opt_b: dict, grads_b: dict, dp_axes: tuple[str, ...],
               lengths: dict[str, int], reduced: bool = False, split_weights: bool = False,
               in_pieces: bool = True) -> tuple[dict, dict]:
        """One step on the gradients summed over ``dp_axes``: the whole buffer, or under
        ZeRO-1 this rank's chunk, the whole weights gathered again. ``reduced``: the
        gradients are already this rank's chunk of the sum (ZeRO-2's accumulator);
        ``split_weights``: so are the weights (ZeRO-3), which stay split. ``in_pieces``
        (``_step_in_pieces``) off: the step whole, as inside a pipeline's stage switch,
        where the pieces compiled larger (4-stage gpt-760m without dp: 6.4 → 7.5 GB)."""
        grads, params = grads_b[SEGMENT_DTYPE], params_b[SEGMENT_DTYPE]
        if split_weights:
            g, p = grads, params
        elif self.split > 1:
            g = grads if reduced else lax.psum_scatter(grads, dp_axes, scatter_dimension=0, tiled=True)
            p = lax.dynamic_slice_in_dim(params, lax.axis_index(dp_axes) * self.chunk, self.chunk)
        else:
            g, p = (lax.psum(grads, dp_axes) if dp_axes else grads), params
        # ZeRO-2 (its accumulator already the chunk) compiled larger in pieces (gpt-760m dp 4:
        # 10.1 → 11.0 GB), and so does a stage's switch branch; they step whole.
        zero2 = reduced and not split_weights
        if self.segments > 1 and in_pieces and not zero2:
            new_p, opt_b = self._step_in_pieces(g, p, opt_b)
        else:  # whole: SGD's one momentum segment (XLA steps it in place), ZeRO-2, a branch
            state = jax.tree.unflatten(self.treedef, unpack(self.local_layout, opt_b))
            stepped, new_state = self.optimizer.update({"w": g}, state, {"w": p})
            new_p, opt_b = stepped["w"], pack(self.local_layout, jax.tree.leaves(new_state), lengths)
        gather = self.split > 1 and not split_weights
        whole = lax.all_gather(new_p, dp_axes, tiled=True) if gather else new_p
        return {**params_b, SEGMENT_DTYPE: whole}, opt_b

    def _step_in_pieces(self, g: jax.Array, p: jax.Array, opt_b: dict) -> tuple[jax.Array, dict]:
        """The elementwise step on weights ``p`` (their gradients ``g``) and the state in
        ``opt_b``, piece by piece, each piece's new weights and state written over its
        old ones in place. Stepped whole, XLA keeps the old state beside the new (a copy
        of the whole state buffer) since it cannot tell that the new moments land where
        only their own old values were read; here each piece's old values are read (and
        materialized) behind an optimization barrier before any of its writes."""
        n = p.shape[0]
        slots = self.local_layout.slots
        if any(sl.shape and sl.shape != (n,) for sl in slots):
            raise ValueError(f"state segments of {[sl.shape for sl in slots]} do not match {n} weights")
        pieces = max(1, min(UPDATE_PIECES, n // UPDATE_PIECE_MIN))
        bounds = [n * i // pieces for i in range(pieces + 1)]
        bufs, scalars = dict(opt_b), None
        for lo, hi in zip(bounds, bounds[1:]):
            if hi == lo:
                continue
            read = [lax.dynamic_slice_in_dim(bufs[sl.dtype], sl.offset + lo, hi - lo) if sl.shape
                    else lax.dynamic_index_in_dim(bufs[sl.dtype], sl.offset, keepdims=False) for sl in slots]
            # The buffers pass the barrier too: this piece's reads wait for the last one's
            # writes (and the gradients', so their pieces are not all sliced at once).
            g_i, p_i, read, bufs, p, g = lax.optimization_barrier(
                (g[lo:hi], lax.dynamic_slice_in_dim(p, lo, hi - lo), read, bufs, p, g))
            new_p, new_state = self.optimizer.update({"w": g_i}, jax.tree.unflatten(self.treedef, read), {"w": p_i})
            new = jax.tree.leaves(new_state)
            for sl, v in zip(slots, new):
                if sl.shape:
                    bufs[sl.dtype] = lax.dynamic_update_slice_in_dim(bufs[sl.dtype], v, sl.offset + lo, 0)
            scalars = [v for sl, v in zip(slots, new) if not sl.shape]
            p = lax.dynamic_update_slice_in_dim(p, new_p["w"], lo, 0)
        for sl, v in zip([sl for sl in slots if not sl.shape], scalars or []):
            bufs[sl.dtype] = lax.dynamic_update_index_in_dim(bufs[sl.dtype], v.astype(sl.dtype), sl.offset, 0)
        return p, bufs
