"""Memory model: peak bytes per GPU of one pipeline stage under a plan.

It counts what the runner's SPMD program (``job_scripts/pipeline.py``) holds, buffer by
buffer, as its GPU-target compile shows them (``docs/estimator.md``, "Memory"):

- **weights**: the fp32 master copy only. The compute-dtype (fp16) weights are cast
  inside each layer as it runs and never held whole.
- **optimizer states** (fp32): AdamW μ and ν 8 B/param (gpt), SGD momentum 4 B/param
  (wide_resnet), Adafactor's factored second moment ≈ 0 B/param and no momentum (moe).
  MoE expert weights and their states lie on their tensor-parallel (expert) shards like
  every other tensor-parallel weight; under expert parallelism (``StagePlan.ep``) they
  are split over the stage's dp × tp GPUs instead.
- **gradients**: accumulated in fp32 (the master's dtype), 4 B/param; in a pipeline, while
  a micro-batch is added to the accumulator, its own gradient is a second such buffer
  (only with more than one micro-batch). A single stage sums each weight's gradient as its
  own array and packs the sum once: a second buffer only then, before an elementwise
  update.
- **the optimizer update's temporaries**, beside the gradients. AdamW and SGD step the
  stage's flat weight buffer in place (``job_scripts/flat_optimizer.py``): SGD writes its
  one momentum buffer in place (0); AdamW steps in up to 32 pieces, each piece's weights,
  gradients, μ and ν read into buffers of their own before its writes ((4 + 4 + 8) B/param
  over the pieces, ``flat_update_bytes``; under ZeRO-2 its chunk whole, a new μν buffer of
  8 B/param). Under ZeRO-1 and 2 a device steps only its 1/dp chunk and also holds the
  chunks of the summed gradients and of its new weights (2·4 B/param over dp); the
  all-gathered weights reuse the old weights' buffer. Adafactor steps layer by layer and
  packs new weight and state buffers, keeping a copy of the old states: 4 + 2·(state
  bytes) per parameter.
- **activations**: Korthikanti et al. / Frenzy per layer (s·h·(10 + 24/t) + 5·a·s²/t
  bytes at fp16); under layer-level rematerialization only each layer's input is kept and
  one layer's full activations live during its recomputation.
- **a pipeline's residual rows** (``job_scripts/pipeline.py``): one per micro-batch and a
  spare, kept from step to step, as the runner lays them out: each layer's input under
  remat, the vjp's unfused residuals and the cast weights without (``LayerSpec.
  input_bytes``, ``residual_bytes``); the backward copies and unpacks one row; an update
  inside a stage's branch holds more (``branch_update_gb``).

The peak is the larger of two phases: forward/backward (gradients + activations) and the
update (gradients + update temporaries), on top of weights, states, a pipeline's rows and
a reserve.

ZeRO levels shard states across data parallelism (1: optimizer states and their update
temporaries; 2: also gradients; 3: also weights, each layer's weights gathered while it
runs); ZeRO-Offload keeps the master weights, the optimizer states and the update on the
host (``host_gb``) and leaves compute-dtype weights and gradients on the GPU. The runner
runs ZeRO-0 and ZeRO-1 (AdamW and SGD, whose update is elementwise, without expert
parallelism) without offload (``MemoryOptions.runnable``).
"""

from dataclasses import dataclass, replace

from estimator.errors import SpecError
from estimator.models import DTYPE_BYTES, LayerSpec, ModelSpec

