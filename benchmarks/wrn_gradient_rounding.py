"""Why a Wide-ResNet's gradients differ between plans: float32 rounding, not the plan.

At a fixed micro-batch count, a tiny Wide-ResNet's first-step update differs between data
parallelism 1, 2 and 4 by up to a few per cent on some batches. This script shows where
that comes from. For each batch it measures, as the relative norm of the difference:

- ``reorder_fp32``: one device, plain ``jax.grad`` of the layer code over the whole batch,
  against the same batch with its samples in another order (the same sum, another
  rounding);
- ``reorder_fp64``: the same in float64 (the layer code's compute dtype switched to
  float64 in a child process);
- ``runner_dp2_vs_dp1``, ``runner_dp4_vs_dp1``: the runner's pipeline
  (``job_scripts.pipeline``), one step of SGD, the update of plan ``[dp2]`` or ``[dp4]``
  against ``[dp1]``, in float32 and in float64 (weights and optimizer state stay float32).

Max-pooling picks one input per window and a ReLU gates each unit; a float32 rounding that
moves the winner or the sign sends that gradient elsewhere, and batch norm spreads it over
the channel. If float64 makes the plans agree (to the float32 weights' rounding) as it
makes reordering exact, the plans compute the same gradient.

Usage: ``python benchmarks/wrn_gradient_rounding.py [--batches 12] [--out FILE]``
"""

import argparse
import multiprocessing
import os
import statistics
import sys

from estimator.compiled import child_xla_flags

# This script is an entry point: the fake device count must be set before JAX starts.
os.environ["XLA_FLAGS"] = child_xla_flags(4, os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARCH = dict(family="wide_resnet", base_channels=4, width=2, image_size=32, num_classes=8,
            compute_dtype="fp32", optimizer="sgd_nesterov")
BATCH = 16


def _relative(a, b) -> float:
    import numpy as np
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _batches(count: int) -> list[tuple[int, int]]:
    """(data seed, step) of each batch measured."""
    return [(seed, step) for seed in range(count) for step in (1, 2, 3, 4)][:count]


def one_device_spread(batches: list[tuple[int, int]], float64: bool) -> dict[str, list[float]]:
    """On one device, plain ``jax.grad`` of the layer code over the whole batch, against:
    the same batch with its samples reordered (``reorder``), and the batch split into 2 or
    4 data-parallel replicas under ``vmap`` with the runner's collectives
    (``job_scripts.collectives.StageCollectives``: batch norm's statistics and their
    backward over the replicas), each replica's gradient of its own mean loss averaged as
    the runner does (``dp2``, ``dp4``). Each entry: relative change, one per batch."""
    import jax
    if float64:
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    from estimator import jax_models as jm
    from job_scripts.collectives import StageCollectives
    from job_scripts.data import stream_for
    if float64:  # this child process only: the layer code computes in float64
        jm.DTYPES["fp32"] = jnp.float64
    arch = jm.Arch(**ARCH)
    dtype = np.float64 if float64 else np.float32
    params = [jax.tree.map(lambda a: a.astype(dtype), jm.init_layer_params(arch, i, jax.random.PRNGKey(i)))
              for i in range(arch.num_layers)]
    states = [jm.init_layer_state(arch, i) for i in range(arch.num_layers)]

    def loss(params, x, y, ctx=jm.NO_SHARD):
        for i in range(arch.num_layers):
            x, _ = jm.apply_layer(arch, i, params[i], states[i], x, ctx)
        return jm.loss_fn(x, y, ctx.tp)

    grad = jax.jit(jax.grad(loss))

    def replicas(dp: int):
        ctx = jm.ShardCtx(tp=StageCollectives((), ("dp",), dp))
        each = jax.vmap(jax.grad(lambda p, x, y: loss(p, x, y, ctx)), (None, 0, 0), axis_name="dp")
        return jax.jit(lambda p, x, y: jax.tree.map(lambda g: g.mean(axis=0), each(
            p, x.reshape(dp, -1, *x.shape[1:]), y.reshape(dp, -1))))

    split = {dp: replicas(dp) for dp in (2, 4)}

    def flat(tree):
        return np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(tree)])

    order = np.random.default_rng(0)
    spread = {"reorder": [], "dp2": [], "dp4": []}
    for seed, step in batches:
        b = stream_for(arch, seed, BATCH).batch(step)
        x = b.inputs.astype(dtype)
        whole = flat(grad(params, x, b.targets))
        p = order.permutation(BATCH)
        spread["reorder"].append(_relative(flat(grad(params, x[p], b.targets[p])), whole))
        for dp, fn in split.items():
            spread[f"dp{dp}"].append(_relative(flat(fn(params, x, b.targets)), whole))
    return spread


