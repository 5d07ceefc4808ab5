"""Collectives of a hand-partitioned training step, over named mesh axes.

Inside ``shard_map`` every device holds local shards and the program names its
communication. A pipeline stage of ``dp × tp`` devices uses two groups of mesh axes: its
tensor-parallel axes (the devices that hold the other shards of a weight) and its
data-parallel axes (the devices that hold the other slices of the batch). Different
stages of one plan may split their devices differently, so the groups are per stage.

:class:`StageCollectives` is ``estimator.jax_models.TensorParallel`` for one stage: the
layer code calls it where Megatron puts its ``f`` and ``g`` operators, for the
vocabulary-parallel embedding and cross-entropy, the local experts or channels, the
all-to-alls that carry tokens to their experts when a stage splits its experts over its
data-parallel group (expert parallelism), and batch-norm statistics over the
data-parallel group. Every operation whose backward is
not the plain transpose of its forward is a ``custom_vjp``, so the gradients are exact
whatever JAX's own rules for collectives in manual mode are.

:func:`to_receiver` and :func:`to_sender` move a micro-batch's activations (and their
gradients back) between two stages whose data parallelism differs: a stage with more
data parallelism takes its part of what it received, one with less gathers it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from estimator.jax_models import TensorParallel


def _index(axes: tuple[str, ...]):
    """This device's linear index over ``axes`` (mesh order, first axis major)."""
    return lax.axis_index(axes) if axes else 0


def _psum_forward(axes: tuple[str, ...]):
    @jax.custom_vjp
    def op(x):
        return lax.psum(x, axes)
    op.defvjp(lambda x: (lax.psum(x, axes), None), lambda _, g: (g,))
    return op


def _psum_backward(axes: tuple[str, ...]):
    @jax.custom_vjp
    def op(x):
        return x
    op.defvjp(lambda x: (x, None), lambda _, g: (lax.psum(g, axes),))
    return op


def _pmean_both(axes: tuple[str, ...]):
    """Mean over devices forward and backward: the transpose of a mean of replicas."""
    @jax.custom_vjp
    def op(x):
        return lax.pmean(x, axes)
    op.defvjp(lambda x: (lax.pmean(x, axes), None), lambda _, g: (lax.pmean(g, axes),))
    return op


@dataclass(frozen=True)
class StageCollectives(TensorParallel):
    """Megatron's collectives for one stage's device groups.

    Attributes:
        tp_axes: mesh axes of the stage's tensor-parallel group (empty: no tp).
        dp_axes: mesh axes of its data-parallel group (empty: no dp).
        dp_size: data-parallel degree.
        size: tensor-parallel degree (devices in ``tp_axes``).
        expert_parallel: MoE experts are split over all dp × tp devices of the stage: each
            tp rank's block of experts (as under tp) over its data-parallel group, whose
            tokens reach their experts' device by all-to-all.
    """

    tp_axes: tuple[str, ...]
    dp_axes: tuple[str, ...]
    dp_size: int
    size: int = 1
    expert_parallel: bool = False

    def psum(self, x):
        """Sum over the tensor-parallel group (for the optimizer's sharded reductions)."""
        return lax.psum(x, self.tp_axes) if self.tp_axes else x

    def tp_index(self):
        return _index(self.tp_axes)

    def position(self):
        """This device's index in its stage: dp rank major, tp rank minor."""
        return _index(self.dp_axes + self.tp_axes)

    def enter(self, x):
        return _psum_backward(self.tp_axes)(x) if self.tp_axes else x

    def exit(self, x):
        return _psum_forward(self.tp_axes)(x) if self.tp_axes else x

    def embed(self, table, ids):
        if not self.tp_axes:
            return jnp.take(table, ids, axis=0)
        rows = table.shape[0]
        local = ids - self.tp_index() * rows
        inside = (local >= 0) & (local < rows)
        found = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
        return self.exit(jnp.where(inside[..., None], found, jnp.zeros((), table.dtype)))

    def cross_entropy(self, logits, labels):
        if not self.tp_axes:
            return TensorParallel.cross_entropy(self, logits, labels)
        return _vocab_parallel_xent(self.tp_axes)(logits, labels)

    def local(self, x, axis: int):
        if not self.tp_axes:
            return x
        part = x.shape[axis] // self.size
        return lax.dynamic_slice_in_dim(x, self.tp_index() * part, part, axis)

    def to_experts(self, x):
        if not (self.expert_parallel and self.dp_axes):
            return x
        return lax.all_to_all(x, self.dp_axes, 0, 1, tiled=True)

    def from_experts(self, x):
        if not (self.expert_parallel and self.dp_axes):
            return x
        return lax.all_to_all(x, self.dp_axes, 1, 0, tiled=True)

    def expert_sums(self) -> "ExpertSums":
        """Under expert parallelism, sums over the devices holding the other shards of an
        expert weight (the optimizer's sharded reductions): the whole stage."""
        return ExpertSums(self.dp_axes + self.tp_axes, self.dp_size * self.size)

    def slice_channels(self, x):
        return _slice_last(self.tp_axes, self.size)(x) if self.tp_axes else x

    def gather_channels(self, x):
        return _gather_last(self.tp_axes, self.size)(x) if self.tp_axes else x

    def batch_mean(self, x, axes: tuple[int, ...]):
        local = x.mean(axis=axes)
        return _pmean_both(self.dp_axes)(local) if self.dp_axes else local


