"""The per-stage (MPMD) pipeline the runtime ran before its SPMD program: the oracle.

Each stage is its own jitted program on its own ``("dp", "tp")`` mesh, XLA partitions it
automatically, and activations move between stages with ``jax.device_put`` (so it runs
in one process only). GPipe order: every micro-batch forward, then backward in reverse;
gradients accumulate and the optimizer applies once. Nothing of it is shared with the
SPMD program (``job_scripts.pipeline``) but the layer code, so the tests compare their
losses and states, and ``benchmarks/spmd_pipeline.py`` compares their step times.

State is kept per layer and named by the global layer index (``params/layer_003/wqkv``),
as the SPMD program's checkpoints name it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimator import jax_models as jm
from estimator.cells import StagePlan
from estimator.errors import SpecError
from job_scripts.plan import ParallelPlan, check_plan

log = logging.getLogger(__name__)


def layer_key(index: int) -> str:
    return f"layer_{index:03d}"


def _flatten(prefix: str, tree: Any) -> dict[str, Any]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        out[f"{prefix}/{name}" if name else prefix] = leaf
    return out


def _to_host(x) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _put(host: np.ndarray, sharding: NamedSharding):
    """Host array → global array; every process holds the whole host array."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _is_spec(x) -> bool:
    return isinstance(x, P)


class _StageRunner:
    """One pipeline stage on its device group: compiled functions and its state."""

    def __init__(self, arch: jm.Arch, plan: StagePlan, micro_batch: int, remat: bool,
                 devices: Sequence, optimizer):
        self.plan = plan
        self.mesh = Mesh(np.asarray(devices).reshape(plan.dp, plan.tp), ("dp", "tp"))
        self.stage = jm.Stage(arch, plan.layer_start, plan.layer_end, micro_batch, remat)
        self.batch_sharding = NamedSharding(self.mesh, P("dp"))
        act = self.batch_sharding
        ctx = jm.ShardCtx(act=lambda x: jax.lax.with_sharding_constraint(x, act))
        self.layers = list(self.stage.layers)
        named = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        self.templates = {
            "params": [jm.layer_param_shapes(arch, i) for i in self.layers],
            "state": [jm.layer_state_shapes(arch, i) for i in self.layers],
        }
        param_specs = [jm.layer_param_specs(arch, i) for i in self.layers]
        self.templates["opt"] = [jax.eval_shape(optimizer.init, t) for t in self.templates["params"]]
        specs = {
            "params": param_specs,
            "state": [jm.layer_state_specs(arch, i) for i in self.layers],
            "opt": [optimizer.specs(sp, t) for sp, t in zip(param_specs, self.templates["params"])],
        }
        self.shardings = {k: [jax.tree.map(named, tree, is_leaf=_is_spec) for tree in v]
                          for k, v in specs.items()}
        stage, sh = self.stage, self.shardings

        self._forward = jax.jit(lambda p, s, x: jm.stage_forward(stage, p, s, x, ctx)[0],
                                out_shardings=act)
        self._grad = jax.jit(lambda p, s, x, t: jm.stage_grad(stage, p, s, x, t, ctx))
        self._accumulate = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)

        def update(params, grads, opt_state, scale):
            grads = jax.tree.map(lambda g: g * scale, grads)
            pairs = [optimizer.update(g, o, p) for p, g, o in zip(params, grads, opt_state)]
            return [p for p, _ in pairs], [o for _, o in pairs]

        self._update = jax.jit(update, donate_argnums=(0, 2),
                               out_shardings=(sh["params"], sh["opt"]))

        def init(key):
            params = [jm.init_layer_params(arch, i, jax.random.fold_in(key, i)) for i in self.layers]
            return (params, [jm.init_layer_state(arch, i) for i in self.layers],
                    [optimizer.init(p) for p in params])

        self._init = jax.jit(init, out_shardings=(sh["params"], sh["state"], sh["opt"]))
        self.values: dict[str, list] = {}

    def init(self, seed: int) -> None:
        # Keys folded from the global layer index, and the default (partitionable) threefry
        # generator: the same weights whatever the stage split and the tp sharding.
        key = jax.random.key(seed)
        p, s, o = self._init(key)
        self.values = {"params": p, "state": s, "opt": o}

    def named_state(self) -> dict[str, Any]:
        out = {}
        for kind, trees in self.values.items():
            for i, tree in zip(self.layers, trees):
                out.update(_flatten(f"{kind}/{layer_key(i)}", tree))
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        values = {}
        for kind, templates in self.templates.items():
            trees = []
            for n, i in enumerate(self.layers):
                leaves_t, treedef = jax.tree.flatten(templates[n])
                names = list(_flatten(f"{kind}/{layer_key(i)}", templates[n]))
                shardings = treedef.flatten_up_to(self.shardings[kind][n])
                leaves = []
                for name, t, sh in zip(names, leaves_t, shardings):
                    if name not in arrays:
                        raise SpecError("checkpoint", name,
                                        "missing from the checkpoint: was it written for another model?")
                    a = arrays[name]
                    if tuple(a.shape) != tuple(t.shape):
                        raise SpecError(name, tuple(a.shape), f"the model expects shape {tuple(t.shape)}")
                    leaves.append(_put(a.astype(t.dtype), sh))
                trees.append(jax.tree.unflatten(treedef, leaves))
            values[kind] = trees
        self.values = values


