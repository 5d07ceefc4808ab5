"""Flat buffers that hold a stage's arrays, one buffer per dtype.

One SPMD program runs every pipeline stage, so every device's inputs and outputs must
have the same shapes, though the stages hold different layers (an embedding, blocks, a
head) under different tensor parallelism. Each device therefore keeps its stage's
arrays (weights, optimizer state, the activations it sends, the residuals it keeps for
the backward pass) concatenated into one flat buffer per dtype, as long as the longest
stage needs. A :class:`FlatLayout` says where each array of one stage lies; packing and
unpacking are static slices and reshapes, so they cost copies, never collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclass(frozen=True)
class Slot:
    """Where one array lies: in the buffer of ``dtype``, from ``offset``, with ``shape``."""

    dtype: str
    offset: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatLayout:
    """The slots of a sequence of arrays and the length each dtype's buffer needs."""

    slots: tuple[Slot, ...]
    lengths: tuple[tuple[str, int], ...]  # (dtype, elements used), sorted by dtype

    def length(self, dtype: str) -> int:
        return dict(self.lengths).get(dtype, 0)


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def flat_layout(shapes: Sequence) -> FlatLayout:
    """The layout of arrays with these shapes and dtypes (``ShapeDtypeStruct``-like), in order."""
    used: dict[str, int] = {}
    slots = []
    for s in shapes:
        name = dtype_name(s.dtype)
        slots.append(Slot(name, used.get(name, 0), tuple(int(d) for d in s.shape)))
        used[name] = used.get(name, 0) + math.prod(s.shape)
    return FlatLayout(tuple(slots), tuple(sorted(used.items())))


def joint_lengths(layouts: Sequence[FlatLayout]) -> dict[str, int]:
    """Per dtype, the longest buffer any of the layouts needs (at least 1 element)."""
    out: dict[str, int] = {}
    for layout in layouts:
        for name, n in layout.lengths:
            out[name] = max(out.get(name, 1), n)
    return dict(sorted(out.items()))


def pack(layout: FlatLayout, arrays: Sequence, lengths: dict[str, int]) -> dict[str, jax.Array]:
    """Concatenate ``arrays`` (in the layout's order) into one padded buffer per dtype."""
    parts: dict[str, list] = {name: [] for name in lengths}
    for slot, a in zip(layout.slots, arrays, strict=True):
        parts[slot.dtype].append(jnp.ravel(a).astype(slot.dtype))
    out = {}
    for name, n in lengths.items():
        used = layout.length(name)
        pieces = parts[name] + ([jnp.zeros((n - used,), name)] if n > used else [])
        out[name] = jnp.concatenate(pieces) if pieces else jnp.zeros((n,), name)
    return out


def pack_by_groups(layout: FlatLayout, counts: Sequence[int], arrays: Sequence,
                   lengths: dict[str, int]) -> dict[str, jax.Array]:
    """:func:`pack`'s buffers, written group by group into zeros (``counts``: how many of
    the arrays, in order, each group has; a layer's): each group's arrays of one dtype are
    concatenated and their run of slots written in place. Inside a ``lax.switch`` branch
    XLA splits a whole buffer's concatenation into nested ones and holds the inner one
    beside the buffer; a group's is small. Written array by array instead, XLA held
    more of them at once."""
    out = {name: jnp.zeros((n,), name) for name, n in lengths.items()}
    at = 0
    for count in counts:
        runs: dict[str, list] = {}
        for slot, a in zip(layout.slots[at:at + count], arrays[at:at + count], strict=True):
            runs.setdefault(slot.dtype, []).append((slot.offset, jnp.ravel(a).astype(slot.dtype)))
        for name, run in runs.items():
            piece = jnp.concatenate([a for _, a in run]) if len(run) > 1 else run[0][1]
            out[name] = lax.dynamic_update_slice_in_dim(out[name], piece, run[0][0], 0)
        at += count
    if at != len(layout.slots):
        raise ValueError(f"groups of {at} arrays for a layout of {len(layout.slots)}")
    return out


