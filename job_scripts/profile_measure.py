"""What the profiling job measures on the allocation's devices, through JAX.

- **Collectives** (:func:`collective_program`): all-reduce, all-gather, reduce-scatter,
  all-to-all and send/recv (a ``ppermute`` between two devices), each a ``shard_map`` over
  a one-axis mesh of the group's devices. Sizes are the full buffer in bytes, as the
  estimator's collective curves read them (all-gather: the gathered result;
  reduce-scatter: the input).
- **Calibration kernels** (:func:`calibration_kernels`): matmuls at several shapes in the
  compute dtype and in full-precision fp32, and a memory-bound elementwise pass; the
  efficiency fit (``estimator.profile_fit``) reads them.
- **Layer shares** (:func:`layer_share`): one device's share of one layer of a
  model, Crius's single-device profiling: a data-parallel-only variant is the whole layer
  at the device's samples; a tensor-parallel-only variant is the layer with every
  tp-sharded weight cut to 1/tp and the collectives left out (they are costed from the
  collective curves). Forward, and forward + backward, are timed separately, so the
  estimator can add the recomputed forward of rematerialization.

Every timing is the median of several calls after one untimed call, each call waited
for with ``block_until_ready``. Compiling dominates a GPU profile (XLA autotunes every
matmul), so the programs of one batch are compiled on several threads at once
(:func:`compile_all`) and then timed one by one.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimator import jax_models as jm

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send")


@dataclass(frozen=True)
class Timing:
    median_s: float
    runs: int


def time_call(fn: Callable, args: Sequence, repeats: int, min_total_s: float = 0.0) -> Timing:
    """Median seconds of ``fn(*args)`` after one untimed call (which compiles): at least
    ``repeats`` calls, more (up to 4×) until ``min_total_s`` have been timed."""
    jax.block_until_ready(fn(*args))
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_total_s and len(times) < 4 * repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), len(times))


# --------------------------------------------------------------------------- collectives


def collective_program(op: str, devices: Sequence, nbytes: int):
    """A jitted collective over ``devices`` and its input: ``(fn, (x,))``.

    ``nbytes`` is the full buffer (see the module docstring); float32 elements.
    """
    g = len(devices)
    mesh = Mesh(np.asarray(devices), ("x",))
    elements = max(g, (nbytes // 4) // g * g)
    if op == "all-gather":
        local, body = elements // g, lambda x: lax.all_gather(x, "x", tiled=True)
    elif op == "reduce-scatter":
        local, body = elements, lambda x: lax.psum_scatter(x, "x", tiled=True)
    elif op == "all-reduce":
        local, body = elements, lambda x: lax.psum(x, "x")
    elif op == "all-to-all":
        local, body = elements, lambda x: lax.all_to_all(x, "x", 0, 0, tiled=True)
    elif op == "send":
        if g != 2:
            raise ValueError("send/recv is measured between two devices")
        local, body = elements, lambda x: lax.ppermute(x, "x", [(0, 1), (1, 0)])
    else:
        raise ValueError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVE_OPS)}")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    sharding = NamedSharding(mesh, P("x"))
    x = jax.make_array_from_callback((g * local,), sharding,
                                     lambda idx: np.ones((local,), np.float32))
    return fn, (x,)


# --------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class Kernel:
    """One calibration kernel: what it is, its work, and how to run it."""

    kernel: str  # matmul | copy
    dtype: str
    shape: str
    flops: float
    bytes: float
    fn: Callable
    args: tuple


def calibration_kernels(device, compute_dtype: str, matmul_sizes: Sequence[int],
                        copy_bytes: Sequence[int], seed: int = 0) -> list[Kernel]:
    """Square matmuls in the compute dtype and in full-precision fp32, and an elementwise
    pass (read and write) over each of ``copy_bytes``, on one device."""
    out = []
    rng = np.random.default_rng(seed)
    for dtype_name, dtype, precision in ((compute_dtype, jm.DTYPES[compute_dtype], None),
                                         ("fp32", jnp.float32, lax.Precision.HIGHEST)):
        for n in matmul_sizes:
            a, b = (jax.device_put(rng.standard_normal((n, n), np.float32).astype(dtype), device)
                    for _ in range(2))
            fn = jax.jit(lambda x, y, p=precision: jnp.matmul(x, y, precision=p))
            itemsize = jnp.dtype(dtype).itemsize
            out.append(Kernel("matmul", dtype_name, f"{n},{n},{n}", 2.0 * n ** 3, 3.0 * n * n * itemsize,
                              fn, (a, b)))
    for nbytes in copy_bytes:
        x = jax.device_put(np.ones((nbytes // 4,), np.float32), device)
        out.append(Kernel("copy", "fp32", str(nbytes // 4), 0.0, 2.0 * (nbytes // 4) * 4,
                          jax.jit(lambda v: v * 2.0 + 1.0), (x,)))
    return out


# --------------------------------------------------------------------------- layer shares


class LocalShare(jm.TensorParallel):
    """One device's share of a tensor-parallel layer with its collectives left out: the
    layer code runs on weights cut to 1/tp and every communication step is skipped (or,
    where the shapes need it, replaced by the local copy a gather would produce)."""

    def __init__(self, size: int):
        self.size = size

    def embed(self, table, ids):
        return jnp.take(table, ids % table.shape[0], axis=0)

    def local(self, x, axis: int):
        n = x.shape[axis] // self.size
        return lax.slice_in_dim(x, 0, n, axis=axis)

    def slice_channels(self, x):
        return x[..., : x.shape[-1] // self.size]

    def gather_channels(self, x):
        return jnp.concatenate([x] * self.size, axis=-1) if self.size > 1 else x


def local_shape(shape: tuple[int, ...], spec, tp: int) -> tuple[int, ...] | None:
    """A parameter's shape on one of ``tp`` devices (None: tp does not divide it)."""
    out = list(shape)
    for dim, name in enumerate(tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))):
        if name == "tp":
            if out[dim] % tp:
                return None
            out[dim] //= tp
    return tuple(out)