# Optimizer state bytes per parameter, kept in fp32 (Adafactor's factored second moment
# is O(rows + cols), negligible per parameter; no momentum, as in the measured MoE runs).
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adafactor": 0.0, "sgd": 4.0}
MASTER_BYTES = 4.0  # fp32 master weights (the runner's only copy of the weights)
GRADIENT_BYTES = 4.0  # fp32 gradient accumulator
ZERO_LEVELS = (0, 1, 2, 3)
# Whose buffers are counted: ``runner`` (job_scripts/pipeline.py, what jobs here run) or
# ``alpa`` (the program behind the measured tables). Alpa's, as its data-parallel memory
# figures show it (MODELS.md, dp_mem; docs/estimator.md): fp16 weights and accumulated fp16
# gradients on every GPU, the fp32 master and optimizer states split over dp by its
# reduce-scatter gradient sync (run it with zero_level=1), no update copies, and GPipe
# keeping every micro-batch's stash even on one stage (the estimator's ``in_flight``).
PROGRAMS = ("runner", "alpa")
# Alpa's layer construction clusters a model into this many layers, the unit of its
# rematerialization (MODELS.md: "auto layers 16").
ALPA_AUTO_LAYERS = 16
# What job_scripts/pipeline.py runs: replicated states, or (ZeRO-1,
# job_scripts/flat_optimizer.py) states split over dp for optimizers whose update is
# elementwise, outside expert parallelism; ZeRO-2 splits the gradient accumulator too,
# where every stage is split alike; ZeRO-3 the weights too (job_scripts/zero3.py), under
# remat.
RUNNABLE_ZERO_LEVELS = (0, 1, 2, 3)
# Optimizers whose update is elementwise: the runner steps their flat buffers in place
# and can split their states over dp (job_scripts/flat_optimizer.py).
# Per parameter, what their update holds beside the gradients when stepped whole, as
# inside a pipeline's stage switch (the GPU-target compiles, docs/estimator.md): XLA
# copies AdamW's μ ν buffer; SGD's momentum is written in place.
WHOLE_UPDATE_BYTES = {"adamw": 8.0, "sgd": 0.0}
ELEMENTWISE_OPTIMIZERS = tuple(WHOLE_UPDATE_BYTES)
# Elsewhere the runner steps a state of two segments or more (AdamW's μ and ν) in up to
# this many pieces of at least UPDATE_PIECE_MIN elements, each read before it is written.
UPDATE_PIECES = 32
UPDATE_PIECE_MIN = 1 << 20


@dataclass(frozen=True)
class MemoryOptions:
    # 0: replicated states (the runner: gradients all-reduced); 1: optimizer states and
    # the update sharded across dp; 2: also gradients; 3: also weights.
    zero_level: int = 0
    offload: bool = False  # ZeRO-Offload: master weights, optimizer states, update on the host
    reserve_gb: float = 1.0  # CUDA context, workspace, fragmentation
    usable_frac: float = 0.9  # of the GPU's memory the framework may take
    program: str = "runner"

    def __post_init__(self):
        if self.zero_level not in ZERO_LEVELS:
            raise SpecError("zero_level", self.zero_level, "use 0, 1, 2 or 3")
        if self.program not in PROGRAMS:
            raise SpecError("program", self.program, f"use one of {', '.join(PROGRAMS)}")

    @property
    def tf32(self) -> bool:
        """Whether the program runs fp32 convolutions and matmuls on TF32 tensor cores where
        the GPU has them. The runner does (XLA's default precision): wide_resnet-500m's step
        ran at 168 TFLOP/s on an H200, 2.5× its fp32 peak (docs/gpu-measurements.md). Alpa's
        measured rows did not: at the TF32 rate the public table's A100 rows fit far worse
        (docs/estimator.md)."""
        return self.program == "runner"

    @property
    def runner_zero2(self) -> bool:
        """The runner's ZeRO-2 (``job_scripts.flat_optimizer``): each micro-batch's gradients
        summed over dp as they come, a 1/dp accumulator (memory and time count both)."""
        return self.zero_level == 2 and self.program == "runner" and not self.offload

    @property
    def runner_zero3(self) -> bool:
        """The runner's ZeRO-3 (``job_scripts.zero3``): each layer's weights gathered in the
        compute dtype twice per micro-batch (forward and recompute), its gradient
        reduce-scattered in float32 once."""
        return self.zero_level == 3 and self.program == "runner" and not self.offload

    def runnable(self, optimizer: str | None = None, expert_parallel: bool = False,
                 stages_alike: bool = True, remat: bool = True) -> bool:
        """Whether the runner can run plans with these settings today: for a model with
        this optimizer (``ModelSpec.optimizer``; None: for some model), with any stage
        expert-parallel or none, (ZeRO-2 and 3) with every stage split alike or not, and
        (ZeRO-3) with remat or not. ZeRO-2 and 3 are the runner's own (their memory counted
        as the runner holds it): an estimate of another program (``alpa``) is not one it
        runs."""
        if self.offload or self.zero_level not in RUNNABLE_ZERO_LEVELS:
            return False
        if self.zero_level == 0:
            return True
        if self.zero_level >= 2 and not (stages_alike and self.program == "runner"):
            return False
        if self.zero_level >= 3 and not remat:
            return False
        return (optimizer is None or optimizer in ELEMENTWISE_OPTIMIZERS) and not expert_parallel

    def runs_plan(self, optimizer: str | None, stages, remat: bool) -> bool:
        """`runnable` for a plan's stages (``StagePlan``s): any expert-parallel, all split alike."""
        return self.runnable(optimizer, any(s.ep for s in stages), len({(s.dp, s.tp) for s in stages}) <= 1, remat)


