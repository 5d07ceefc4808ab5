"""Model specs: the built-in families and user YAML, as a list of layers with their costs.

Every layer carries, per training sample: forward matmul-class FLOPs, the bytes that
elementwise kernels move, the activation bytes kept for the backward pass (with and without
layer-level rematerialization), the bytes of its output (what a pipeline stage sends on),
and the bytes tensor parallelism all-reduces. Architectures follow the measured tables'
sources exactly (``MODELS.md``): Alpa's BERT-style GPT (post-LN, untied head, 512-row
position table), GShard MoE (top-2, capacity 2S/E, experts on even layers, dense one-hot
dispatch einsums over [G,S,E,C]) and Wide-ResNet-50 bottlenecks.

Model YAML (a transformer)::

    name: my-gpt
    hidden: 2048
    layers: 24
    heads: 32
    sequence: 1024
    vocab: 51200
    ffn_ratio: 4          # optional, default 4 (a MoE model's dense layers: 8, the only value)
    experts: 0            # optional; >0 makes every other layer a top-2 MoE layer
    dtype: fp16           # optional: fp16, bf16, fp32
    optimizer: adamw      # optional: adamw, adafactor, sgd
"""

import math
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path

import yaml

from estimator.errors import SpecError, yaml_problem
from estimator.yaml_text import load_yaml

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
OPTIMIZERS = ("adamw", "adafactor", "sgd")
MOE_GROUP_TOKENS = 2048  # GShard expert group size S of the measured MoE models
MOE_FFN_RATIO = 8  # the dense layers of a MoE model (GShard's; the runner's too)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's costs per training sample (forward pass unless named otherwise)."""

    name: str
    kind: str  # embedding | transformer | moe | head | stem | block | classifier
    params: int
    flops_fwd: float  # matmul-class FLOPs
    elementwise_bytes: float  # bytes moved by memory-bound kernels
    activation_bytes: float  # kept for backward without rematerialization (tp = 1)
    activation_bytes_tp_shared: float  # the part of activation_bytes that tp does not split
    output_bytes: float  # the layer's output: kept under remat, sent between stages
    tp_allreduce_bytes: float  # Megatron tensor parallelism: forward all-reduce payload
    alltoall_bytes: float = 0.0  # expert dispatch + combine payload (MoE)
    batch_stat_syncs: int = 0  # BatchNorm layers: each reduces batch statistics across dp
    batch_stat_bytes: float = 0.0  # payload of one such reduction (sums per channel, fp32)
    experts: int = 0  # MoE layers: the expert count
    expert_params: int = 0  # MoE layers: the part of params in the experts
    # What the runner's backward keeps from the forward without remat (tp = 1): the
    # residuals of JAX's vjp, tensor by tensor and unfused, which a pipeline stores for
    # every micro-batch in flight (job_scripts/pipeline.py); the part tp does not split.
    residual_bytes: float = 0.0
    residual_bytes_tp_shared: float = 0.0
    input_bytes: float = 0.0  # the layer's input: what the runner keeps of it under remat
    # Convolutions: each kernel's (forward FLOPs, output elements) per sample. Its output
    # elements are its parallel work (thread blocks over output tiles), what fills the GPU;
    # its FLOPs per element (2·k²·c_in) set how long each takes (``compute.layer_time_s``).
    kernels: tuple[tuple[float, float], ...] = ()
    # The greatest common divisor of the sizes tensor parallelism splits in this layer
    # (heads, FFN width, vocabulary, experts, channels: ``jax_models.layer_param_specs``);
    # a tp degree must divide it. 0: the layer splits nothing.
    tp_split: int = 0