@dataclass(frozen=True)
class LayerShare:
    """One device's share of one layer at one tp: its weights on the device (made once,
    for every sample count) and its forward and forward+backward programs."""

    arch: jm.Arch
    index: int
    params: dict
    forward: Callable
    backward: Callable
    device: object
    seed: int = 0

    def inputs(self, samples: int) -> tuple:
        """The programs' arguments for ``samples`` samples: (params, x, labels)."""
        x_shape, x_dtype = jm.activation_shape(self.arch, self.index, samples)
        if jnp.issubdtype(x_dtype, jnp.integer):
            x = jax.device_put(np.zeros(x_shape, x_dtype), self.device)
        else:
            rng = np.random.default_rng(self.seed)
            x = jax.device_put(rng.standard_normal(x_shape, np.float32).astype(x_dtype), self.device)
        last = self.index == self.arch.num_layers - 1
        labels = (jax.device_put(np.zeros(jm.label_shape(self.arch, samples), np.int32), self.device)
                  if last else None)
        return self.params, x, labels


def layer_share(arch: jm.Arch, index: int, tp: int, device, seed: int = 0) -> LayerShare | None:
    """One device's share of layer ``index`` at ``tp``, or None when tp does not divide
    the layer's weights. Weights are drawn on the host (no device program per shape)."""
    shapes, specs = jm.layer_param_shapes(arch, index), jm.layer_param_specs(arch, index)
    locals_ = {k: local_shape(s.shape, specs[k], tp) for k, s in shapes.items()}
    if any(v is None for v in locals_.values()):
        return None
    state_shapes, state_specs = jm.layer_state_shapes(arch, index), jm.layer_state_specs(arch, index)
    rng = np.random.default_rng(seed)
    params = {k: jax.device_put(0.02 * rng.standard_normal(shp, np.float32), device)
              for k, shp in sorted(locals_.items())}
    state = {k: jax.device_put(np.ones(local_shape(s.shape, state_specs[k], tp), np.float32), device)
             for k, s in state_shapes.items()}
    ctx = jm.ShardCtx(tp=LocalShare(tp))
    last = index == arch.num_layers - 1
    differentiable_x = not jnp.issubdtype(jm.activation_shape(arch, index, 1)[1], jnp.integer)

    def scalar(p, h, y):
        out, _ = jm.apply_layer(arch, index, p, state, h, ctx)
        if last:
            return jm.loss_fn(out, y, ctx.tp)
        return out.astype(jnp.float32).mean()

    forward = jax.jit(lambda p, h, y: jm.apply_layer(arch, index, p, state, h, ctx)[0])
    backward = jax.jit(jax.grad(scalar, argnums=(0, 1) if differentiable_x else (0,)))
    return LayerShare(arch, index, params, forward, backward, device, seed)


def compile_all(programs: Sequence[tuple[Callable, Sequence]], workers: int) -> list:
    """Each ``(jitted program, args)`` compiled for its args: ``[(compiled, temp bytes)]``
    in order. Tracing and lowering run here one by one (Python); XLA's compiles, which
    release the GIL, run on ``workers`` threads at once."""
    return compile_lowered([program.lower(*args) for program, args in programs], workers)


def compile_lowered(lowered: Sequence, workers: int) -> list:
    """Each lowered program compiled, ``[(compiled, temp bytes)]`` in order, on ``workers``
    threads at once."""
    if workers <= 1 or len(lowered) <= 1:
        return [_compiled_temp_bytes(lo) for lo in lowered]
    with ThreadPoolExecutor(max_workers=min(workers, len(lowered))) as pool:
        return list(pool.map(_compiled_temp_bytes, lowered))


def _compiled_temp_bytes(lowered):
    compiled = lowered.compile()
    try:
        analysis = compiled.memory_analysis()
        temp = int(analysis.temp_size_in_bytes) if analysis is not None else None
    except (AttributeError, NotImplementedError, RuntimeError):
        temp = None
    return compiled, temp


def distinct_layers(arch: jm.Arch) -> dict[tuple, list[int]]:
    """Layer indices grouped by what makes two layers interchangeable (same kind, shapes)."""
    groups: dict[tuple, list[int]] = {}
    for i in range(arch.num_layers):
        groups.setdefault(jm.layer_signature(arch, i), []).append(i)
    return groups