def add_buffers(buffers: dict[str, jax.Array], more: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Packed buffers summed dtype by dtype (gradient accumulation of packed gradients)."""
    return {dt: buffers[dt] + more[dt] for dt in buffers}


def pack_range(layout: FlatLayout, arrays: Sequence, dtype: str, start: int, stop: int) -> jax.Array:
    """Elements ``[start, stop)`` of :func:`pack`'s ``dtype`` buffer, from the arrays that
    overlap them only: the whole buffer is never built. Past the arrays, zeros (padding)."""
    parts, at = [], start
    for slot, a in zip(layout.slots, arrays, strict=True):
        lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.size)
        if slot.dtype != dtype or lo >= hi:
            continue
        if lo > at:
            parts.append(jnp.zeros((lo - at,), dtype))
        parts.append(jnp.ravel(a)[lo - slot.offset:hi - slot.offset].astype(dtype))
        at = hi
    if at < stop:
        parts.append(jnp.zeros((stop - at,), dtype))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def unpack(layout: FlatLayout, buffers: dict) -> list:
    """The arrays of the layout, sliced and reshaped out of the buffers."""
    return [jax.lax.slice_in_dim(buffers[s.dtype], s.offset, s.offset + s.size).reshape(s.shape)
            for s in layout.slots]


def pack_host(layout: FlatLayout, arrays: Sequence[np.ndarray], lengths: dict[str, int]
              ) -> dict[str, np.ndarray]:
    """:func:`pack` on the host, with numpy (checkpoint restore builds buffers this way)."""
    out = {name: np.zeros((n,), name) for name, n in lengths.items()}
    for slot, a in zip(layout.slots, arrays, strict=True):
        out[slot.dtype][slot.offset:slot.offset + slot.size] = np.asarray(a, slot.dtype).ravel()
    return out


@dataclass(frozen=True)
class Chunking:
    """How a buffer lies over the ``split`` ranks of a data-parallel group: each region
    ``(start, size)`` of the whole buffer is cut into ``split`` chunks of ``ceil(size /
    split)`` elements (the last padded with zeros), and rank r keeps chunk r of every
    region, one after the other. ZeRO-1 and 2 split the whole buffer as one region; ZeRO-3
    one region per layer, so that a layer's weights are gathered alone."""

    regions: tuple[tuple[int, int], ...]
    split: int

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(-(-size // self.split) for _, size in self.regions)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each region's chunk starts in a rank's buffer."""
        return tuple(int(v) for v in np.cumsum((0,) + self.chunks[:-1]))

    @property
    def length(self) -> int:
        """One rank's elements."""
        return sum(self.chunks)

    @property
    def span(self) -> int:
        """The whole buffer's elements."""
        return max((start + size for start, size in self.regions), default=0)

    def local_of_whole(self, whole: np.ndarray, rank: int) -> np.ndarray:
        out = np.zeros((self.length,), whole.dtype)
        for (start, size), c, at in zip(self.regions, self.chunks, self.offsets):
            part = whole[start + min(size, rank * c):start + min(size, (rank + 1) * c)]
            out[at:at + part.shape[0]] = part
        return out

    def whole_of_locals(self, locals_: Sequence[np.ndarray]) -> np.ndarray:
        out = np.zeros((self.span,), locals_[0].dtype)
        for (start, size), c, at in zip(self.regions, self.chunks, self.offsets):
            for r, local in enumerate(locals_[:self.split]):
                n = max(0, min(size, (r + 1) * c) - r * c)
                out[start + r * c:start + r * c + n] = local[at:at + n]
        return out

    def locate(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Where elements ``[lo, hi)`` of the whole buffer lie, in order: (rank, from, to)
        in that rank's buffer."""
        out = []
        for (start, size), c, at in zip(self.regions, self.chunks, self.offsets):
            a, b = max(lo, start) - start, min(hi, start + size) - start
            for r in range(a // c, (b - 1) // c + 1) if a < b else ():
                out.append((r, at + max(a, r * c) - r * c, at + min(b, (r + 1) * c) - r * c))
        return out

    def local_of_packed(self, whole: jax.Array, rank) -> jax.Array:
        """:meth:`local_of_whole` inside a program (``rank`` may be traced)."""
        parts = []
        for (start, size), c in zip(self.regions, self.chunks):
            region = jax.lax.slice_in_dim(whole, start, start + size)
            region = jnp.pad(region, (0, c * self.split - size)) if c * self.split > size else region
            parts.append(jax.lax.dynamic_slice_in_dim(region, rank * c, c))
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def to_json(self) -> list[list[int]]:
        return [[start, size] for start, size in self.regions]


def read_row(layout: FlatLayout, rows: dict, row) -> list:
    """The arrays of the layout read straight from row ``row`` of ``rows`` (per dtype
    ``[n, L]``), without copying the row first."""
    return [jax.lax.dynamic_slice(rows[s.dtype], (row, s.offset), (1, s.size)).reshape(s.shape)
            for s in layout.slots]
