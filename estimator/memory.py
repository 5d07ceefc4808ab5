"""Memory model: peak bytes per GPU of one pipeline stage under a plan.

Model states (mixed precision: compute-dtype weights and gradients, fp32 master copy,
optimizer states; ZeRO levels shard them across data parallelism) plus activations
(Korthikanti et al. / Frenzy for transformers: per layer s·h·(10 + 24/t) + 5·a·s²/t bytes at
fp16; under layer-level rematerialization only each layer's input is kept, and one layer's
full activations live during its recomputation). GPipe keeps every in-flight micro-batch's
activations until its backward pass. A fixed reserve covers the CUDA context, XLA
workspace and fragmentation.
"""

from dataclasses import dataclass

from estimator.models import DTYPE_BYTES, LayerSpec, ModelSpec

# Optimizer state bytes per parameter, kept in fp32 (Adafactor's factored second moment
# is O(rows + cols), negligible per parameter; no momentum as in the measured MoE runs).
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adafactor": 0.0, "sgd": 4.0}


@dataclass(frozen=True)
class MemoryOptions:
    # 0: replicate; 1: shard optimizer states and master weights across dp; 2: also
    # gradients (what XLA does with reduce-scatter gradient sync, as the measured runs did);
    # 3: also weights.
    zero_level: int = 2
    reserve_gb: float = 1.0  # CUDA context, workspace, fragmentation
    usable_frac: float = 0.9  # of the GPU's memory the framework may take


@dataclass(frozen=True)
class StageMemory:
    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    activations_gb: float
    reserve_gb: float

    @property
    def peak_gb(self) -> float:
        return self.weights_gb + self.gradients_gb + self.optimizer_gb + self.activations_gb + self.reserve_gb


def state_bytes_per_param(model: ModelSpec) -> tuple[float, float, float]:
    """(weights, gradients, master + optimizer) bytes per parameter."""
    d = DTYPE_BYTES[model.dtype]
    master = 4.0 if d < 4 else 0.0
    return float(d), float(d), master + OPTIMIZER_STATE_BYTES[model.optimizer]


def activation_bytes(layer: LayerSpec, tp: int) -> float:
    """Bytes one sample keeps through a layer without rematerialization, under tp."""
    split = layer.activation_bytes - layer.activation_bytes_tp_shared
    return layer.activation_bytes_tp_shared + split / tp


def stage_memory(model: ModelSpec, layers: tuple[LayerSpec, ...], dp: int, tp: int,
                 micro_batch: int, in_flight: int, remat: bool,
                 options: MemoryOptions = MemoryOptions()) -> StageMemory:
    """Peak memory per GPU of a stage.

    Args:
        layers: the stage's layers.
        dp, tp: data- and tensor-parallel degrees inside the stage.
        micro_batch: samples per micro-batch on one data-parallel replica.
        in_flight: micro-batches whose activations are alive at once (GPipe: all of them).
        remat: layer-level rematerialization.
    """
    params = sum(layer.params for layer in layers) / tp
    w_b, g_b, o_b = state_bytes_per_param(model)
    z = options.zero_level
    weights = params * w_b / (dp if z >= 3 else 1)
    grads = params * g_b / (dp if z >= 2 else 1)
    opt = params * o_b / (dp if z >= 1 else 1)
    if remat:
        kept = sum(layer.output_bytes for layer in layers)
        live = max(activation_bytes(layer, tp) for layer in layers)
        acts = micro_batch * (in_flight * kept + live)
    else:
        acts = micro_batch * in_flight * sum(activation_bytes(layer, tp) for layer in layers)
    gb = 1e-9
    return StageMemory(weights * gb, grads * gb, opt * gb, acts * gb, options.reserve_gb)
