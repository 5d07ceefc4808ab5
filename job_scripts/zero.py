"""ZeRO-1: a stage's optimizer state split over its data-parallel group.

Under ZeRO-0 every device of a stage's data-parallel group keeps the whole optimizer
state of its weights (its tensor-parallel shard of them) and takes the same update. Under
ZeRO-1 (Rajbhandari et al., 2020) each of the ``dp`` devices keeps 1/dp of it: the
gradients are reduce-scattered instead of all-reduced (the same bytes on a ring), each
device updates its chunk of the weights with its chunk of the state, and the new weights
are all-gathered. Weights and gradients stay whole on every device.

The chunks are cut from the stage's flat weight buffer (``job_scripts.packing``): chunk r
of ``c = ⌈L/dp⌉`` elements belongs to data-parallel rank r. That needs an optimizer whose
update is elementwise (AdamW, SGD with momentum): its state on a chunk of a flat buffer is
the chunk of its state on every array. Adafactor's factored moments are not
(:func:`zero_problem`). Its state on one chunk is a small tree: scalars (AdamW's step
count), kept whole, and *segments*, one flat chunk per params-shaped tree of the state
(AdamW's μ and ν, SGD's momentum).

A device's float32 optimizer buffer is its segments one after the other. A checkpoint
names the same arrays as under ZeRO-0 (``opt/layer_003/mu/wqkv``), so any plan reads it:
:class:`ZeroOptArrays` describes each of them by its offset in the stage's *whole* state,
segment k of every rank after segment k−1's (``k·dp·c + offset in the weights``), and
``segments`` tells a reader where rank r saved what (``job_scripts.reshard``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from estimator.errors import SpecError
from job_scripts.packing import FlatLayout, Slot
from job_scripts.stage_arrays import Leaf, StageArrays

ZERO_LEVELS = (0, 1)  # what the pipeline runs: replicated states, or states split over dp
SEGMENT_DTYPE = "float32"


def _state_tree(optimizer, chunk: int):
    """The optimizer's state on one flat chunk of ``chunk`` weights (shapes only)."""
    return jax.eval_shape(optimizer.init, {"w": jax.ShapeDtypeStruct((chunk,), jnp.float32)})


def zero_problem(optimizer) -> str:
    """Why this optimizer's state cannot be split over a flat buffer ("" if it can): its
    update must be elementwise (Adafactor's factored moments and update clipping are not)."""
    if not optimizer.elementwise:
        return (f"ZeRO-1 splits the states of elementwise optimizers (adamw, sgd); {optimizer.name} "
                "keeps factored ones (use zero=0)")
    return ""


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


@dataclass(frozen=True)
class _Part:
    """One array of the state on a chunk: a scalar (kept whole) or segment ``k``."""

    name: str  # its path in the state tree without the weights' key ("count", "mu")
    dtype: str
    segment: int | None


