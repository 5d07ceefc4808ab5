"""The built-in models' optimizers: small optax-shaped pairs of pure functions.

State is a plain pytree over fp32 master weights, so it shards with the same
PartitionSpecs as the parameters. Each optimizer runs in two settings:

- on *global* arrays (one device, or XLA's automatic partitioning): ``update(grads,
  state, params)``;
- on the *local shards* of a hand-partitioned (shard_map) program, where a parameter
  sharded over the tensor-parallel axis is split between devices: ``update(grads, state,
  params, specs, tp)``, with ``specs`` the parameters' PartitionSpecs and ``tp`` a
  :class:`TensorParallelSums`. AdamW and SGD are elementwise and ignore both; Adafactor's
  row and column means and its update clipping sum over the other shards, so every plan
  takes the same step.

Adafactor decides which parameters it factors from their *global* shapes (``init``'s
``shapes``), so the state's structure is the same whatever the tensor parallelism.
"""

from dataclasses import dataclass
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from estimator.errors import SpecError


class TensorParallelSums(Protocol):
    """Sums over the devices holding the other shards of a tensor-parallel parameter."""

    size: int

    def psum(self, x):
        """Sum of ``x`` over the tensor-parallel group (identity when it has one device)."""


@dataclass(frozen=True)
class Optimizer:
    """``init(params, shapes=None) -> state``, ``update(grads, state, params, specs=None,
    tp=None) -> (params, state)`` and ``specs(param_specs, param_shapes) -> state specs``;
    ``elementwise``: each weight's step depends on its own gradient and state alone, so
    the update of a flat chunk of weights is the chunk of the update (ZeRO-1 needs it)."""

    name: str
    init: Callable
    update: Callable
    specs: Callable
    elementwise: bool = False


def _padded(spec, ndim: int) -> tuple:
    t = tuple(spec)
    return t + (None,) * (ndim - len(t))


def _like_params(param_specs, param_shapes):
    return jax.tree.map(lambda sp, s: P(*_padded(sp, len(s.shape))), param_specs, param_shapes,
                        is_leaf=lambda x: isinstance(x, P))


def adamw(lr: float = 1e-4, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.01) -> Optimizer:
    """AdamW with fp32 first and second moments (16 bytes a parameter with the master)."""
    def init(params, shapes=None):
        def zeros():  # two separate trees: mu and nu must not share buffers (donation)
            return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return {"count": jnp.zeros((), jnp.int32), "mu": zeros(), "nu": zeros()}

    def update(grads, state, params, specs=None, tp=None):
        t = state["count"] + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["nu"], grads)
        c1, c2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)
        new = jax.tree.map(
            lambda p, m, v: p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + weight_decay * p),
            params, mu, nu)
        return new, {"count": t, "mu": mu, "nu": nu}

    def specs(param_specs, param_shapes):
        like = _like_params(param_specs, param_shapes)
        return {"count": P(), "mu": like, "nu": like}

    return Optimizer("adamw", init, update, specs, elementwise=True)


def _sharded_dims(spec, ndim: int) -> tuple[bool, ...]:
    return tuple(axis is not None for axis in _padded(spec or P(), ndim))


