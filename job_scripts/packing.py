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


def read_row(layout: FlatLayout, rows: dict, row) -> list:
    """The arrays of the layout read straight from row ``row`` of ``rows`` (per dtype
    ``[n, L]``), without copying the row first."""
    return [jax.lax.dynamic_slice(rows[s.dtype], (row, s.offset), (1, s.size)).reshape(s.shape)
            for s in layout.slots]
