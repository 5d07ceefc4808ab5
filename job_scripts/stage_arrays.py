"""The arrays one pipeline stage holds, by plan-independent name, and where each device
keeps its shard of them.

A stage holds, per layer, three trees: parameters (fp32 masters), optimizer state and
model state (batch-norm statistics). Every leaf has a name that no plan changes
(``params/layer_003/wqkv``, ``opt/layer_003/mu/wqkv``), a global shape and a
PartitionSpec over ``tp``; a device of a stage with tensor parallelism ``tp`` holds the
slice of each leaf that its tensor-parallel rank owns, concatenated into its stage's flat
buffers (``job_scripts.packing``). Under expert parallelism the MoE experts' leaves
(``jax_models.EXPERT_PARAMS`` and their optimizer state) are split over all ``ep`` = dp × tp
devices of the stage instead, each holding its own: tp rank t keeps the t-th block of
experts, as under tensor parallelism, and its dp ranks split that block
(:func:`expert_shard`). :class:`StageArrays` is that bookkeeping for one kind of tree of
one stage: it packs and unpacks trees and describes itself in JSON, so a checkpoint of
one plan can be read into any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from estimator import jax_models as jm
from job_scripts.packing import FlatLayout, flat_layout, pack, pack_by_groups, unpack

KINDS = ("params", "opt", "state")


def layer_key(index: int) -> str:
    return f"layer_{index:03d}"


def path_name(path) -> str:
    """A pytree path as a name: keys joined by '/'."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def sharded_dim(spec, ndim: int) -> int | None:
    """The one dimension a leaf's spec shards over ``tp`` (None: replicated)."""
    dims = [d for d, axis in enumerate(tuple(spec or P())[:ndim]) if axis is not None]
    if len(dims) > 1:
        raise ValueError(f"spec {spec} shards more than one dimension")
    return dims[0] if dims else None


