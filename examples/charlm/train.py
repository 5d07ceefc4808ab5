"""A researcher's own model on their own data, trained elastically by slurm-ext.

A small causal transformer over bytes (flax), trained with optax's AdamW on the text file
beside this script. Nothing here is slurm-ext's model code: the script only asks the
runtime API (``job_scripts.runtime``) for what the scheduler decided and for the
elastic protocol:

- ``runtime.start()``: the allocation, the job's settings (``#ELASTIC`` lines), the plan
  the daemon chose, and CPU fake devices when there are no GPUs;
- ``job.mesh()`` and ``job.param_shardings(...)``: the plan's data × tensor parallelism;
- ``job.resume(...)``: the state of the last checkpoint, read into this plan's shardings,
  and the step to continue from; ``job.sample_of(step)``: the exact sample to read next;
- ``job.micro_batches``: gradient accumulation, so the global batch never changes;
- ``job.stop_requested()`` / ``job.finish(...)``: SIGUSR1 → checkpoint → exit 86.

Run it under Slurm with ``sbatch examples/charlm/train.sbatch`` (see docs/own-model.md),
or on its own: ``python examples/charlm/train.py --iterations 20 --global-batch 16 --devices 4``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from job_scripts import runtime

HERE = Path(__file__).resolve().parent
SEQ_LEN = 64  # bytes a sample predicts
WIDTH, DEPTH, HEADS = 64, 2, 4  # as model.yaml tells the scheduler


class ByteWindows:
    """The text as samples of SEQ_LEN + 1 bytes, in a fresh shuffled order every epoch.

    Sample i depends on i alone, so a job resumed at sample i reads exactly what an
    uninterrupted one would have.
    """

    def __init__(self, path: Path, seq_len: int, seed: int = 0):
        try:
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)
        except OSError as e:
            raise runtime.SpecError("data", str(path), f"cannot read it: {e.strerror or e}") from None
        if len(data) < seq_len + 1:
            raise runtime.SpecError("data", str(path), f"{len(data)} bytes: give at least {seq_len + 1}, one sample")
        self.windows = data[:(len(data) - 1) // seq_len * seq_len + 1]
        self.count, self.seq_len, self.seed = (len(data) - 1) // seq_len, seq_len, seed
        self._epoch: tuple[int, np.ndarray] | None = None  # the last epoch's order, shuffled once

    def sample(self, i: int) -> np.ndarray:
        epoch, k = divmod(i, self.count)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.count))
        start = self._epoch[1][k] * self.seq_len
        return self.windows[start:start + self.seq_len + 1]

    def batch(self, first: int, size: int) -> np.ndarray:
        return np.stack([self.sample(i) for i in range(first, first + size)])


def build_model():
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attention")(
                nn.LayerNorm()(x), mask=mask)
            h = nn.gelu(nn.Dense(4 * WIDTH, name="mlp_in")(nn.LayerNorm()(x)))
            return x + nn.Dense(WIDTH, name="mlp_out")(h)

    class ByteTransformer(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(256, WIDTH)(tokens) + self.param(
                "position", nn.initializers.normal(0.02), (SEQ_LEN, WIDTH))[None, :tokens.shape[1]]
            for i in range(DEPTH):
                x = Block(name=f"block_{i}")(x)
            return nn.Dense(256, name="head")(nn.LayerNorm()(x))

    return ByteTransformer()


def megatron_rule(path, shape):
    """Tensor parallelism as Megatron splits a transformer: attention by heads, the MLP's
    first matrix by columns and its second by rows. Optimizer moments follow their
    parameters (their paths end the same way)."""
    from jax.sharding import PartitionSpec as P
    names = [str(getattr(k, "key", k)) for k in path]
    if "attention" in names and len(names) >= 2:
        proj, leaf = names[-2], names[-1]
        if proj in ("query", "key", "value"):  # kernel (width, heads, head_dim), bias (heads, head_dim)
            return P(None, "tp", None) if leaf == "kernel" else P("tp", None)
        if proj == "out":  # kernel (heads, head_dim, width), bias (width,)
            return P("tp", None, None) if leaf == "kernel" else P()
    if "mlp_in" in names:
        return P(None, "tp") if len(shape) == 2 else P("tp")
    if "mlp_out" in names and len(shape) == 2:
        return P("tp", None)
    return P()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int)
    parser.add_argument("--global-batch", type=int)
    parser.add_argument("--devices", type=int)
    parser.add_argument("--checkpoint-dir")
    args = parser.parse_args(argv)
    try:
        job = runtime.start(iterations=args.iterations, global_batch=args.global_batch, devices=args.devices,
                            checkpoint_dir=args.checkpoint_dir, require=("iterations",),
                            identity={"model": "charlm-byte-transformer"})
        mesh = job.mesh()
    except runtime.SpecError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return runtime.EXIT_BAD_INPUT

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    try:
        data = ByteWindows(HERE / "data.txt", SEQ_LEN)
    except runtime.SpecError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return runtime.EXIT_BAD_INPUT
    model = build_model()
    tx = optax.adamw(3e-3)
    micro = job.micro_batches

    def init(key):
        params = model.init(key, jnp.zeros((1, SEQ_LEN), jnp.int32))
        return {"params": params, "opt": tx.init(params)}

    abstract = jax.eval_shape(init, jax.random.key(0))
    shardings = job.param_shardings(abstract, megatron_rule)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    try:
        state, first = job.resume(target)
    except (runtime.SpecError, runtime.CheckpointError) as e:  # another model's, or none readable
        print(f"train.py: error: {e}", file=sys.stderr)
        return runtime.EXIT_BAD_INPUT
    if state is None:
        state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
    batch_sharding = NamedSharding(mesh, P(None, "dp"))  # [micro-batch, sample, byte]

    @partial(jax.jit, donate_argnums=0)
    def train_step(state, tokens):
        def loss_of(params, chunk):
            logits = model.apply(params, chunk[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, chunk[:, 1:]).mean()

        def accumulate(total, chunk):
            loss, grads = jax.value_and_grad(loss_of)(state["params"], chunk)
            return jax.tree.map(jnp.add, total, (loss, grads)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(accumulate, zero, tokens)
        loss, grads = loss / micro, jax.tree.map(lambda g: g / micro, grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    step = first - 1
    while step < job.iterations:
        if job.stop_requested():
            break
        step += 1
        host = data.batch(job.sample_of(step), job.global_batch)
        host = host.reshape(micro, job.global_batch // micro, SEQ_LEN + 1)
        tokens = jax.make_array_from_callback(host.shape, batch_sharding, lambda idx: host[idx])
        t0 = time.perf_counter()
        state, loss = train_step(state, tokens)
        job.record_step(step, float(loss), time.perf_counter() - t0)
        if job.checkpoint_due(step):
            job.save(step, state)
    return job.finish(step, state)  # checkpoints, waits for the writes, says how to exit


if __name__ == "__main__":
    sys.exit(main())