def tp_problem(layers, tp: int) -> str:
    """Why ``tp`` cannot split a stage of these layers ("" if it can): it must divide each
    layer's heads, FFN width, vocabulary, experts or channels, as the runner shards them."""
    bad = next((layer for layer in layers if layer.tp_split and layer.tp_split % tp), None)
    if bad is None:
        return ""
    return f"tp {tp} does not divide the {bad.tp_split} that {bad.name} splits over tensor parallelism"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # gpt | moe | wide_resnet | transformer
    layers: tuple[LayerSpec, ...]
    dtype: str
    optimizer: str
    sequence: int = 0  # tokens per sample (0 for images)
    hidden: int = 0
    heads: int = 0
    min_tokens_per_shard: int = 0  # MoE: a micro-batch shard must hold whole expert groups

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @cached_property
    def layer_classes(self) -> tuple[int, ...]:
        """For each layer, the index of the first layer with the same costs (a model's
        repeated blocks differ only by name): what to cost once and reuse."""
        first: dict[LayerSpec, int] = {}
        return tuple(first.setdefault(replace(layer, name=""), i) for i, layer in enumerate(self.layers))

    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample, without rematerialization."""
        return 3.0 * sum(layer.flops_fwd for layer in self.layers)


def _transformer_layer(i: int, s: int, h: int, a: int, ffn_ratio: int, d: int) -> LayerSpec:
    r = ffn_ratio
    params = (4 + 2 * r) * h * h + (9 + r) * h  # QKV+out+FFN weights, biases, two LayerNorms
    flops = 2 * s * (4 + 2 * r) * h * h + 4 * s * s * h  # projections + QK^T and AV
    # Korthikanti et al. (2022), generalised to FFN ratio r, scaled to the dtype's bytes:
    # LN/inputs 10sh stay whole under tp; (8 + 4r)sh and the 5as^2 score tensors split.
    shared = 10 * s * h * d / 2
    split = ((8 + 4 * r) * s * h + 5 * a * s * s) * d / 2
    elementwise = shared + split  # fused kernels touch each kept tensor about once
    res_shared, res_split = _attention_residuals(s, h, a, d)
    res_split += 4 * ffn_ratio * s * h * d  # four [s, r·h] tensors of the FFN's hidden
    return LayerSpec(f"layer{i}", "transformer", params, flops, elementwise, shared + split,
                     shared, s * h * d, 2 * s * h * d,
                     residual_bytes=res_shared + res_split, residual_bytes_tp_shared=res_shared,
                     input_bytes=s * h * d, tp_split=math.gcd(a, r * h))


def _attention_residuals(s: int, h: int, a: int, d: int) -> tuple[float, float]:
    """(whole, tp-split) bytes per sample the runner's vjp keeps of a block's attention
    half and its two LayerNorms: six fp32 [s, h] tensors and two in the compute dtype
    whole; q, k, v and the context, and the scores in fp32 and the compute dtype, split."""
    return (24 + 2 * d) * s * h, 4 * d * s * h + (4 + d) * a * s * s


def _moe_layer(i: int, s: int, h: int, a: int, experts: int, d: int) -> LayerSpec:
    S = MOE_GROUP_TOKENS
    capacity = 2 * S // experts
    expert_ffn = 8 * h
    expert_params = experts * 2 * h * expert_ffn
    params = 4 * h * h + 4 * h + 4 * h + h * experts + expert_params
    tokens_routed = 2 * s  # top-2 with capacity factor 2: E*C = 2S slots per S tokens
    flops = (2 * s * 4 * h * h + 4 * s * s * h  # attention
             + 2 * s * h * experts  # gate
             + 2 * 2 * s * experts * capacity * h  # dispatch and combine einsums
             + 2 * tokens_routed * 2 * h * expert_ffn)  # expert FFNs
    shared = 10 * s * h * d / 2 + 4 * s * experts  # LN/inputs; fp32 gate logits
    split = ((8 + 0) * s * h + 5 * a * s * s) * d / 2 \
        + tokens_routed * (3 + 4 * 8) * h * d / 2 \
        + 2 * s * experts * capacity * d  # dispatch mask and combine weights
    # Top-2 routing over [S, E, C] (fp32): per choice a one-hot of positions and a gated
    # product, each written and read (2 × 16 B); then their sum, the dispatch mask and the
    # fp16 casts feeding the two einsums (16 B). Memory-bound work beyond the kept tensors.
    routing = (2 * 16 + 16) * s * experts * capacity
    elementwise = shared + split + routing
    # GShard all-to-all: dispatch and combine each move the routed tokens once.
    alltoall = 2 * tokens_routed * h * d
    res_shared, res_split = _attention_residuals(s, h, a, d)
    # Per token: the fp16 dispatch and combine tensors (E·C slots each), the tokens in and
    # out of the experts (2 slots a token), their hidden twice and its ReLU mask, and the
    # fp32 routing's [C] and [E] vectors.
    res_split += s * (2 * d * experts * capacity + 4 * d * h + (2 * d + 1) * 2 * expert_ffn
                      + 8 * capacity + 12 * experts)
    return LayerSpec(f"layer{i}", "moe", params, flops, elementwise, shared + split, shared,
                     s * h * d, 2 * s * h * d, alltoall, experts=experts, expert_params=expert_params,
                     residual_bytes=res_shared + res_split, residual_bytes_tp_shared=res_shared,
                     input_bytes=s * h * d, tp_split=math.gcd(a, experts))


def transformer_model(name: str, family: str, *, hidden: int, layers: int, heads: int,
                      sequence: int, vocab: int, ffn_ratio: int = 4, experts: int = 0,
                      position_rows: int | None = None, dtype: str = "fp16",
                      optimizer: str = "adamw") -> ModelSpec:
    """A transformer LM as layers: embedding, blocks (MoE on even indices), LM head."""
    s, h, a, d = sequence, hidden, heads, DTYPE_BYTES[dtype]
    rows = sequence if position_rows is None else position_rows
    embed = LayerSpec("embedding", "embedding", vocab * h + rows * h + 2 * h, 0.0,
                      4 * s * h * d, 2 * s * h * d, 2 * s * h * d, s * h * d, 0.0,
                      residual_bytes=(8 + 2 * d) * s * h, residual_bytes_tp_shared=(8 + 2 * d) * s * h,
                      input_bytes=4 * s, tp_split=vocab)  # int32 tokens
    blocks = []
    for i in range(layers):
        if experts and i % 2 == 0:
            blocks.append(_moe_layer(i, s, h, a, experts, d))
        else:
            blocks.append(_transformer_layer(i, s, h, a, MOE_FFN_RATIO if experts else ffn_ratio, d))
    # Untied head: logits in the compute dtype plus an fp32 log-softmax for the loss.
    logits_bytes = s * vocab * (d + 4)
    head = LayerSpec("head", "head", vocab * h + vocab, 2 * s * h * vocab,
                     2 * logits_bytes, logits_bytes + s * h * d, s * h * d, 4.0 * s, 0.0,
                     residual_bytes=s * h * d + 4.0 * s * vocab,
                     residual_bytes_tp_shared=s * h * d, input_bytes=s * h * d, tp_split=vocab)
    return ModelSpec(name, family, (embed, *blocks, head), dtype, optimizer, s, h, a,
                     MOE_GROUP_TOKENS if experts else 0)


def wide_resnet(name: str, base_channels: int, width: int, image: int = 224,
                classes: int = 1024) -> ModelSpec:
    """Wide-ResNet-50 (ResNet-V1 bottleneck, stages [3,4,6,3]) in fp32 with SGD."""
    d = 4
    C, W = base_channels, width

    def conv(hw: int, k: int, cin: int, cout: int) -> tuple[int, float, float, int]:
        # params, forward FLOPs, output elements, channels; BN adds 2 params per channel.
        return k * k * cin * cout + 2 * cout, 2.0 * hw * hw * k * k * cin * cout, float(hw * hw * cout), cout

    def layer(lname: str, kind: str, convs: list[tuple[int, float, float, int]], in_elems: float,
              out_elems: float, tp_split: int = 0) -> LayerSpec:
        params = sum(c[0] for c in convs)
        flops = sum(c[1] for c in convs)
        # Each conv keeps its output, the BN output and the ReLU mask; plus the input.
        kept = (in_elems + sum(3 * c[2] for c in convs)) * d
        # BN statistics read the conv output; normalise + ReLU (fused) read and write it.
        moved = sum(3 * c[2] for c in convs) * d + in_elems * d
        tp_bytes = out_elems * d
        stat_bytes = 2 * 4 * max(c[3] for c in convs)  # mean and variance per channel
        # The runner's vjp keeps five fp32 tensors and a ReLU mask per output element of a
        # conv + BN + ReLU, two and a mask for the shortcut's projection (the fourth conv).
        residual = sum((5 * d + 1 if k < 3 else 2 * d + 1) * c[2] for k, c in enumerate(convs))
        return LayerSpec(lname, kind, params, flops, moved, kept, in_elems * d, out_elems * d, tp_bytes,
                         batch_stat_syncs=len(convs), batch_stat_bytes=stat_bytes,
                         residual_bytes=residual, residual_bytes_tp_shared=in_elems * d,
                         input_bytes=in_elems * d, kernels=tuple((c[1], c[2]) for c in convs),
                         tp_split=tp_split)

    stem_conv = conv(image // 2, 7, 3, C)
    hw = image // 4  # after the 3x3/2 max-pool
    layers = [layer("stem", "stem", [stem_conv], image * image * 3.0, hw * hw * C)]
    cin = C
    for stage, blocks in enumerate((3, 4, 6, 3)):
        f = C * 2 ** stage
        for b in range(blocks):
            stride = 2 if (b == 0 and stage > 0) else 1
            out_hw = hw // stride
            convs = [conv(hw, 1, cin, f), conv(out_hw, 3, f, f * W), conv(out_hw, 1, f * W, 4 * f)]
            if b == 0:
                convs.append(conv(out_hw, 1, cin, 4 * f))  # projection shortcut
            # tp splits the block's bottleneck width f (and its 4f outputs).
            layers.append(layer(f"block{stage}.{b}", "block", convs, hw * hw * cin, out_hw * out_hw * 4.0 * f, f))
            cin, hw = 4 * f, out_hw
    head_params = cin * classes + classes
    layers.append(LayerSpec("classifier", "classifier", head_params, 2.0 * cin * classes,
                            hw * hw * cin * d * 2, hw * hw * cin * d, 0.0, classes * d, classes * d,
                            input_bytes=hw * hw * cin * d, kernels=((2.0 * cin * classes, float(classes)),),
                            tp_split=classes))
    return ModelSpec(name, "wide_resnet", tuple(layers), "fp32", "sgd")


def _gpt(label: str, h: int, L: int, a: int) -> ModelSpec:
    return transformer_model(f"gpt-{label}", "gpt", hidden=h, layers=L, heads=a, sequence=1024,
                             vocab=51200, position_rows=512, dtype="fp16", optimizer="adamw")


def _moe(label: str, h: int, L: int, E: int) -> ModelSpec:
    return transformer_model(f"moe-{label}", "moe", hidden=h, layers=L, heads=16, sequence=1024,
                             vocab=32000, experts=E, dtype="fp16", optimizer="adafactor")


BUILTIN_MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("760m", 1536, 24, 16), _gpt("1.3b", 2048, 24, 32), _gpt("2.6b", 2560, 32, 32),
    _gpt("6.7b", 4096, 32, 32), _gpt("15b", 5120, 48, 40),
    _moe("690m", 768, 8, 16), _moe("1.3b", 768, 16, 16), _moe("2.4b", 1024, 16, 16),
    _moe("10b", 1536, 16, 32), _moe("27b", 2048, 16, 48),
    wide_resnet("wide_resnet-500m", 224, 2), wide_resnet("wide_resnet-1b", 320, 2),
    wide_resnet("wide_resnet-2b", 448, 2), wide_resnet("wide_resnet-4b", 640, 2),
    wide_resnet("wide_resnet-6.8b", 320, 16),
)}

_YAML_INT_FIELDS = ("hidden", "layers", "heads", "sequence", "vocab")
_YAML_LIMITS = {"hidden": 1 << 16, "layers": 1024, "heads": 1024, "sequence": 1 << 20,
                "vocab": 1 << 22, "ffn_ratio": 64, "experts": 4096}


def model_from_dict(raw: object, source: str = "<dict>") -> ModelSpec:
    """Validate a parsed model YAML mapping (a transformer) into a ModelSpec."""
    if not isinstance(raw, dict):
        raise SpecError(source, raw, "a model spec is a mapping with hidden, layers, heads, sequence, vocab")
    known = set(_YAML_LIMITS) | {"name", "dtype", "optimizer"}
    for key in raw:
        if key not in known:
            raise SpecError(str(key), raw[key], f"unknown model key; known: {', '.join(sorted(known))}")
    values = {}
    for key in (*_YAML_INT_FIELDS, "ffn_ratio", "experts"):
        if key not in raw:
            if key in _YAML_INT_FIELDS:
                raise SpecError(key, None, "required for a transformer model")
            continue
        v = raw[key]
        lowest = 0 if key == "experts" else 1
        if not isinstance(v, int) or isinstance(v, bool) or not lowest <= v <= _YAML_LIMITS[key]:
            raise SpecError(key, v, f"give an integer in [{lowest}, {_YAML_LIMITS[key]}]")
        values[key] = v
    if values["hidden"] % values["heads"]:
        raise SpecError("heads", values["heads"], f"must divide hidden={values['hidden']}")
    if values.get("experts", 0) == 1:
        raise SpecError("experts", 1, "use 0 (dense) or at least 2 experts")
    if values.get("experts") and values.get("ffn_ratio", MOE_FFN_RATIO) != MOE_FFN_RATIO:
        raise SpecError("ffn_ratio", values["ffn_ratio"], f"a MoE model's dense layers have FFN ratio "
                                                         f"{MOE_FFN_RATIO} (GShard's, as the runner builds them): "
                                                         "leave ffn_ratio out")
    dtype = str(raw.get("dtype", "fp16")).lower()
    if dtype not in DTYPE_BYTES:
        raise SpecError("dtype", dtype, f"use one of {', '.join(DTYPE_BYTES)}")
    optimizer = str(raw.get("optimizer", "adamw")).lower()
    if optimizer not in OPTIMIZERS:
        raise SpecError("optimizer", optimizer, f"use one of {', '.join(OPTIMIZERS)}")
    name = str(raw.get("name", Path(source).stem))
    family = "moe" if values.get("experts") else "transformer"
    return transformer_model(name, family, dtype=dtype, optimizer=optimizer, **values)


# A model file's size limit, for the estimator and the daemon that reads it for a job.
MAX_MODEL_FILE_BYTES = 1 << 20


def load_model(name_or_path: str) -> ModelSpec:
    """A built-in model by name (case-insensitive), or a transformer from a YAML file."""
    key = name_or_path.strip().lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    path = Path(name_or_path)
    if not path.suffix.lower() in (".yaml", ".yml") or not path.is_file():
        raise SpecError("model", name_or_path,
                        f"not a built-in ({', '.join(BUILTIN_MODELS)}) nor a readable .yaml file")
    st = path.stat()
    if st.st_size > MAX_MODEL_FILE_BYTES:
        raise SpecError("model", name_or_path, f"file larger than {MAX_MODEL_FILE_BYTES} bytes")
    # Every Cell of a job asks for its model: parse a file once per version of it.
    return _load_model_file(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=256)
def _load_model_file(path: str, mtime_ns: int, size: int) -> ModelSpec:
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as e:
        raise SpecError("model", path, yaml_problem(e)) from None
    except OSError as e:
        raise SpecError("model", path, f"cannot read: {e.strerror}") from None
    return model_from_yaml(text, path)


@lru_cache(maxsize=256)
def model_from_yaml(text: str, source: str) -> ModelSpec:
    """A transformer from a model YAML file's text (``source``: its path, for errors)."""
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as e:
        raise SpecError("model", source, yaml_problem(e)) from None
    return model_from_dict(raw, source)
