"""One SPMD program per plan: pipeline stages as a mesh axis, micro-batches moved between
stages by collective permutes, GPipe inside one jitted step.

The mesh has an axis ``pp`` (one entry per stage) and, for the devices of a stage, axes
``d0, d1, …`` of size 2. A stage with tensor parallelism 2^j uses the last j of them as
its tensor-parallel axes and the others as its data-parallel axes, so stages of one plan
may split their devices differently (``[dp2tp2|dp4tp1]``) and tensor-parallel groups
are always consecutive devices (within a node). The devices are taken in
``jax.devices()`` order: stage s gets the s-th block, so on several nodes the stages
are spread over the nodes and the permutes between stages cross them.

Every device runs the same program (``shard_map``); its stage index selects, with
``lax.switch``, the code of its stage, whose collectives run over that stage's groups.
Each device keeps its stage's weights, optimizer state and model state in flat buffers
(``job_scripts.stage_arrays``). One step:

1. forward: for ticks t = 0 … M+S−2, stage s runs micro-batch t−s (if any), keeps the
   residuals of its backward pass (the vjp's, packed: per-layer inputs under remat,
   every intermediate without) in its row of a residual buffer that the pipeline keeps
   from step to step (every row is written before it is read), and sends its output to
   stage s+1 (``ppermute``);
2. backward: for ticks t = 0 … M+S−2, stage s takes micro-batch t−(S−1−s) back through
   its residuals and sends the input gradient to stage s−1, accumulating weight
   gradients;
3. the gradients are averaged over each stage's data-parallel group and every stage
   applies its optimizer (under ZeRO-2 each micro-batch's are summed as they come and a
   device accumulates only its chunk, ``job_scripts.flat_optimizer``; under ZeRO-3 the
   weights are split too, each layer's gathered where it runs, ``job_scripts.zero3``).

A stage with nothing to do in a tick (the pipeline bubble) takes an idle branch, so the
bubble costs time, as on real pipelines, but no work. The loss and the update are those
of the whole global batch whatever the plan: micro-batches are gradient accumulation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimator import jax_models as jm
from job_scripts.collectives import StageCollectives, to_receiver, to_sender
from job_scripts.flat_optimizer import SEGMENT_DTYPE, FlatOptArrays, SplitBuffers
from job_scripts.packing import (FlatLayout, add_buffers, flat_layout, joint_lengths, pack, pack_range,
                                  read_row, unpack)
from job_scripts.plan import ParallelPlan, check_plan, log2
from job_scripts.precision import as_arrays, finite_everywhere, from_arrays, new_loss_scale, unscale
from job_scripts.stage_arrays import KINDS, StageArrays
from job_scripts.zero3 import SplitParams, gathered_layer, layer_chunking

log = logging.getLogger(__name__)

PP = "pp"
# Raised when the step's memory or time changes enough that measurements of the earlier
# program no longer describe it (benchmarks record it with what they measure):
# 2 (2026-11-26): elementwise optimizers step the flat buffers in place, ZeRO-1.
# 3 (2026-11-27): under remat the loss runs inside the last layer's checkpoint, so a
#   pipeline's residual rows keep no log-softmax.
# 4 (2026-11-27): a pipeline whose stages are split alike steps its optimizer outside the
#   stage switch, in place.
# 5 (2026-11-27): a pipeline's zero rows (an idle tick's output and residuals) are made
#   inside the step; held as constants of the program they took one residual row more.
# 6 (2026-11-27): a single stage adds each micro-batch's gradients into the accumulator
#   slot by slot (no packed copy of them), and the flat update of a state with two
#   segments or more (AdamW's μ, ν) steps piece by piece in place, outside a stage's
#   switch and ZeRO-2 (stepped whole, XLA copied the whole optimizer state).
# 7 (2026-11-27): a single stage's flat update steps in pieces too (revision 6 left it
#   whole: its one-branch stage switch took the switch branches' whole step).
# 8 (2026-11-27): a pipeline's backward branch writes each micro-batch's weight gradients
#   into their packed buffer layer by layer (concatenated whole, XLA nested two
#   concatenations and held the inner one beside the buffer).
# 9 (2026-11-30): a single stage of two micro-batches or more sums each weight's
#   gradient as its own array and packs the sum once (summed into the packed buffer slot
#   by slot, XLA on a GPU rewrote the whole buffer for each slot: gpt-1.3b on an H200,
#   two micro-batches, 1.86 s a step, now 0.29).
PROGRAM_REVISION = 9
# The revisions that changed only pipelines' programs (a single stage's is unchanged),
# those that changed only a single stage's, and those that changed only programs of two
# micro-batches or more of whole weights' gradients (not ZeRO-2's or 3's split ones).
PIPELINE_ONLY_REVISIONS = frozenset({3, 4, 5, 8})
SINGLE_STAGE_ONLY_REVISIONS = frozenset({7, 9})
WHOLE_GRADIENT_SUM_ONLY_REVISIONS = frozenset({9})


def describes_current(revision: int, stages: int, micro_batches: int, split_gradients: bool = False) -> bool:
    """Whether a measurement of a plan of ``stages`` stages and ``micro_batches`` (its
    gradients split over dp: ZeRO-2 or 3 with data parallelism) on the runner of program
    ``revision`` still describes the current program: no later revision changed it."""
    later = range(revision + 1, PROGRAM_REVISION + 1)
    only = SINGLE_STAGE_ONLY_REVISIONS if stages > 1 else PIPELINE_ONLY_REVISIONS
    if micro_batches == 1 or split_gradients:
        only = only | WHOLE_GRADIENT_SUM_ONLY_REVISIONS
    return all(r in only for r in later)


@dataclass(frozen=True)
class PlacedStage:
    """A stage of the plan with its collectives over its mesh axes."""

    index: int
    layers: range
    dp: int
    tp: int
    coll: StageCollectives


def device_axes(devices_per_stage: int) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(log2(devices_per_stage)))


def place_stages(plan: ParallelPlan) -> tuple[PlacedStage, ...]:
    axes = device_axes(plan.stages[0].num_gpus)
    out = []
    for s, sp in enumerate(plan.stages):
        tp_bits = log2(sp.tp)
        dp_axes, tp_axes = axes[:len(axes) - tp_bits], axes[len(axes) - tp_bits:]
        out.append(PlacedStage(s, range(sp.layer_start, sp.layer_end), sp.dp, sp.tp,
                               StageCollectives(tp_axes, dp_axes, dp_size=sp.dp, size=sp.tp,
                                                expert_parallel=sp.ep)))
    return tuple(out)


@dataclass
class Residuals:
    """What one stage's forward keeps for its backward: which vjp leaves are its own
    weights (taken again from the buffers) and where the others lie in the packed
    residual buffers. ``treedef`` is filled in when the forward pass is traced."""

    kinds: tuple[int | None, ...]  # per vjp leaf: index among the stage's weights, or None
    layout: FlatLayout
    treedef: object = None


class Pipeline:
    """Training steps of one model under one plan, as one SPMD program over ``devices``.

    Args:
        arch: the model.
        plan: its stages, micro-batches and rematerialization.
        devices: the job's devices (all processes'), in ``jax.devices()`` order.
        global_batch: samples per step, whatever the plan.
        optimizer: the optimizer (``estimator.jax_optim``), applied per layer.
    """

    def __init__(self, arch: jm.Arch, plan: ParallelPlan, devices, global_batch: int, optimizer):
        check_plan(plan, arch, global_batch, len(devices))
        self.arch, self.plan, self.optimizer = arch, plan, optimizer
        self.global_batch, self.micro = global_batch, global_batch // plan.micro_batches
        self.stages = place_stages(plan)
        n = plan.stages[0].num_gpus
        self.axes = (PP,) + device_axes(n)
        grid = np.asarray(devices, dtype=object).reshape((len(self.stages),) + (2,) * (len(self.axes) - 1))
        self.mesh = Mesh(grid, self.axes)
        # An fp16 model's gradients are scaled (job_scripts.precision); the scale is state
        # of the job like the weights, carried from step to step here and checkpointed
        # (set by ``init`` or ``set_loss_scale``; made only then, so that a pipeline of
        # compile-only devices, which take no arrays, can be built and compiled).
        self.scaled = arch.compute_dtype == "fp16"
        self.loss_scale = None
        self.last_step_finite: jax.Array | None = None  # fp16: False when the last step was skipped
        self.arrays = {kind: [StageArrays(arch, st.layers, kind, st.tp, optimizer,
                                          ep=st.dp * st.tp if st.coll.expert_parallel else 1)
                              for st in self.stages] for kind in KINDS}
        # A kind with no arrays (no batch norm) keeps a one-element buffer: trees stay alike.
        self.lengths = {kind: joint_lengths([a.layout for a in self.arrays[kind]]) or {"float32": 1}
                        for kind in KINDS}
        if optimizer.elementwise and not any(st.coll.expert_parallel for st in self.stages):
            # One elementwise step over each stage's whole weight buffer (its state split
            # over dp under ZeRO-1, the buffer padded to split evenly).
            splits = [st.dp if plan.zero_level else 1 for st in self.stages]
            if self._zero3:
                # ZeRO-3: every layer's weights split over dp (job_scripts.zero3).
                cuts = [layer_chunking(params, st.dp) for st, params in zip(self.stages, self.arrays["params"])]
                self.lengths["params"][SEGMENT_DTYPE] = n = max(c.length for c in cuts)
                self.arrays["opt"] = [FlatOptArrays(opt, params, c.span, c.split, optimizer, chunking=c, chunk=n)
                                      for c, opt, params in zip(cuts, self.arrays["opt"], self.arrays["params"])]
                self.arrays["params"] = [SplitParams(p, c, n) for c, p in zip(cuts, self.arrays["params"])]
            else:
                n = self.lengths["params"][SEGMENT_DTYPE]
                self.lengths["params"][SEGMENT_DTYPE] = n = -(-n // max(splits)) * max(splits)
                self.arrays["opt"] = [FlatOptArrays(opt, params, n, split, optimizer) for split, opt, params in
                                      zip(splits, self.arrays["opt"], self.arrays["params"])]
            self.lengths["opt"] = joint_lengths([a.local_layout for a in self.arrays["opt"]])
        self.container_spec = P(PP, self.axes[1:] or None, None)
        # Activations sent over each boundary, in the sender's batch slicing.
        self.act_layouts = [flat_layout([self._output_struct(st)]) for st in self.stages[:-1]]
        self.act_lengths = joint_lengths(self.act_layouts) or {"float32": 1}
        # What each stage keeps from its forward pass for its backward (pipelines only).
        self.residuals = self._probe_residuals() if len(self.stages) > 1 else []
        self.res_lengths = joint_lengths([r.layout for r in self.residuals]) or {"float32": 1}
        self.stash_spec = P(PP, self.axes[1:] or None, None, None)
        self._stash: dict | None = None  # the residual rows, kept from step to step
        self._step = self._build_step()
        self._init = self._build_init()

    # ------------------------------------------------------------------ shapes

    def _local_batch(self, st: PlacedStage) -> int:
        return self.micro // st.dp

    def _input_struct(self, st: PlacedStage):
        shape, dtype = jm.activation_shape(self.arch, st.layers.start, self._local_batch(st))
        return jax.ShapeDtypeStruct(shape, dtype)

    def _output_struct(self, st: PlacedStage):
        shape, dtype = jm.activation_shape(self.arch, st.layers.stop, self._local_batch(st))
        return jax.ShapeDtypeStruct(shape, dtype)

    def input_spec(self) -> P:
        """How the inputs ``[micro-batches, micro-batch, ...]`` lie: over stage 0's dp axes."""
        return P(None, self.stages[0].coll.dp_axes or None)

    def target_spec(self) -> P:
        return P(None, self.stages[-1].coll.dp_axes or None)

    # ------------------------------------------------------------------ one stage

    def _stage_fn(self, st: PlacedStage, model_state, target):
        """f(params, x) -> (output or loss, new model state) of one micro-batch."""
        stage = jm.Stage(self.arch, st.layers.start, st.layers.stop, self._local_batch(st),
                         self.plan.remat)
        ctx = jm.ShardCtx(tp=st.coll)
        last = st.index == len(self.stages) - 1
        arrays, remat_layer = self.arrays["params"][st.index], None
        if isinstance(arrays, SplitParams):
            axes, dtype = st.coll.dp_axes, jm.DTYPES[self.arch.compute_dtype]

            def remat_layer(i, one):  # ZeRO-3: the layer's weights gathered where it runs
                return gathered_layer(lambda region, s, h: one(arrays.layer_weights(i, region), s, h),
                                      axes, arrays.split, dtype)

        def f(params, x):
            # The loss inside the last layer's checkpoint: under remat a pipeline's rows
            # keep no log-softmax (docs/estimator.md, memory).
            finish = (lambda out: jm.loss_fn(out, target, st.coll)) if last else None
            return jm.stage_forward(stage, params, model_state, x, ctx, finish, remat_layer)
        return f

    def _weights(self, st: PlacedStage, params_b: dict) -> list:
        """What a stage's forward takes of its weight buffers: per layer, its tree, or
        under ZeRO-3 this device's chunk."""
        arrays = self.arrays["params"][st.index]
        return arrays.pieces(params_b) if isinstance(arrays, SplitParams) else arrays.unpack(params_b)

    def _stage_vjp(self, st: PlacedStage, params, model_state, x, target):
        """(output, vjp, new state); the first stage's input (tokens) is not differentiated."""
        f = self._stage_fn(st, model_state, target)
        if st.index == 0:
            return jax.vjp(lambda p: f(p, x), params, has_aux=True)
        return jax.vjp(f, params, x, has_aux=True)

    def _classify(self, vjp, params) -> tuple[list, list]:
        """Split the vjp's leaves into references to the stage's weights and the rest."""
        weights = jax.tree.leaves(params)
        kinds, rest = [], []
        for leaf in jax.tree.leaves(vjp):
            i = next((k for k, w in enumerate(weights) if leaf is w), None)
            kinds.append(i)
            if i is None:
                rest.append(leaf)
        return kinds, rest

    def _probe_residuals(self) -> list[Residuals]:
        """Trace each stage's forward once, abstractly, to size the residual buffers."""
        found: dict[int, Residuals] = {}

        def probe(params, state):
            params = {dt: b[0, 0] for dt, b in params.items()}
            state = {dt: b[0, 0] for dt, b in state.items()}
            for st in self.stages:
                p = self._weights(st, params)
                ms = self.arrays["state"][st.index].unpack(state)
                x = jnp.zeros(self._input_struct(st).shape, self._input_struct(st).dtype)
                target = jnp.zeros(jm.label_shape(self.arch, self._local_batch(self.stages[-1])), jnp.int32)
                _, vjp, _ = self._stage_vjp(st, p, ms, x, target)
                kinds, rest = self._classify(vjp, p)
                found[st.index] = Residuals(tuple(kinds), flat_layout(rest))
            return jnp.zeros(())

        args = [self._abstract_buffers(kind) for kind in ("params", "state")]
        specs = tuple({k: self.container_spec for k in a} for a in args)
        jax.eval_shape(jax.shard_map(probe, mesh=self.mesh, in_specs=specs, out_specs=P(),
                                     check_vma=False), *args)
        return [found[st.index] for st in self.stages]

    def _abstract_stash(self) -> dict:
        """The residual rows of every device: one per micro-batch and a spare (the tiny
        ``[..., 1]`` of a one-stage plan, which keeps none)."""
        shape = (len(self.stages), self.plan.stages[0].num_gpus, self.plan.micro_batches + 1)
        sharding = NamedSharding(self.mesh, self.stash_spec)
        return {dt: jax.ShapeDtypeStruct(shape + (n,), dt, sharding=sharding)
                for dt, n in self.res_lengths.items()}

    def _zero_stash(self) -> dict:
        return {dt: jax.jit(lambda a=a: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)()
                for dt, a in self._abstract_stash().items()}

    def _abstract_buffers(self, kind: str) -> dict:
        shape = (len(self.stages), self.plan.stages[0].num_gpus)
        sharding = NamedSharding(self.mesh, self.container_spec)
        return {dt: jax.ShapeDtypeStruct(shape + (n,), dt, sharding=sharding)
                for dt, n in self.lengths[kind].items()}

    # ------------------------------------------------------------------ the step

    def _switch(self, branches, *args):
        """Run the branch of this device's stage."""
        return lax.switch(lax.axis_index(PP), branches, *args)

    @property
    def _chunked(self) -> bool:
        """ZeRO-2 with data parallelism: gradients accumulate as this device's chunk."""
        return self.plan.zero_level == 2 and bool(self.stages[0].coll.dp_axes)

    @property
    def _zero3(self) -> bool:
        """ZeRO-3 with data parallelism: weights split too, gathered layer by layer."""
        return self.plan.zero_level >= 3 and bool(self.stages[0].coll.dp_axes)

    def _gradients(self, st: PlacedStage, g_params, by_layer: bool = False) -> dict:
        """A micro-batch's weight gradients as the step accumulates them: packed whole
        (``by_layer``, in a pipeline's backward branch: layer by layer into zeros, since
        there XLA nests a whole buffer's concatenation and holds the inner one beside it;
        a single stage's is written in place, where zeros would be a second buffer), or
        under ZeRO-2 summed over dp array by array (in place) and only this device's
        chunk of the packed sum built, from the arrays it overlaps (one branch per dp
        rank, each static), so no second whole buffer exists; under ZeRO-3 each layer's
        chunk of the sum, as its reduce-scatter left it (``job_scripts.zero3``)."""
        arrays = self.arrays["params"][st.index]
        if isinstance(arrays, SplitParams):  # ZeRO-3: each layer's chunk of the sum
            return arrays.pack_pieces(g_params, self.lengths["params"])
        if not self._chunked:
            return arrays.pack(g_params, self.lengths["params"], by_layer)
        flat, axes = self.arrays["opt"][st.index], st.coll.dp_axes
        leaves = arrays.flat(jax.tree.map(lambda g: lax.psum(g, axes), g_params))
        c = flat.chunk
        ranks = [lambda lv, r=r: pack_range(arrays.layout, lv, SEGMENT_DTYPE, r * c, (r + 1) * c)
                 for r in range(flat.split)]
        return {SEGMENT_DTYPE: lax.switch(lax.axis_index(axes), ranks, leaves)}

    def _build_step(self):
        S, M = len(self.stages), self.plan.micro_batches
        forward_pairs = [(s, s + 1) for s in range(S - 1)]
        backward_pairs = [(s + 1, s) for s in range(S - 1)]

        # The zero rows are made inside the step, where XLA fills them as it needs them:
        # arrays made here would be constants of the program, a residual row held for good.
        def act_zero():
            return {dt: jnp.zeros((n,), dt) for dt, n in self.act_lengths.items()}

        def res_zero():
            return {dt: jnp.zeros((n,), dt) for dt, n in self.res_lengths.items()}

        def local(bufs):  # [1, 1, L] → [L]
            return {dt: b[0, 0] for dt, b in bufs.items()}

        def forward_idle(params_b, state_b, act_b, xs, ys, t):
            return act_zero(), res_zero(), state_b, jnp.zeros((), jnp.float32)

        def backward_idle(params_b, ct_b, stash, m, scale):
            return act_zero(), zero_grads(params_b)

        pipelined = S > 1
        fwd = [self._forward_branch(st, act_zero) for st in self.stages] + [forward_idle] if pipelined else []
        bwd = [self._backward_branch(st, act_zero) for st in self.stages] + [backward_idle] if pipelined else []
        upd = [self._update_branch(st) for st in self.stages]
        losses = [self._loss_branch(st) for st in self.stages]
        # Stages whose update is one program (the flat elementwise step, over the same
        # data-parallel axes and ZeRO split) take it outside the stage switch, where XLA
        # sums the gradients over dp in place; inside a branch the sum takes a buffer of
        # its own. Without data parallelism the branch holds less (the GPU-target
        # compiles: 4-stage gpt-760m 3.0 GB of temporaries in the branch, 4.0 outside).
        # A single stage's is one program too, stepped in pieces (revision 7).
        flat = [self.arrays["opt"][st.index] for st in self.stages]
        uniform_update = (not pipelined or bool(self.stages[0].coll.dp_axes)) \
            and all(isinstance(a, FlatOptArrays) for a in flat) \
            and len({(st.coll.dp_axes, a.split) for st, a in zip(self.stages, flat)}) == 1
        # ZeRO-2 (stages split alike, ``check_plan``): every micro-batch's gradients are
        # summed over dp as they come (``_gradients``), and a device accumulates its chunk.
        dp_axes = self.stages[0].coll.dp_axes
        chunked, zero3 = self._chunked, self._zero3

        def zero_grads(params):
            return flat[0].zero_chunk() if chunked else {dt: jnp.zeros_like(b) for dt, b in params.items()}

        def body(params, opt, state, stash, xs, ys, *scaling):
            params, opt, state = local(params), local(opt), local(state)
            s, before = lax.axis_index(PP), state
            scale = from_arrays(*scaling) if scaling else None

            if S == 1:
                # No pipeline: each micro-batch goes forward and straight back, and nothing
                # is kept between them (gradient accumulation).
                def micro_batch(carry, m):
                    grads, state, loss = carry
                    grads, state, l_m = self._accumulate(params, state, xs, ys, m, grads, scale)
                    return (grads, state, loss + l_m), None

                layout = self.arrays["params"][0].layout
                by_leaf = self._accumulates_by_leaf
                start = [jnp.zeros(s.shape, s.dtype) for s in layout.slots] if by_leaf else zero_grads(params)
                (grads, state, loss), _ = lax.scan(
                    micro_batch, (start, state, jnp.zeros((), jnp.float32)), jnp.arange(M))
                if by_leaf:
                    grads = pack(layout, grads, self.lengths["params"])
                return finish(params, opt, state, grads, loss, local(stash), scale, before)

            def forward_tick(carry, t):
                act, res, state, loss = carry
                m = t - s
                busy = (m >= 0) & (m < M)
                out, packed, state, l_m = lax.switch(jnp.where(busy, s, S), fwd, params, state, act, xs, ys, t)
                # An idle tick writes its (zero) residuals to the spare last row.
                row = jnp.where(busy, m, M)
                res = {dt: lax.dynamic_update_index_in_dim(r, packed[dt], row, 0) for dt, r in res.items()}
                out = {dt: lax.ppermute(v, PP, forward_pairs) for dt, v in out.items()}
                return (out, res, state, loss + l_m), None

            # Every micro-batch's residuals, one row each (and a spare): GPipe keeps them all
            # until the backward passes start. The rows are the last step's, overwritten
            # before they are read: zeroing them afresh every step took a fifth of it on CPU.
            (_, stash, state, loss), _ = lax.scan(
                forward_tick, (act_zero(), local(stash), state, jnp.zeros((), jnp.float32)),
                jnp.arange(M + S - 1))

            def backward_tick(carry, t):
                ct, grads = carry
                m = t - (S - 1 - s)
                busy = (m >= 0) & (m < M)
                ct_out, g = lax.switch(jnp.where(busy, s, S), bwd, params, ct, stash, jnp.clip(m, 0, M - 1), scale)
                grads = add_buffers(grads, g)  # an idle tick's are zeros
                ct_out = {dt: lax.ppermute(v, PP, backward_pairs) for dt, v in ct_out.items()}
                return (ct_out, grads), None

            (_, grads), _ = lax.scan(backward_tick, (act_zero(), zero_grads(params)), jnp.arange(M + S - 1))
            return finish(params, opt, state, grads, loss, stash, scale, before)

        def update(params, opt, grads):
            if uniform_update or chunked or zero3:
                return flat[0].update(params, opt, grads, dp_axes, self.lengths["opt"],
                                      reduced=chunked or zero3, split_weights=zero3)
            return self._switch(upd, params, opt, grads)

        def finish(params, opt, state, grads, loss, stash, scale, before):
            if scale is None:
                params, opt = update(params, opt, grads)
            else:
                # fp16: a step whose scaled gradients overflowed on any device is skipped
                # on all, weights, optimizer state and model state alike.
                grads = unscale(grads, scale)
                finite = finite_everywhere(grads, self.axes)
                params, opt, state = lax.cond(finite, lambda: (*update(params, opt, grads), state),
                                              lambda: (params, opt, before))
                scale = scale.adjust(finite)
            loss = lax.psum(self._switch(losses, loss), PP) if S > 1 else self._switch(losses, loss)
            expand = lambda bufs: {dt: b[None, None] for dt, b in bufs.items()}  # noqa: E731
            out = expand(params), expand(opt), expand(state), expand(stash), loss
            return out if scale is None else out + as_arrays(scale) + (finite,)

        c = {kind: {dt: self.container_spec for dt in self.lengths[kind]} for kind in KINDS}
        c_stash = {dt: self.stash_spec for dt in self.res_lengths}
        # The scale crosses the program's edge as its two arrays (jmp's class rebuilt from
        # abstract arguments, as lowering does, fails its own dtype check).
        scaled = (P(), P()) if self.scaled else ()
        skipped = (P(),) if scaled else ()
        mapped = jax.shard_map(body, mesh=self.mesh,
                               in_specs=(c["params"], c["opt"], c["state"], c_stash, self.input_spec(),
                                         self.target_spec()) + scaled,
                               out_specs=(c["params"], c["opt"], c["state"], c_stash, P()) + scaled + skipped,
                               check_vma=False)
        return jax.jit(mapped, donate_argnums=(0, 1, 2, 3))

    def _forward_branch(self, st: PlacedStage, act_zero):
        """Stage ``st``'s forward tick: the micro-batch it holds through the stage,
        its residuals packed into a row and its output (or the loss, on the last stage)."""
        S, M = len(self.stages), self.plan.micro_batches
        arrays = self.arrays
        res = self.residuals[st.index]
        last = st.index == S - 1

        def run(params_b, state_b, act_b, xs, ys, t):
            m = jnp.clip(t - st.index, 0, M - 1)
            params = self._weights(st, params_b)
            model_state = arrays["state"][st.index].unpack(state_b)
            if st.index == 0:
                x = xs[m]
            else:
                prev = self.stages[st.index - 1]
                x = to_receiver(unpack(self.act_layouts[prev.index], act_b)[0], prev.coll, st.coll)
            out, vjp, new_state = self._stage_vjp(st, params, model_state, x, ys[m])
            res.treedef = jax.tree.structure(vjp)
            _, rest = self._classify(vjp, params)
            packed = pack(res.layout, rest, self.res_lengths)
            state_out = arrays["state"][st.index].pack(new_state, self.lengths["state"])
            if last:
                return act_zero(), packed, state_out, out.astype(jnp.float32) / M
            return pack(self.act_layouts[st.index], [out], self.act_lengths), packed, state_out, \
                jnp.zeros((), jnp.float32)
        return run

    def _backward_branch(self, st: PlacedStage, act_zero):
        """Stage ``st``'s backward tick: micro-batch ``m``'s residuals from the stash,
        the cotangent through the stage, the input gradient passed back."""
        S, M = len(self.stages), self.plan.micro_batches
        res = self.residuals[st.index]
        last = st.index == S - 1

        def run(params_b, ct_b, stash, m, scale):
            params = self._weights(st, params_b)
            weights = jax.tree.leaves(params)
            rest = iter(read_row(res.layout, stash, m))
            leaves = [weights[k] if k is not None else next(rest) for k in res.kinds]
            vjp = jax.tree.unflatten(res.treedef, leaves)
            if last:
                # The objective is the mean over the last stage's dp group of its devices'
                # losses: each device seeds its share, and every stage sums its group's
                # gradients (the input gradients it passes back are already so scaled).
                cot = _seed(M * st.dp, scale)
            else:
                cot = unpack(self.act_layouts[st.index], ct_b)[0]
            grads = vjp(cot)
            g_params = self._gradients(st, grads[0], by_layer=True)
            if st.index == 0:
                return act_zero(), g_params
            prev = self.stages[st.index - 1]
            g_x = to_sender(grads[1], prev.coll, st.coll)
            return pack(self.act_layouts[prev.index], [g_x], self.act_lengths), g_params
        return run

    def _update_branch(self, st: PlacedStage):
        """Stage ``st``'s optimizer step on its dp-summed gradients."""
        arrays = self.arrays

        def run(params_b, opt_b, grads_b):
            coll, layout = st.coll, arrays["params"][st.index]
            if isinstance(arrays["opt"][st.index], FlatOptArrays):
                return arrays["opt"][st.index].update(params_b, opt_b, grads_b, coll.dp_axes, self.lengths["opt"],
                                                      in_pieces=False)
            if coll.expert_parallel and coll.dp_axes:
                # An expert's gradient is whole on its own device (the all-to-alls brought
                # it every token's part); the other weights' are summed over dp.
                grads = layout.map_leaves(layout.unpack(grads_b),
                                          lambda leaf, g: g if leaf.expert else lax.psum(g, coll.dp_axes))
            else:
                grads = layout.unpack({dt: lax.psum(g, coll.dp_axes) if coll.dp_axes else g
                                       for dt, g in grads_b.items()})
            params = layout.unpack(params_b)
            opt = arrays["opt"][st.index].unpack(opt_b)
            new = [self._layer_update(g, o, p, sp, coll) for p, g, o, sp in zip(params, grads, opt, layout.specs)]
            return (arrays["params"][st.index].pack([p for p, _ in new], self.lengths["params"]),
                    arrays["opt"][st.index].pack([o for _, o in new], self.lengths["opt"]))
        return run

    def _layer_update(self, grads, opt, params, specs, coll):
        """One layer's optimizer step; under expert parallelism the experts' weights take
        theirs with sums over the devices that split them (the data-parallel group)."""
        experts = [k for k in jm.EXPERT_PARAMS if k in params] if coll.expert_parallel else []
        if not experts:
            return self.optimizer.update(grads, opt, params, specs, coll)
        rest = [k for k in params if k not in experts]

        def pick(tree, keys):
            return {k: tree[k] for k in keys}

        def part(state, keys):  # every optimizer's state: a count and params-shaped trees
            return {n: v if n == "count" else pick(v, keys) for n, v in state.items()}

        p_e, o_e = self.optimizer.update(pick(grads, experts), part(opt, experts), pick(params, experts),
                                         pick(specs, experts), coll.expert_sums())
        p_r, o_r = self.optimizer.update(pick(grads, rest), part(opt, rest), pick(params, rest),
                                         pick(specs, rest), coll)
        return {**p_r, **p_e}, {n: v if n == "count" else {**v, **o_e[n]} for n, v in o_r.items()}

    def _loss_branch(self, st: PlacedStage):
        """The step's loss as stage ``st`` reports it (0 but on the last stage)."""
        S = len(self.stages)

        def run(loss):
            if st.index != S - 1:
                return jnp.zeros((), jnp.float32)
            return lax.pmean(loss, st.coll.dp_axes) if st.coll.dp_axes else loss
        return run

    @property
    def _accumulates_by_leaf(self) -> bool:
        """A single stage of whole weights over several micro-batches sums each weight's
        gradient as its own array and packs the sum once, after the last micro-batch.
        One micro-batch needs no sum: XLA writes its gradients straight into the packed
        buffer. Summed into the packed buffer slot by slot, XLA on a GPU rewrote the whole
        buffer for each slot (gpt-1.3b on an H200, two micro-batches: 1.86 s a step, 0.29
        now); packed whole each micro-batch (revision 1: 0.33 s), a second buffer beside
        the sum through the backward."""
        return len(self.stages) == 1 and self.plan.micro_batches > 1 \
            and not (isinstance(self.arrays["params"][0], SplitParams) or self._chunked)

    def _accumulate(self, params_b, state_b, xs, ys, m, grads, scale):
        """Forward and backward of micro-batch m on the only stage: (grads, state, loss)."""
        st, M = self.stages[0], self.plan.micro_batches
        params = self._weights(st, params_b)
        model_state = self.arrays["state"][0].unpack(state_b)
        loss, vjp, new_state = self._stage_vjp(st, params, model_state, xs[m], ys[m])
        (g_params,) = vjp(_seed(M * st.dp, scale))
        if self._accumulates_by_leaf:
            leaves = self.arrays["params"][0].flat(g_params)
            grads = [acc + g.astype(acc.dtype) for acc, g in zip(grads, leaves, strict=True)]
        else:
            grads = add_buffers(grads, self._gradients(st, g_params))
        return (grads,
                self.arrays["state"][0].pack(new_state, self.lengths["state"]), loss.astype(jnp.float32) / M)

    # ------------------------------------------------------------------ init

    def _build_init(self):
        def branch(st: PlacedStage):
            def run(seed):
                key = jax.random.key(seed)
                rank = st.coll.position()
                trees = {
                    "params": [jm.init_layer_params(self.arch, i, jax.random.fold_in(key, i))
                               for i in st.layers],
                    "state": [jm.init_layer_state(self.arch, i) for i in st.layers],
                }
                params = self.arrays["params"][st.index]
                base = params.base if isinstance(params, SplitParams) else params
                local = {"params": base.local_of_global(trees["params"], rank),
                         "state": self.arrays["state"][st.index].local_of_global(trees["state"], rank)}
                out = {"state": self.arrays["state"][st.index].pack(local["state"], self.lengths["state"])}
                if isinstance(params, SplitParams):  # ZeRO-3: this device's chunk of every layer
                    whole = base.pack(local["params"], dict(base.layout.lengths))
                    out["params"] = params.local_of_packed(whole, rank // st.tp, self.lengths["params"])
                else:
                    out["params"] = base.pack(local["params"], self.lengths["params"])
                opt = self.arrays["opt"][st.index]
                if isinstance(opt, FlatOptArrays):
                    out["opt"] = opt.init(self.lengths["opt"])
                else:
                    shapes = base.global_trees()
                    trees = [self.optimizer.init(p, s) for p, s in zip(local["params"], shapes)]
                    out["opt"] = opt.pack(trees, self.lengths["opt"])
                return tuple(out[k] for k in KINDS)
            return run

        branches = [branch(st) for st in self.stages]

        def body(seed):
            out = self._switch(branches, seed)
            return tuple({dt: b[None, None] for dt, b in bufs.items()} for bufs in out)

        c = tuple({dt: self.container_spec for dt in self.lengths[k]} for k in KINDS)
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(), out_specs=c, check_vma=False))

    # ------------------------------------------------------------------ public

    def set_loss_scale(self, saved: dict | None = None) -> None:
        """An fp16 model's loss scale: a checkpoint's (``precision.to_json``), or the
        initial one (None); nothing for other models."""
        if self.scaled:
            self.loss_scale = new_loss_scale(NamedSharding(self.mesh, P()), saved)

    def init(self, seed: int) -> dict:
        """Fresh weights (identical for every plan given the seed) and optimizer state
        (and an fp16 model's initial loss scale, unless one was set or ``init`` is being
        traced: ``jax.eval_shape(pipe.init, 0)`` must leave no tracer behind)."""
        if self.scaled and self.loss_scale is None and not isinstance(seed, jax.core.Tracer):
            self.set_loss_scale()
        params, opt, state = self._init(jnp.asarray(seed, jnp.int32))
        return {"params": params, "opt": opt, "state": state}

    def place_batch(self, inputs: np.ndarray, targets: np.ndarray):
        """Host arrays of the global batch (every process holds all of it) → device arrays."""
        M = self.plan.micro_batches
        xs = inputs.reshape((M, self.micro) + inputs.shape[1:])
        ys = targets.reshape((M, self.micro) + targets.shape[1:])
        put = lambda a, spec: jax.make_array_from_callback(  # noqa: E731
            a.shape, NamedSharding(self.mesh, spec), lambda idx: a[idx])
        return put(xs, self.input_spec()), put(ys, self.target_spec())

    def step(self, state: dict, inputs: np.ndarray, targets: np.ndarray) -> tuple[dict, jax.Array]:
        """One training step on one global batch; returns the new state and the mean loss
        (an fp16 model's step is skipped, the state returned unchanged, when its scaled
        gradients overflowed: ``loss_scale``)."""
        xs, ys = self.place_batch(inputs, targets)
        if self._stash is None:
            self._stash = self._zero_stash()
        if self.scaled and self.loss_scale is None:
            self.set_loss_scale()
        scaling = as_arrays(self.loss_scale) if self.scaled else ()
        params, opt, model_state, self._stash, loss, *scaling = self._step(
            state["params"], state["opt"], state["state"], self._stash, xs, ys, *scaling)
        if scaling:
            self.loss_scale, self.last_step_finite = from_arrays(*scaling[:2]), scaling[2]
        return {"params": params, "opt": opt, "state": model_state}, loss

    def compile(self):
        """The step compiled for abstract arguments (``.as_text()``, ``.memory_analysis()``)."""
        abstract = [self._abstract_buffers(k) for k in KINDS]
        x_shape, x_dtype = jm.activation_shape(self.arch, 0, self.micro)
        M = self.plan.micro_batches
        xs = jax.ShapeDtypeStruct((M,) + x_shape, x_dtype, sharding=NamedSharding(self.mesh, self.input_spec()))
        ys = jax.ShapeDtypeStruct((M,) + jm.label_shape(self.arch, self.micro), jnp.int32,
                                  sharding=NamedSharding(self.mesh, self.target_spec()))
        replicated = NamedSharding(self.mesh, P())
        scaling = tuple(jax.ShapeDtypeStruct((), dt, sharding=replicated)
                        for dt in (jnp.float32, jnp.int32)) if self.scaled else ()
        return self._step.lower(*abstract, self._abstract_stash(), xs, ys, *scaling).compile()

    def fits_memory(self) -> bool:
        """Whether the compiled step's peak memory fits the devices' (True when unknown)."""
        try:
            limit = self.mesh.devices.flat[0].memory_stats()["bytes_limit"]
            mem = self.compile().memory_analysis()
            peak = getattr(mem, "peak_memory_in_bytes", 0) or (
                mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
        except (AttributeError, KeyError, TypeError, NotImplementedError):
            return True
        return peak <= limit

    def host_arrays(self, state: dict) -> dict[str, np.ndarray]:
        """Every array of the state, whole, by plan-independent name (all devices must be
        this process's: for tests and small exports)."""
        out: dict[str, np.ndarray] = {}
        for kind in KINDS:
            shards = {dt: {(s.index[0].start or 0, s.index[1].start or 0): np.asarray(s.data)[0, 0]
                           for s in arr.addressable_shards} for dt, arr in state[kind].items()}
            for st in self.stages:
                arrays = self.arrays[kind][st.index]
                buffers = self._device_buffers(arrays, st, shards)
                for leaf, slot in zip(arrays.leaves, arrays.layout.slots):
                    parts, n = [], arrays.shards(leaf)
                    for rank in range(n if leaf.dim is not None else 1):
                        flat = buffers(arrays.position(leaf, rank))[slot.dtype]
                        parts.append(flat[slot.offset:slot.offset + slot.size].reshape(leaf.local_shape(n)))
                    out[leaf.name] = parts[0] if leaf.dim is None else np.concatenate(parts, axis=leaf.dim)
        return out

    @staticmethod
    def _device_buffers(arrays, st: PlacedStage, shards: dict):
        """position → the buffers a leaf's slot offsets index: the device's own, or under
        ZeRO-1 the stage's whole state gathered from its tp rank's data-parallel group."""
        def own(position):
            return {dt: by_device[(st.index, position)] for dt, by_device in shards.items()}
        if not isinstance(arrays, SplitBuffers):
            return own
        wholes = {t: arrays.whole_of_locals([own(r * st.tp + t) for r in range(arrays.split)]) for t in range(st.tp)}
        return lambda position: wholes[position % st.tp]


def _seed(shares: int, loss_scale) -> jax.Array:
    """A device's cotangent of the loss: its share of the mean, times the loss scale."""
    one = jnp.ones((), jnp.float32) / shares
    return one if loss_scale is None else one * loss_scale.loss_scale
