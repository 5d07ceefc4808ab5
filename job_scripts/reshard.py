"""A pipeline's training state in a checkpoint, and read back into any other plan.

Each device keeps its stage's arrays in flat buffers (``job_scripts.stage_arrays``); the
devices of a stage's data-parallel group hold the same buffer. To write it once, not
dp times, device ``(stage s, dp rank r)`` saves only chunk r of its buffer: the *save
view*, a global array ``[stages, devices per stage, chunk]`` that Orbax writes shard by
shard, each process its own devices', with no data moved between devices. Under expert
parallelism the devices' buffers differ (each holds its own experts), so each saves its
whole buffer (one chunk); so does each data-parallel rank of the optimizer state under
ZeRO-1 and 2 (``job_scripts.flat_optimizer``: its chunk of every state segment, described by
the layout's ``segments``).

The checkpoint's metadata keeps the layout (:func:`layout_json`): per stage its layers,
dp, tp and chunk length, and per array its plan-independent name, global shape, sharded
dimension and offset. :func:`restore` builds a new plan's buffers from it, reading for
each of this process's devices just the slices of the old chunks that hold its shards
(tensorstore reads of the saved files), so any plan reads any plan's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from job_scripts.checkpoint import CheckpointError
from job_scripts.flat_optimizer import SplitBuffers
from job_scripts.packing import Chunking
from job_scripts.pipeline import PP, Pipeline
from job_scripts.stage_arrays import KINDS, expert_position

# read(kind, dtype, stage, device position, lo, hi) -> the saved view's [stage, position, lo:hi]
ViewReader = Callable[[str, str, int, int, int, int], np.ndarray]


def _savers(st) -> int:
    """How many devices of a stage's data-parallel group share the saving of one buffer."""
    return 1 if st.coll.expert_parallel else st.dp


def _split(pipe: Pipeline, kind: str, st, dtype: str) -> bool:
    """Whether the stage's devices of one data-parallel group hold different parts of this
    buffer (the optimizer state from ZeRO-1 on, the weights under ZeRO-3): each then saves
    its own whole."""
    arrays = pipe.arrays[kind][st.index]
    return isinstance(arrays, SplitBuffers) and dtype in arrays.segments_json()