def adafactor(lr: float = 1e-3, decay: float = 0.8, eps: float = 1e-30,
              clip: float = 1.0, min_dim_to_factor: int = 128) -> Optimizer:
    """Adafactor without momentum: factored second moments for large matrices and up.

    As in optax, only tensors whose last two dimensions are both ≥ ``min_dim_to_factor``
    are factored; smaller ones keep a full second moment (a factored one of a tiny,
    partly zero gradient underflows to 0 and turns the update into NaN).
    """
    def factored(shape) -> bool:
        return len(shape) >= 2 and min(shape[-2:]) >= min_dim_to_factor

    def init(params, shapes=None):
        shapes = params if shapes is None else shapes

        def one(p, s):
            if factored(s.shape):
                return {"r": jnp.zeros(p.shape[:-1], jnp.float32),
                        "c": jnp.zeros(p.shape[:-2] + p.shape[-1:], jnp.float32)}
            return {"v": jnp.zeros(p.shape, jnp.float32)}
        return {"count": jnp.zeros((), jnp.int32), "v": jax.tree.map(one, params, shapes)}

    def update(grads, state, params, specs=None, tp=None):
        t = state["count"] + 1
        beta = 1.0 - t.astype(jnp.float32) ** (-decay)

        def mean(x, axis, sharded: bool):
            if tp is None or not sharded:
                return x.mean(axis)
            return tp.psum(x.sum(axis)) / (x.shape[axis] * tp.size)

        def one(p, g, v, spec):
            g2 = g * g + eps
            split = _sharded_dims(spec, p.ndim)
            if "r" in v:  # factored when initialised, from the global shape
                r = beta * v["r"] + (1 - beta) * mean(g2, -1, split[-1])
                c = beta * v["c"] + (1 - beta) * mean(g2, -2, split[-2])
                r_mean = mean(r, -1, split[-2])  # r's last axis is the parameter's rows
                vhat = jnp.maximum(r[..., None] * c[..., None, :] / r_mean[..., None, None], eps)
                nv = {"r": r, "c": c}
            else:
                vhat = beta * v["v"] + (1 - beta) * g2
                nv = {"v": vhat}
            u = g * jax.lax.rsqrt(vhat)
            sq = u * u
            if tp is not None and any(split):
                rms = jnp.sqrt(tp.psum(sq.sum()) / (sq.size * tp.size))
            else:
                rms = jnp.sqrt(jnp.mean(sq))
            u = u / jnp.maximum(1.0, rms / clip)
            return p - lr * u, nv

        flat_p, tdef = jax.tree.flatten(params)
        flat_g = tdef.flatten_up_to(grads)
        flat_v = tdef.flatten_up_to(state["v"])
        flat_s = [None] * len(flat_p) if specs is None else tdef.flatten_up_to(specs)
        out = [one(p, g, v, s) for p, g, v, s in zip(flat_p, flat_g, flat_v, flat_s)]
        return (tdef.unflatten([o[0] for o in out]),
                {"count": t, "v": tdef.unflatten([o[1] for o in out])})

    def specs(param_specs, param_shapes):
        def one(sp, s):
            t = _padded(sp, len(s.shape))
            if factored(s.shape):
                return {"r": P(*t[:-1]), "c": P(*(t[:-2] + t[-1:]))}
            return {"v": P(*t)}
        return {"count": P(), "v": jax.tree.map(one, param_specs, param_shapes,
                                                 is_leaf=lambda x: isinstance(x, P))}

    return Optimizer("adafactor", init, update, specs)


def sgd_nesterov(lr: float = 0.1, momentum: float = 0.9) -> Optimizer:
    """SGD with Nesterov momentum (one fp32 buffer a parameter)."""
    def init(params, shapes=None):
        return {"m": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)}

    def update(grads, state, params, specs=None, tp=None):
        m = jax.tree.map(lambda b, g: momentum * b + g, state["m"], grads)
        new = jax.tree.map(lambda p, b, g: p - lr * (g + momentum * b), params, m, grads)
        return new, {"m": m}

    def specs(param_specs, param_shapes):
        return {"m": _like_params(param_specs, param_shapes)}

    return Optimizer("sgd_nesterov", init, update, specs, elementwise=True)


OPTIMIZERS = {"adamw": adamw, "adafactor": adafactor, "sgd_nesterov": sgd_nesterov,
              "sgd": sgd_nesterov}


def optimizer_for(name: str) -> Optimizer:
    """A model family's optimizer (its ``Arch.optimizer`` name) with default hyper-parameters."""
    if name not in OPTIMIZERS:
        raise SpecError("optimizer", name, f"use one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]()