def runner_spread(batches: list[tuple[int, int]], float64: bool) -> dict[str, list[float]]:
    """The runner's first-step update of plans ``[dp2]`` and ``[dp4]`` against ``[dp1]``
    (relative difference, one per batch), computing in float64 or float32."""
    if float64:  # this child process only: the layer code computes in float64
        import jax
        import jax.numpy as jnp
        jax.config.update("jax_enable_x64", True)
        from estimator import jax_models as jm
        jm.DTYPES["fp32"] = jnp.float64
    dp1, dp2, dp4 = (plan_updates(batches, dp) for dp in (1, 2, 4))
    return {"dp2_vs_dp1": [_relative(a, b) for a, b in zip(dp2, dp1)],
            "dp4_vs_dp1": [_relative(a, b) for a, b in zip(dp4, dp1)]}


def plan_updates(batches: list[tuple[int, int]], dp: int) -> list:
    """The first step's weight update of plan ``[dp<dp>]`` (one stage, one micro-batch) for
    each batch, flattened."""
    import jax
    import numpy as np

    from estimator import jax_models as jm
    from estimator.cells import StagePlan
    from estimator.jax_optim import sgd_nesterov
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import ParallelPlan
    arch = jm.Arch(**ARCH)
    plan = ParallelPlan((StagePlan(0, arch.num_layers, dp, 1),), 1, True, 0)
    pipe = Pipeline(arch, plan, jax.devices()[:dp], BATCH, sgd_nesterov(lr=1e-3))
    updates = []
    for seed, step in batches:
        state = pipe.init(0)
        before = pipe.host_arrays(state)
        b = stream_for(arch, seed, BATCH).batch(step)
        state, _ = pipe.step(state, b.inputs, b.targets)
        after = pipe.host_arrays(state)
        updates.append(np.concatenate([(after[k].astype(np.float64) - before[k]).ravel()
                                       for k in sorted(after) if k.startswith("params/")]))
    return updates


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "worst": max(values)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=12, help="batches to measure (default 12)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    batches = _batches(args.batches)
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:  # float64 stays in the children
        fp64 = pool.apply(one_device_spread, (batches, True))
    with context.Pool(1) as pool:
        runner64 = pool.apply(runner_spread, (batches, True))
    fp32, runner32 = one_device_spread(batches, False), runner_spread(batches, False)
    rows = [{"data_seed": seed, "step": step,
             **{f"one_device_{k}_fp32": v[i] for k, v in fp32.items()},
             **{f"one_device_{k}_fp64": v[i] for k, v in fp64.items()},
             **{f"runner_{k}_fp32": v[i] for k, v in runner32.items()},
             **{f"runner_{k}_fp64": v[i] for k, v in runner64.items()}}
            for i, (seed, step) in enumerate(batches)]
    from bench_output import emit
    emit({"arch": ARCH, "global_batch": BATCH, "micro_batches": 1,
          "summary": {k: _summary([r[k] for r in rows])
                      for k in rows[0] if k not in ("data_seed", "step")},
          "rows": rows}, args.out)


if __name__ == "__main__":
    main()