def _chunks(pipe: Pipeline, kind: str, dtype: str) -> list[int]:
    """Per stage, the chunk each dp rank saves of this dtype's buffer (at least 1)."""
    out = []
    for st in pipe.stages:
        arrays = pipe.arrays[kind][st.index]
        if _split(pipe, kind, st, dtype):
            out.append(arrays.local_lengths[dtype])
        else:
            out.append(max(1, -(-arrays.layout.length(dtype) // _savers(st))))
    return out


def layout_json(pipe: Pipeline) -> dict:
    """What a reader of the save views needs, as JSON."""
    kinds = {}
    for kind in KINDS:
        stages = []
        for st in pipe.stages:
            arrays = pipe.arrays[kind][st.index]
            stages.append({"layers": [st.layers.start, st.layers.stop], "dp": st.dp, "tp": st.tp,
                           "chunks": {dt: _chunks(pipe, kind, dt)[st.index] for dt in pipe.lengths[kind]},
                           "leaves": arrays.to_json()})
            if isinstance(arrays, SplitBuffers) and arrays.segments_json():
                stages[-1]["segments"] = arrays.segments_json()
        kinds[kind] = {"stages": stages}
    return {"kinds": kinds, "devices_per_stage": pipe.plan.stages[0].num_gpus}


def saver(pipe: Pipeline) -> Callable[[dict], dict]:
    """The compiled function from a pipeline's state to the arrays a checkpoint saves: per
    kind and dtype, ``[stages, devices, chunk]`` (build it once, call it at every save)."""
    chunks = {k: {dt: _chunks(pipe, k, dt) for dt in pipe.lengths[k]} for k in KINDS}

    def branch(st):
        def run(state):
            rank = lax.axis_index(st.coll.dp_axes) if st.coll.dp_axes and _savers(st) > 1 else 0
            out = {}
            for kind in KINDS:
                out[kind] = {}
                for dt, buf in state[kind].items():
                    c, width = chunks[kind][dt][st.index], max(chunks[kind][dt])
                    split = _split(pipe, kind, st, dt)
                    r = 0 if split else rank
                    buf = buf[0, 0]
                    need = c if split else _savers(st) * c
                    if need > buf.shape[0]:
                        buf = jnp.pad(buf, (0, need - buf.shape[0]))
                    part = lax.dynamic_slice_in_dim(buf, r * c, c)
                    out[kind][dt] = jnp.pad(part, (0, width - c))[None, None]
            return out
        return run

    branches = [branch(st) for st in pipe.stages]

    def body(state):
        return lax.switch(lax.axis_index(PP), branches, state)

    spec = {k: {dt: pipe.container_spec for dt in pipe.lengths[k]} for k in KINDS}
    return jax.jit(jax.shard_map(body, mesh=pipe.mesh, in_specs=(spec,), out_specs=spec, check_vma=False))


class _OldState:
    """The saved layout, indexed by array name, and the reads of its chunks."""

    def __init__(self, layout: dict, read: ViewReader):
        self.read_view = read
        self.by_name: dict[str, tuple[str, dict, dict]] = {}
        try:
            for kind, entry in layout["kinds"].items():
                for s, stage in enumerate(entry["stages"]):
                    stage = {**stage, "index": s}
                    for leaf in stage["leaves"]:
                        self.by_name[leaf["name"]] = (kind, stage, leaf)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"the checkpoint's layout is malformed ({e})") from None
        self._cache: dict[tuple[str, int], np.ndarray] = {}

    def _flat(self, kind: str, stage: dict, dtype: str, base: int, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of the buffer of the old stage's device at position ``base``
        (its tp rank; an expert-parallel stage's devices each saved their whole buffer)."""
        c, at = stage["chunks"][dtype], 0
        # Each dp rank saved chunk r of the buffer, or from ZeRO-1 on its own chunk of every
        # segment, one after the other (split by regions: under ZeRO-3 each layer's).
        chunking = Chunking(((0, stage["dp"] * c),), stage["dp"])
        if dtype in stage.get("segments", {}):
            seg = stage["segments"][dtype]
            c, span = seg["chunk"], seg.get("span", stage["dp"] * seg["chunk"])
            chunking = Chunking(tuple(tuple(r) for r in seg.get("regions", [[0, span]])), stage["dp"])
            segment = lo // span
            at, lo, hi = segment * c, lo - segment * span, hi - segment * span
        parts = []
        for r, a, b in chunking.locate(lo, hi):
            position = r * stage["tp"] + base
            parts.append(self.read_view(kind, dtype, stage["index"], position, at + a, at + b))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    @staticmethod
    def _shards(stage: dict, leaf: dict) -> int:
        """How many devices split an old array: its tp ranks, or an expert-parallel
        stage's devices for an expert's array."""
        return leaf.get("shards", stage["tp"])

    def shard(self, name: str, index: int) -> np.ndarray:
        """Old shard ``index`` of one array (held by the device of its stage at position
        ``index``, its tp rank, or for an expert's array ``expert_position``), in its old
        local shape."""
        kind, stage, leaf = self.by_name[name]
        dim, count = leaf["dim"], self._shards(stage, leaf)
        shape = [n // count if d == dim else n for d, n in enumerate(leaf["shape"])]
        size = math.prod(shape)
        position = 0 if dim is None else \
            expert_position(index, stage["dp"], stage["tp"]) if "shards" in leaf else index
        flat = self._flat(kind, stage, leaf["dtype"], position, leaf["offset"], leaf["offset"] + size)
        return flat.reshape(shape)

    def region(self, name: str, shape: tuple[int, ...], dtype: str, dim: int | None, count: int,
               rank: int) -> np.ndarray:
        """Part ``rank`` of ``count`` of array ``name`` along ``dim`` (its new shard)."""
        key = (name, dim, count, rank)
        if key in self._cache:
            return self._cache[key]
        if name not in self.by_name:
            raise CheckpointError(f"the checkpoint has no array {name}: was it written for another model?")
        _, stage, leaf = self.by_name[name]
        if tuple(leaf["shape"]) != tuple(shape) or leaf["dtype"] != dtype:
            raise CheckpointError(f"array {name} was saved as {leaf['dtype']}{leaf['shape']}, this model "
                                  f"has {dtype}{list(shape)}: was it written for another model?")
        old_dim, old_count = leaf["dim"], self._shards(stage, leaf)
        want = [slice(None)] * len(shape)
        if dim is not None:
            part = shape[dim] // count
            want[dim] = slice(rank * part, (rank + 1) * part)
        if old_dim is None or old_count == 1:
            out = self.shard(name, 0)[tuple(want)]
        else:
            piece = shape[old_dim] // old_count
            lo, hi = want[old_dim].indices(shape[old_dim])[:2]
            ranks = range(lo // piece, (hi - 1) // piece + 1)
            joined = np.concatenate([self.shard(name, r) for r in ranks], axis=old_dim)
            local = list(want)
            local[old_dim] = slice(lo - ranks[0] * piece, hi - ranks[0] * piece)
            out = joined[tuple(local)]
        self._cache[key] = out
        return out


def _positions(pipe: Pipeline):
    """(device, stage, position within the stage) of this process's devices."""
    me = jax.process_index()
    for index, device in np.ndenumerate(pipe.mesh.devices):
        if device.process_index != me:
            continue
        position = 0
        for bit in index[1:]:
            position = position * 2 + int(bit)
        yield device, index[0], position


def restore(pipe: Pipeline, layout: dict, read: ViewReader) -> dict:
    """The pipeline's state from a checkpoint of any plan (its ``layout_json`` and reads)."""
    old = _OldState(layout, read)
    state = {}
    for kind in KINDS:
        lengths = pipe.lengths[kind]
        shards: dict[str, list] = {dt: [] for dt in lengths}
        for device, s, position in _positions(pipe):
            arrays = pipe.arrays[kind][s]
            flat = isinstance(arrays, SplitBuffers)
            bufs = {dt: np.zeros((n,), dt) for dt, n in (arrays.layout.lengths if flat else lengths.items())}
            for leaf, slot in zip(arrays.leaves, arrays.layout.slots):
                data = old.region(leaf.name, leaf.shape, leaf.dtype, leaf.dim, arrays.shards(leaf),
                                  arrays.rank(leaf, position))
                bufs[slot.dtype][slot.offset:slot.offset + slot.size] = data.ravel()
            if flat:  # the stage's whole arrays → this device's buffers (its dp chunk from ZeRO-1 on)
                bufs = arrays.local_of_whole(bufs, position // pipe.stages[s].tp % arrays.split, lengths)
            for dt, buf in bufs.items():
                shards[dt].append(jax.device_put(buf[None, None], device))
        shape = (len(pipe.stages), pipe.plan.stages[0].num_gpus)
        sharding = NamedSharding(pipe.mesh, pipe.container_spec)
        state[kind] = {dt: jax.make_array_from_single_device_arrays(shape + (n,), sharding, shards[dt])
                       for dt, n in lengths.items()}
    return state


def logical_arrays(layout: dict, read: ViewReader) -> dict[str, np.ndarray]:
    """Every saved array, whole, by name (host memory: for tests and exports)."""
    old = _OldState(layout, read)
    out = {}
    for name, (_, _, leaf) in old.by_name.items():
        out[name] = old.region(name, tuple(leaf["shape"]), leaf["dtype"], None, 1, 0)
    return out