@dataclass(frozen=True)
class StageMemory:
    weights_gb: float
    gradients_gb: float  # one fp32 gradient buffer (the accumulator)
    optimizer_gb: float
    activations_gb: float
    reserve_gb: float
    update_gb: float = 0.0  # the optimizer update's temporaries on the GPU
    accumulating: bool = False  # more than one micro-batch: a second gradient buffer
    host_gb: float = 0.0  # host memory per GPU (ZeRO-Offload)
    # The runner's pipelines: the residual rows kept from step to step (every phase), one
    # row (the one the backward copies out of them to unpack), and what the
    # update holds more when it runs inside the stage's branch (``in_branch``: stages
    # whose updates differ) than when every stage runs the same one in place.
    stash_gb: float = 0.0
    row_gb: float = 0.0
    branch_update_gb: float = 0.0
    in_branch: bool = False
    # The runner's ZeRO-2: a micro-batch's whole gradient, summed over dp before its chunk
    # joins the split accumulator (``gradients_gb``); accumulating or not, the backward
    # holds both.
    micro_gradients_gb: float = 0.0
    # The runner's single stage of several micro-batches sums each weight's gradient as its
    # own array and packs the sum once: the packed copy beside the sum, before the update.
    packed_sum_gb: float = 0.0

    @property
    def peak_gb(self) -> float:
        second = self.micro_gradients_gb or (self.gradients_gb if self.accumulating else 0.0)
        backward = self.gradients_gb + second + self.activations_gb + self.row_gb
        update = self.gradients_gb + max(self.packed_sum_gb,
                                         self.update_gb + (self.branch_update_gb if self.in_branch else 0.0))
        return self.weights_gb + self.optimizer_gb + self.reserve_gb + self.stash_gb + max(backward, update)