class Trainer:
    """Runs training steps of one model under one plan on a list of devices.

    Args:
        arch: the model (``estimator.jax_models.Arch``).
        plan: stages (layers, dp, tp), micro-batch count, remat.
        devices: the devices, at least ``plan.num_gpus``; stage s takes the next dp·tp.
        global_batch: samples per step, whatever the plan.
        optimizer: applied per layer.
    """

    def __init__(self, arch: jm.Arch, plan: ParallelPlan, devices: Sequence, global_batch: int,
                 optimizer):
        check_plan(plan, arch, global_batch, len(devices))
        self.arch, self.plan, self.global_batch = arch, plan, global_batch
        self.micro_batch = global_batch // plan.micro_batches
        self.stages: list[_StageRunner] = []
        offset = 0
        for sp in plan.stages:
            self.stages.append(_StageRunner(arch, sp, self.micro_batch, plan.remat,
                                            devices[offset:offset + sp.num_gpus], optimizer))
            offset += sp.num_gpus

    def init(self, seed: int) -> None:
        """Fresh parameters (identical for every plan given the seed) and optimizer state."""
        for st in self.stages:
            st.init(seed)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Every array of the training state, full and on the host, by plan-independent name."""
        out = {}
        for st in self.stages:
            out.update({k: _to_host(v) for k, v in st.named_state().items()})
        return out

    def array_specs(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Name → shape and dtype of every array :meth:`state_arrays` returns."""
        out = {}
        for st in self.stages:
            for kind, templates in st.templates.items():
                for i, tree in zip(st.layers, templates):
                    out.update(_flatten(f"{kind}/{layer_key(i)}", tree))
        return out

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Reshard full host arrays (from any plan's checkpoint) onto this plan."""
        for st in self.stages:
            st.load(arrays)

    def step(self, inputs: np.ndarray, targets: np.ndarray) -> float:
        """One training step on one global batch; returns its mean loss."""
        mb, size = self.plan.micro_batches, self.micro_batch
        stages, last = self.stages, len(self.stages) - 1
        grads: list = [None] * len(stages)
        losses, saved = [], []
        # GPipe: all forwards first; the dispatch is asynchronous, so stage s works on
        # micro-batch m+1 while stage s+1 works on micro-batch m.
        for m in range(mb):
            x = _put(inputs[m * size:(m + 1) * size], stages[0].batch_sharding)
            per_stage = []
            for s, st in enumerate(stages[:-1]):
                per_stage.append(x)
                y = st._forward(st.values["params"], st.values["state"], x)
                x = jax.device_put(y, stages[s + 1].batch_sharding)
            per_stage.append(x)
            saved.append(per_stage)
        for m in range(mb):
            t = _put(targets[m * size:(m + 1) * size], stages[last].batch_sharding)
            for s in range(last, -1, -1):
                st = stages[s]
                loss, g, gx, new_state = st._grad(st.values["params"], st.values["state"],
                                                  saved[m][s], t)
                st.values["state"] = new_state
                grads[s] = g if grads[s] is None else st._accumulate(grads[s], g)
                if loss is not None:
                    losses.append(loss)
                if s > 0:
                    t = jax.device_put(gx, stages[s - 1].batch_sharding)
            saved[m] = None
        scale = 1.0 / mb
        for s, st in enumerate(stages):
            st.values["params"], st.values["opt"] = st._update(
                st.values["params"], grads[s], st.values["opt"], scale)
        return float(np.mean([float(_to_host(loss)) for loss in losses]))