def local_shape(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(shape)
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def expert_shard(position, dp: int, tp: int):
    """Which of the dp × tp shards of an expert leaf the device at ``position`` of its
    stage holds (position: dp rank major, tp rank minor; may be traced): its tp rank's
    block of experts, and within it its dp rank's part."""
    return (position % tp) * dp + position // tp


def expert_position(shard: int, dp: int, tp: int) -> int:
    """The inverse of :func:`expert_shard`: the position in its stage of the device that
    holds shard ``shard`` of an expert leaf."""
    return (shard % dp) * tp + shard // dp


def local_slice(x, dim: int | None, tp: int, rank):
    """This rank's part of a whole array (rank may be traced)."""
    if dim is None or tp == 1:
        return x
    part = x.shape[dim] // tp
    return jax.lax.dynamic_slice_in_dim(x, rank * part, part, dim)


@dataclass(frozen=True)
class Leaf:
    """One array of a stage: its name, global shape and dtype, and sharded dimension;
    ``expert``: an expert weight (or its state) split over data parallelism too."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    dim: int | None
    expert: bool = False

    def local_shape(self, tp: int) -> tuple[int, ...]:
        return local_shape(self.shape, self.dim, tp)


def _layer_trees(arch: jm.Arch, layer: int, kind: str, optimizer):
    """(global shape tree, spec tree) of one layer's params, opt state or model state."""
    if kind == "params":
        return jm.layer_param_shapes(arch, layer), jm.layer_param_specs(arch, layer)
    if kind == "state":
        return jm.layer_state_shapes(arch, layer), jm.layer_state_specs(arch, layer)
    shapes = jm.layer_param_shapes(arch, layer)
    opt = jax.eval_shape(optimizer.init, shapes)
    return opt, optimizer.specs(jm.layer_param_specs(arch, layer), shapes)


class StageArrays:
    """One kind of tree (params, opt or state) of one stage, under tensor parallelism tp,
    with its experts split over all ``ep`` (dp × tp) devices under expert parallelism."""

    def __init__(self, arch: jm.Arch, layers: range, kind: str, tp: int, optimizer, ep: int = 1):
        self.kind, self.layers, self.tp, self.ep = kind, layers, tp, ep
        self.leaves: list[Leaf] = []
        self.treedefs, self.specs, self.counts = [], [], []
        for layer in layers:
            shapes, specs = _layer_trees(arch, layer, kind, optimizer)
            flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
            spec_leaves = treedef.flatten_up_to(specs)
            moe = jm.layer_kind(arch, layer) == "moe_block"
            for (path, s), spec in zip(flat, spec_leaves):
                name = f"{kind}/{layer_key(layer)}" + (f"/{path_name(path)}" if path else "")
                expert = ep > 1 and moe and any(part in jm.EXPERT_PARAMS for part in name.split("/"))
                self.leaves.append(Leaf(name, tuple(s.shape), jnp.dtype(s.dtype).name,
                                        sharded_dim(spec, len(s.shape)), expert))
            self.treedefs.append(treedef)
            self.specs.append(specs)
            self.counts.append(len(flat))
        self.layout: FlatLayout = flat_layout(
            [jax.ShapeDtypeStruct(leaf.local_shape(self.shards(leaf)), leaf.dtype) for leaf in self.leaves])

    def shards(self, leaf: Leaf) -> int:
        """How many devices split this leaf (along ``leaf.dim``)."""
        return self.ep if leaf.expert else self.tp

    def rank(self, leaf: Leaf, position):
        """Which shard of a leaf a device holds, from its position in the stage (dp rank
        major, tp rank minor; may be traced)."""
        return expert_shard(position, self.ep // self.tp, self.tp) if leaf.expert else position % self.tp

    def position(self, leaf: Leaf, shard: int) -> int:
        """The position in the stage of a device that holds shard ``shard`` of a leaf."""
        return expert_position(shard, self.ep // self.tp, self.tp) if leaf.expert else shard

    def global_trees(self) -> list:
        """Per layer, the tree of global ShapeDtypeStructs."""
        return self._trees([jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.leaves])

    def _trees(self, flat: Sequence) -> list:
        out, i = [], 0
        for treedef, n in zip(self.treedefs, self.counts):
            out.append(jax.tree.unflatten(treedef, list(flat[i:i + n])))
            i += n
        return out

    def unpack(self, buffers: dict) -> list:
        """Per layer, the tree of this device's local shards."""
        return self._trees(unpack(self.layout, buffers))

    def map_leaves(self, trees: Sequence, fn) -> list:
        """Per-layer trees with each array replaced by ``fn(leaf, array)``."""
        return self._trees([fn(leaf, a) for leaf, a in zip(self.leaves, self.flat(trees))])

    def flat(self, trees: Sequence) -> list:
        """The leaves of per-layer trees, in the layout's order."""
        return [leaf for tree, treedef in zip(trees, self.treedefs) for leaf in treedef.flatten_up_to(tree)]

    def pack(self, trees: Sequence, lengths: dict[str, int], by_layer: bool = False) -> dict:
        """Per-layer trees packed into one padded buffer per dtype: concatenated whole, or
        (``by_layer``) written layer by layer into zeros (``packing.pack_by_groups``)."""
        if by_layer:
            return pack_by_groups(self.layout, self.counts, self.flat(trees), lengths)
        return pack(self.layout, self.flat(trees), lengths)

    def local_of_global(self, trees: Sequence, position) -> list:
        """Whole per-layer trees cut to the shards of the device at ``position`` in the stage."""
        return self._trees([local_slice(a, leaf.dim, self.shards(leaf), self.rank(leaf, position))
                            for a, leaf in zip(self.flat(trees), self.leaves)])

    def to_json(self) -> list[dict]:
        out = []
        for leaf, slot in zip(self.leaves, self.layout.slots):
            entry = {"name": leaf.name, "shape": list(leaf.shape), "dtype": leaf.dtype, "dim": leaf.dim,
                     "offset": slot.offset}
            if leaf.expert:
                entry["shards"] = self.ep  # split over all the stage's devices (expert_shard)
            out.append(entry)
        return out