class ZeroOptArrays:
    """A stage's optimizer state under ZeRO-1: the same named arrays as its ZeRO-0
    :class:`StageArrays` (``base``), each device holding its data-parallel rank's chunk.

    ``layout`` places every array in the stage's whole state (what a checkpoint
    describes); ``local_lengths`` are one device's buffers."""

    def __init__(self, base: StageArrays, params: StageArrays, dp: int, optimizer):
        if problem := zero_problem(optimizer):
            raise SpecError("zero", 1, problem)
        dtypes = {dt for dt, n in params.layout.lengths if n}
        if dtypes - {SEGMENT_DTYPE}:
            raise SpecError("zero", 1, f"ZeRO-1 splits {SEGMENT_DTYPE} weights; this stage has {sorted(dtypes)}")
        self.base, self.dp, self.optimizer = base, dp, optimizer
        self.kind, self.tp, self.ep = base.kind, base.tp, base.ep
        self.weights = params.layout.length(SEGMENT_DTYPE)
        self.chunk = max(1, -(-self.weights // dp))
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(_state_tree(optimizer, self.chunk))
        parts, segments, scalars = [], 0, {}
        for path, leaf in flat:
            name = _path_name(path[:-1]) if leaf.shape else _path_name(path)
            dtype = jnp.dtype(leaf.dtype).name
            if leaf.shape:
                parts.append(_Part(name, dtype, segments))
                segments += 1
            else:
                parts.append(_Part(name, dtype, None))
                scalars[dtype] = scalars.get(dtype, 0) + 1
        self.parts, self.segments = tuple(parts), segments
        self.local_lengths = {SEGMENT_DTYPE: max(1, segments * self.chunk), **scalars}
        # One device's buffers, as a layout's lengths (what the pipeline sizes its buffers by).
        self.local_layout = FlatLayout((), tuple(sorted(self.local_lengths.items())))
        self.leaves: list[Leaf] = base.leaves
        weights = {leaf.name: slot.offset for leaf, slot in zip(params.leaves, params.layout.slots)}
        self.layout = FlatLayout(tuple(self._slot(leaf, slot, weights) for leaf, slot in
                                       zip(base.leaves, base.layout.slots)),
                                 tuple(sorted({SEGMENT_DTYPE: segments * dp * self.chunk, **scalars}.items())))

    def _slot(self, leaf: Leaf, slot: Slot, weights: dict[str, int]) -> Slot:
        """Where one named state array lies in the stage's whole state: a scalar at its
        part's place (every layer's step count is the same one), an array in its segment
        at its weight's offset."""
        layer, _, rest = leaf.name.partition("/")[2].partition("/")
        for part in self.parts:
            if part.segment is None and rest == part.name:
                return Slot(part.dtype, self._scalar_offset(part), slot.shape)
            weight = f"params/{layer}/{rest[len(part.name) + 1:]}"
            if part.segment is not None and rest.startswith(part.name + "/") and weight in weights:
                return Slot(SEGMENT_DTYPE, part.segment * self.dp * self.chunk + weights[weight], slot.shape)
        raise SpecError("zero", 1, f"optimizer state {leaf.name} matches no weight of the stage")

    def _scalar_offset(self, part: _Part) -> int:
        same = [p for p in self.parts if p.segment is None and p.dtype == part.dtype]
        return same.index(part)

    # -- what the checkpoint needs, as StageArrays has it

    def shards(self, leaf: Leaf) -> int:
        return self.base.shards(leaf)

    def rank(self, leaf: Leaf, position):
        return self.base.rank(leaf, position)

    def position(self, leaf: Leaf, shard: int) -> int:
        return self.base.position(leaf, shard)

    def to_json(self) -> list[dict]:
        return [{**entry, "offset": slot.offset} for entry, slot in zip(self.base.to_json(), self.layout.slots)]

    def segments_json(self) -> dict:
        """How the whole state's split buffer lies over the data-parallel ranks."""
        return {SEGMENT_DTYPE: {"segments": self.segments, "chunk": self.chunk}}

    def local_of_whole(self, whole: dict[str, np.ndarray], dp_rank: int, lengths: dict[str, int]
                       ) -> dict[str, np.ndarray]:
        """One device's buffers (padded to ``lengths``) from the stage's whole state."""
        out = {dt: np.zeros((n,), dt) for dt, n in lengths.items()}
        c, span = self.chunk, self.dp * self.chunk
        for k in range(self.segments):
            out[SEGMENT_DTYPE][k * c:(k + 1) * c] = whole[SEGMENT_DTYPE][k * span + dp_rank * c:
                                                                        k * span + (dp_rank + 1) * c]
        for dt, n in self.local_lengths.items():
            if dt != SEGMENT_DTYPE:
                out[dt][:n] = whole[dt][:n]
        return out

    def whole_of_locals(self, locals_: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The stage's whole state from every data-parallel rank's buffers, in rank order."""
        c, span = self.chunk, self.dp * self.chunk
        whole = {dt: np.zeros((n,), dt) for dt, n in self.layout.lengths}
        for r, bufs in enumerate(locals_):
            for k in range(self.segments):
                whole[SEGMENT_DTYPE][k * span + r * c:k * span + (r + 1) * c] = bufs[SEGMENT_DTYPE][k * c:(k + 1) * c]
        for dt, n in self.local_lengths.items():
            if dt != SEGMENT_DTYPE:
                whole[dt][:n] = locals_[0][dt][:n]
        return whole

    # -- inside the step (shard_map; dp_axes are the stage's data-parallel mesh axes)

    def _pack(self, state, lengths: dict[str, int]) -> dict:
        leaves = jax.tree.leaves(state)
        out = {}
        for dt, n in lengths.items():
            mine = [jnp.ravel(a) for a, part in zip(leaves, self.parts) if part.dtype == dt]
            used = sum(a.size for a in mine)
            out[dt] = jnp.concatenate(mine + ([jnp.zeros((n - used,), dt)] if n > used else []))
        return out

    def _unpack(self, bufs: dict):
        taken: dict[str, int] = {}
        leaves = []
        for part in self.parts:
            at = taken.get(part.dtype, 0)
            size = self.chunk if part.segment is not None else 1
            piece = lax.slice_in_dim(bufs[part.dtype], at, at + size)
            leaves.append(piece if part.segment is not None else piece.reshape(()))
            taken[part.dtype] = at + size
        return jax.tree.unflatten(self.treedef, leaves)

    def init(self, lengths: dict[str, int]) -> dict:
        """This device's buffers of a fresh state (the same on every rank)."""
        return self._pack(self.optimizer.init({"w": jnp.zeros((self.chunk,), jnp.float32)}), lengths)

    def update(self, params_b: dict, opt_b: dict, grads_b: dict, dp_axes: tuple[str, ...],
               lengths: dict[str, int]) -> tuple[dict, dict]:
        """One step: the summed gradients' chunk of this rank, its chunk of the weights
        updated with its state, the whole weights gathered again."""
        span, c = self.dp * self.chunk, self.chunk
        grads = _resized(grads_b[SEGMENT_DTYPE], span)
        params = params_b[SEGMENT_DTYPE]
        if dp_axes:
            g = lax.psum_scatter(grads, dp_axes, scatter_dimension=0, tiled=True)
            r = lax.axis_index(dp_axes)
        else:
            g, r = grads, 0
        p = lax.dynamic_slice_in_dim(_resized(params, span), r * c, c)
        new_p, new_state = self.optimizer.update({"w": g}, self._unpack(opt_b), {"w": p})
        whole = lax.all_gather(new_p["w"], dp_axes, tiled=True) if dp_axes else new_p["w"]
        new_params = {**params_b, SEGMENT_DTYPE: _resized(whole, params.shape[0])}
        return new_params, self._pack(new_state, lengths)


def _resized(x, n: int):
    """``x`` cut or zero-padded to ``n`` elements."""
    return x[:n] if x.shape[0] >= n else jnp.pad(x, (0, n - x.shape[0]))