def flat_update_bytes(optimizer: str, elements: float) -> float:
    """Per parameter, what the runner's flat update of ``elements`` weights holds beside
    the gradients: SGD steps its one momentum segment in place whole (nothing); AdamW
    steps in pieces, each piece's gradients, weights and moments read into buffers of
    their own before its writes (the GPU-target compiles, docs/estimator.md)."""
    if not WHOLE_UPDATE_BYTES[optimizer]:
        return 0.0
    pieces = max(1, min(UPDATE_PIECES, int(elements) // UPDATE_PIECE_MIN))
    return (MASTER_BYTES + GRADIENT_BYTES + OPTIMIZER_STATE_BYTES[optimizer]) / pieces


def state_bytes_per_param(model: ModelSpec) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per parameter the runner keeps."""
    return MASTER_BYTES, GRADIENT_BYTES, OPTIMIZER_STATE_BYTES[model.optimizer]


def host_bytes_per_param(model: ModelSpec) -> float:
    """ZeRO-Offload: master weights, optimizer states and an fp32 gradient buffer on the
    host, per parameter of the GPU's shard."""
    return MASTER_BYTES + OPTIMIZER_STATE_BYTES[model.optimizer] + GRADIENT_BYTES


def activation_bytes(layer: LayerSpec, tp: int) -> float:
    """Bytes one sample keeps through a layer without rematerialization, under tp."""
    split = layer.activation_bytes - layer.activation_bytes_tp_shared
    return layer.activation_bytes_tp_shared + split / tp


def residual_bytes(layer: LayerSpec, tp: int) -> float:
    """Bytes one sample leaves in the runner's vjp residuals through a layer without
    rematerialization, under tp."""
    split = layer.residual_bytes - layer.residual_bytes_tp_shared
    return layer.residual_bytes_tp_shared + split / tp


def remat_row_bytes(layers: tuple[LayerSpec, ...]) -> float:
    """Per sample, what a runner's stage keeps under remat: each layer's input."""
    return sum(layer.input_bytes for layer in layers)


def pipeline_row_bytes(layers: tuple[LayerSpec, ...], dp: int, tp: int, micro_batch: int, d: float,
                       expert_parallel: bool) -> float:
    """One residual row of a runner pipeline's stage without remat: its micro-batch's
    residuals and the compute-dtype copies of the weights its layers cast (the vjp keeps
    them; the embedding gathers rows instead, and fp32 weights need no copy)."""
    copies = 0.0
    if d < MASTER_BYTES:
        replicated, experts = stage_params(tuple(x for x in layers if x.kind != "embedding"), dp, tp,
                                           expert_parallel)
        copies = (replicated + experts) * d
    return micro_batch * sum(residual_bytes(layer, tp) for layer in layers) + copies


def runner_row_bytes(layers: tuple[LayerSpec, ...], dp: int, tp: int, micro_batch: float, d: float,
                     remat: bool, expert_parallel: bool) -> float:
    """One row of a runner pipeline's residual buffer for this stage."""
    if remat:
        return micro_batch * remat_row_bytes(layers)
    return pipeline_row_bytes(layers, dp, tp, micro_batch, d, expert_parallel)


def stage_params(layers: tuple[LayerSpec, ...], dp: int, tp: int, expert_parallel: bool) -> tuple[float, float]:
    """Parameters per GPU of a stage: (replicated across dp, expert-parallel). Everything is
    split over tp; with expert parallelism the experts are also split over dp."""
    total = sum(layer.params for layer in layers) / tp
    if not expert_parallel:
        return total, 0.0
    experts = sum(layer.expert_params for layer in layers) / tp
    return total - experts, experts / dp


def stage_memory(model: ModelSpec, layers: tuple[LayerSpec, ...], dp: int, tp: int,
                 micro_batch: int, in_flight: int, remat: bool,
                 options: MemoryOptions = MemoryOptions(), micro_batches: int = 1,
                 activation_bytes_per_sample: tuple[float, ...] | None = None,
                 expert_parallel: bool = False) -> StageMemory:
    """Peak memory per GPU of a stage.

    Args:
        layers: the stage's layers.
        dp, tp: data- and tensor-parallel degrees inside the stage.
        micro_batch: samples per micro-batch on one data-parallel replica.
        in_flight: micro-batches whose activations are alive at once (a pipeline: all of
            them and the runner's spare row; one stage: 1).
        remat: layer-level rematerialization.
        micro_batches: micro-batches per iteration (more than one: gradient accumulation).
        activation_bytes_per_sample: per layer, the bytes one sample holds through it under
            tp as profiled on the site's devices (``estimator.profile_store``), instead of
            the formula's ``activation_bytes``.
        expert_parallel: the MoE experts lie on all dp × tp GPUs, not replicated across dp
            (``StagePlan.ep``); ZeRO's dp sharding then applies to the other weights only.
    """
    replicated, experts = stage_params(layers, dp, tp, expert_parallel)
    # ZeRO splits over data parallelism: without it the runner runs ZeRO-0's program.
    z, d = (options.zero_level if dp > 1 else 0), float(DTYPE_BYTES[model.dtype])
    pipeline = options.program == "runner" and in_flight > 1  # the runner's residual rows
    opt_b = OPTIMIZER_STATE_BYTES[model.optimizer]

    def per_gpu(level: int) -> float:
        """Parameters per GPU of a buffer ZeRO shards across dp from ``level`` on."""
        return replicated / (dp if z >= level else 1) + experts

    host = 0.0
    if options.offload:
        # The GPU keeps compute-dtype weights and gradients; the host the rest.
        weights = per_gpu(3) * d
        grads = per_gpu(2) * d
        opt = update = 0.0
        host = (replicated / dp + experts) * host_bytes_per_param(model)
    elif options.program == "alpa":
        master = MASTER_BYTES if d < 4 else 0.0
        weights = per_gpu(3) * d
        grads = per_gpu(2) * d
        opt = per_gpu(1) * (master + opt_b)
        update = 0.0
    else:
        weights = per_gpu(3) * MASTER_BYTES
        grads = per_gpu(2) * GRADIENT_BYTES
        opt = per_gpu(1) * opt_b
        if model.optimizer in ELEMENTWISE_OPTIMIZERS and not expert_parallel:
            # The flat update in place; under ZeRO-1 and 2 on a chunk, with the chunks of the
            # summed gradients and the new weights; under ZeRO-3 the accumulator is the
            # summed chunk and the weights' chunk is stepped in place.
            # ZeRO-2 steps whole (job_scripts/flat_optimizer.py), the others in pieces.
            stepped = WHOLE_UPDATE_BYTES[model.optimizer] if z == 2 else flat_update_bytes(model.optimizer, per_gpu(1))
            update = per_gpu(1) * (stepped + (2 * MASTER_BYTES if z in (1, 2) else 0.0))
        else:
            update = per_gpu(1) * (MASTER_BYTES + 2 * opt_b)
    per_sample = activation_bytes_per_sample or tuple(activation_bytes(layer, tp) for layer in layers)
    stash = row = 0.0
    if pipeline:
        # A pipeline keeps a row per micro-batch in flight: under remat each layer's input
        # (the loss is recomputed with the last layer), without it the vjp's residuals,
        # unfused, with the compute-dtype weights its layers cast. One micro-batch's
        # forward is live beside them.
        row = runner_row_bytes(layers, dp, tp, micro_batch, d, remat, expert_parallel)
        stash = in_flight * row
        acts = micro_batch * max(per_sample)
    elif remat:
        kept = sum(layer.output_bytes for layer in layers)
        if options.program == "alpa":
            # Alpa remats its own layers (ALPA_AUTO_LAYERS clusters of the model's), keeping
            # one input per cluster: the stage's share of them.
            kept *= ALPA_AUTO_LAYERS / model.num_layers
        acts = micro_batch * (in_flight * kept + max(per_sample))
    else:
        acts = micro_batch * in_flight * sum(per_sample)
    if z >= 3:
        # Each layer's weights are gathered whole (over dp) while it runs; the runner's
        # backward holds them with their gradient, then that gradient and its float32 copy
        # for the reduce-scatter (job_scripts/zero3.py).
        largest = max(layer.params - (layer.expert_params if expert_parallel else 0) for layer in layers) / tp
        acts += largest * (d + max(d, GRADIENT_BYTES) if options.program == "runner" else d)
    gb = 1e-9
    accumulating = micro_batches > 1 and options.program == "runner"
    flat_update = model.optimizer in ELEMENTWISE_OPTIMIZERS and not expert_parallel and not options.offload
    packed_sum = 0.0
    if accumulating and not pipeline and z < 2 and not options.offload:
        # A single stage of whole weights (not ZeRO-2's chunks, nor ZeRO-3's) sums each
        # weight's gradient as its own array, no second buffer while the backward runs, and
        # packs the sum once: beside the sum before an elementwise update; a layer-by-layer
        # update slices the arrays back out, and the measured moe-690m peak on an H200
        # holds no such copy (docs/gpu-measurements.md).
        accumulating = False
        packed_sum = grads if flat_update else 0.0
    branch = 0.0
    if pipeline:
        # Inside a stage's branch the data-parallel gradient sum lands in a buffer of its
        # own, and an elementwise update, stepped whole there, holds ZeRO-0's temporaries
        # at any level (the GPU-target compiles show both; ZeRO-1 there splits only the
        # states). The pipeline runs its stages' updates there unless they are one
        # program (``estimate.pipeline_peak_gb``); the others' layer-by-layer update
        # always is.
        # Offloaded, the update runs on the host: no optimizer temporaries on the GPU.
        extra = (grads if dp > 1 else 0.0) + (
            max(0.0, (replicated + experts) * WHOLE_UPDATE_BYTES[model.optimizer] - update) if flat_update else 0.0)
        if flat_update:
            branch = extra
        else:
            update += extra
    # ZeRO-2 in the runner: each micro-batch's gradient is whole until its chunk is taken.
    micro_grads = (replicated + experts) * GRADIENT_BYTES if options.runner_zero2 and dp > 1 else 0.0
    return StageMemory(weights * gb, grads * gb, opt * gb, acts * gb, options.reserve_gb,
                       update * gb, accumulating, host * gb, stash * gb, row * gb, branch * gb,
                       micro_gradients_gb=micro_grads * gb, packed_sum_gb=packed_sum * gb)


# The runner's process on the host: Python, JAX, the CUDA context's host side, the data.
HOST_PROCESS_GB = 4.0


def host_memory_gb(mem: StageMemory) -> float:
    """Host memory per GPU a plan needs: the runner's process, a staging copy of the GPU's
    weights and optimizer states (a checkpoint copies them to the host) and whatever ZeRO-
    Offload keeps there."""
    return HOST_PROCESS_GB + mem.weights_gb + mem.optimizer_gb + mem.host_gb


def memory_alternatives(base: MemoryOptions) -> tuple[MemoryOptions, ...]:
    """Memory settings beyond ``base``, least intrusive first: ZeRO 1–3, then ZeRO-Offload
    (on ZeRO-2, as ZeRO-Offload is built, and on ZeRO-3)."""
    out = [replace(base, zero_level=z) for z in ZERO_LEVELS if z > base.zero_level]
    out += [replace(base, zero_level=max(z, base.zero_level), offload=True) for z in (2, 3)]
    return tuple(dict.fromkeys(m for m in out if m != base))


def memory_label(memory: MemoryOptions) -> str:
    """``ZeRO-3``, ``ZeRO-2 + offload`` …"""
    return f"ZeRO-{memory.zero_level}" + (" + offload" if memory.offload else "")