@dataclass(frozen=True)
class ExpertSums:
    """``estimator.jax_optim.TensorParallelSums`` over the devices sharing expert weights."""

    axes: tuple[str, ...]
    size: int

    def psum(self, x):
        return lax.psum(x, self.axes) if self.axes else x


def _vocab_parallel_xent(axes: tuple[str, ...]):
    """Mean cross-entropy over the local tokens with the classes split between devices."""
    def forward(logits, labels):
        lf = logits.astype(jnp.float32)
        top = lax.stop_gradient(lax.pmax(lf.max(axis=-1), axes))
        z = lf - top[..., None]
        total = lax.psum(jnp.exp(z).sum(axis=-1), axes)
        rows = lf.shape[-1]
        local = labels - lax.axis_index(axes) * rows
        inside = (local >= 0) & (local < rows)
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, rows - 1)[..., None], axis=-1)[..., 0]
        picked = lax.psum(jnp.where(inside, picked, 0.0), axes)
        loss = (jnp.log(total) - picked).mean()
        probs = jnp.exp(z) / total[..., None]
        onehot = jax.nn.one_hot(jnp.where(inside, local, -1), rows, dtype=jnp.float32)
        return loss, probs - onehot

    @jax.custom_vjp
    def op(logits, labels):
        return forward(logits, labels)[0]

    def fwd(logits, labels):
        loss, diff = forward(logits, labels)
        # An empty array carries the logits' dtype into the backward pass.
        return loss, (diff, labels, jnp.zeros((0,), logits.dtype))

    def bwd(res, g):
        diff, labels, like = res
        count = diff.size // diff.shape[-1]
        zero = jnp.zeros(labels.shape, jax.dtypes.float0)  # integer labels: no gradient
        return ((g / count) * diff).astype(like.dtype), zero

    op.defvjp(fwd, bwd)
    return op


def _slice_last(axes: tuple[str, ...], size: int):
    def cut(x):
        part = x.shape[-1] // size
        return lax.dynamic_slice_in_dim(x, lax.axis_index(axes) * part, part, x.ndim - 1)

    @jax.custom_vjp
    def op(x):
        return cut(x)
    op.defvjp(lambda x: (cut(x), None),
              lambda _, g: (lax.all_gather(g, axes, axis=g.ndim - 1, tiled=True),))
    return op


def _gather_last(axes: tuple[str, ...], size: int):
    def whole(x):
        return lax.all_gather(x, axes, axis=x.ndim - 1, tiled=True)

    @jax.custom_vjp
    def op(x):
        return whole(x)

    def bwd(_, g):
        part = g.shape[-1] // size
        return (lax.dynamic_slice_in_dim(g, lax.axis_index(axes) * part, part, g.ndim - 1),)

    op.defvjp(lambda x: (whole(x), None), bwd)
    return op


# --------------------------------------------------------------------------- between stages


def to_receiver(x, sender: StageCollectives, receiver: StageCollectives):
    """Activations as the sender held them (its batch slice) → the receiver's slice.

    Data-parallel axes are a prefix of a stage's axes, so the side with more data
    parallelism has the other's dp axes and some more: the receiver either cuts its part
    out (more dp) or gathers the parts of its dp group's other devices (less dp).
    """
    if receiver.dp_size > sender.dp_size:
        extra = receiver.dp_axes[len(sender.dp_axes):]
        part = x.shape[0] * sender.dp_size // receiver.dp_size
        return lax.dynamic_slice_in_dim(x, lax.axis_index(extra) * part, part, 0)
    if receiver.dp_size < sender.dp_size:
        return lax.all_gather(x, sender.dp_axes[len(receiver.dp_axes):], axis=0, tiled=True)
    return x


def to_sender(g, sender: StageCollectives, receiver: StageCollectives):
    """The receiver's input gradient → the sender's batch slice: the transpose of
    :func:`to_receiver` for a value replicated over the receiver's tensor-parallel axes."""
    if receiver.dp_size > sender.dp_size:
        return lax.all_gather(g, receiver.dp_axes[len(sender.dp_axes):], axis=0, tiled=True)
    if receiver.dp_size < sender.dp_size:
        fewer = sender.dp_axes[len(receiver.dp_axes):]
        part = g.shape[0] * receiver.dp_size // sender.dp_size
        return lax.dynamic_slice_in_dim(g, lax.axis_index(fewer) * part, part, 0)
    return g
