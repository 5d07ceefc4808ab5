"""The built-in model families as JAX training steps, one pipeline stage at a time.

Shared by the compiled estimator (``estimator.compiled``, which only lowers and compiles
them from abstract shapes) and the training runtime (which runs them). Everything here is
pure JAX over plain pytrees: no Flax, no optax, no global state. Optimizers are in
``estimator.jax_optim``.

Layer indexing matches the estimator's ``ModelSpec.layers``: layer 0 is the embedding (the
stem for wide_resnet), layers 1..L are the blocks, layer L+1 is the head (with the loss).
A stage is a contiguous range ``[layer_start, layer_end)``.

Families (architectures as in the measured tables, Alpa's benchmark models):

- ``gpt``: BERT-style post-LN blocks, exact GELU, no causal mask, untied LM head with bias,
  a 512-row position table; fp16 compute with fp32 master weights, AdamW.
- ``moe``: as gpt, 1,024-row position table, 8h dense FFN; even block indices are GShard
  top-2 MoE layers (ReLU experts without biases, capacity 2S/E, dense one-hot dispatch
  einsums over [G, S, E, C], S = 2,048 tokens a group); Adafactor.
- ``wide_resnet``: ResNet-V1 bottleneck blocks, batch norm, fp32, SGD with Nesterov
  momentum 0.9.

Tensor parallelism is Megatron-style: column-sharded first matmul, row-sharded second
(attention heads and FFN hidden); MoE experts are sharded over the same axis (expert
parallelism, as GShard); wide_resnet convs shard output then input channels. The sharding
is given as ``PartitionSpec`` trees over the mesh axes ``("dp", "tp")``.

The same layer code runs in two settings. On global arrays (one device, or XLA's
automatic partitioning, as the compiled estimator uses it) ``ctx.act`` pins activations
at layer boundaries and XLA inserts the collectives. On the local shards of a
hand-partitioned program (``shard_map``, as the training runtime runs it) ``ctx.tp`` is a
:class:`TensorParallel` that names Megatron's collectives explicitly: ``enter`` before a
column-parallel op (identity forward, all-reduce of the gradient), ``exit`` after a
row-parallel one (all-reduce forward, identity backward), the vocabulary-parallel
embedding and cross-entropy, the local slice of the experts or channels, and batch-norm
statistics over the data-parallel group. Its default does nothing, which is the global
setting.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from estimator.errors import SpecError

DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16, "fp32": jnp.float32}
FAMILIES = ("gpt", "moe", "wide_resnet")
WRN_STAGE_BLOCKS = (3, 4, 6, 3)


@dataclass(frozen=True)
class Arch:
    """The hyper-parameters of one model.

    Attributes:
        family: ``gpt``, ``moe`` or ``wide_resnet``.
        hidden: hidden size (gpt/moe).
        num_blocks: transformer blocks (gpt/moe); wide_resnet always has 16 bottlenecks.
        heads: attention heads.
        vocab: vocabulary size.
        seq_len: tokens per sample.
        pos_rows: rows of the position table.
        ffn_mult: FFN hidden = ffn_mult × hidden.
        experts: experts per MoE layer (moe only).
        expert_group: tokens per GShard group S (moe only).
        base_channels: C of wide_resnet; width: W of wide_resnet.
        image_size, num_classes: wide_resnet input and output.
        compute_dtype: ``fp16``, ``bf16`` or ``fp32``; master weights are always fp32.
        optimizer: ``adamw``, ``adafactor`` or ``sgd_nesterov``.
    """

    family: str
    hidden: int = 0
    num_blocks: int = 0
    heads: int = 1
    vocab: int = 0
    seq_len: int = 0
    pos_rows: int = 512
    ffn_mult: int = 4
    experts: int = 0
    expert_group: int = 2048
    base_channels: int = 0
    width: int = 0
    image_size: int = 224
    num_classes: int = 1024
    compute_dtype: str = "fp16"
    optimizer: str = "adamw"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise SpecError("family", self.family, f"use one of {', '.join(FAMILIES)}")
        if self.compute_dtype not in DTYPES:
            raise SpecError("compute_dtype", self.compute_dtype, f"use one of {', '.join(DTYPES)}")

    @property
    def num_layers(self) -> int:
        """Embedding (or stem) + blocks + head."""
        blocks = sum(WRN_STAGE_BLOCKS) if self.family == "wide_resnet" else self.num_blocks
        return blocks + 2

    @property
    def capacity(self) -> int:
        return max(1, 2 * self.expert_group // max(1, self.experts))

    def with_dtype(self, dtype: str) -> "Arch":
        return replace(self, compute_dtype=dtype)


def _gpt(h, L, heads):
    return Arch("gpt", hidden=h, num_blocks=L, heads=heads, vocab=51200, seq_len=1024,
                pos_rows=512, ffn_mult=4, compute_dtype="fp16", optimizer="adamw")


def _moe(h, L, E):
    return Arch("moe", hidden=h, num_blocks=L, heads=16, vocab=32000, seq_len=1024,
                pos_rows=1024, ffn_mult=8, experts=E, expert_group=2048,
                compute_dtype="fp16", optimizer="adafactor")


def _wrn(C, W):
    return Arch("wide_resnet", base_channels=C, width=W, image_size=224, num_classes=1024,
                compute_dtype="fp32", optimizer="sgd_nesterov")


BUILTIN_ARCHS: dict[str, Arch] = {
    "gpt-760m": _gpt(1536, 24, 16), "gpt-1.3b": _gpt(2048, 24, 32),
    "gpt-2.6b": _gpt(2560, 32, 32), "gpt-6.7b": _gpt(4096, 32, 32),
    "gpt-15b": _gpt(5120, 48, 40),
    "moe-690m": _moe(768, 8, 16), "moe-1.3b": _moe(768, 16, 16),
    "moe-2.4b": _moe(1024, 16, 16), "moe-10b": _moe(1536, 16, 32),
    "moe-27b": _moe(2048, 16, 48),
    "wide_resnet-500m": _wrn(224, 2), "wide_resnet-1b": _wrn(320, 2),
    "wide_resnet-2b": _wrn(448, 2), "wide_resnet-4b": _wrn(640, 2),
    "wide_resnet-6.8b": _wrn(320, 16),
}


def builtin_arch(name: str) -> Arch:
    """The architecture of a built-in model name (``gpt-1.3b``)."""
    key = name.strip().lower()
    if key not in BUILTIN_ARCHS:
        raise SpecError("model", name, f"no JAX model; known: {', '.join(BUILTIN_ARCHS)}")
    return BUILTIN_ARCHS[key]


def arch_from_model(spec) -> Arch:
    """The JAX architecture of an ``estimator.models.ModelSpec`` (built-in or YAML).

    Built-in names map directly; a YAML transformer's vocabulary, position rows, FFN ratio
    and expert count are recovered from its layers' parameter counts, so the two views of
    a model can never disagree on its size.
    """
    from estimator.models import BUILTIN_MODELS

    optimizer = {"sgd": "sgd_nesterov"}.get(spec.optimizer, spec.optimizer)
    builtin = BUILTIN_MODELS.get(spec.name.lower())
    # A built-in by its name, or a YAML that is the same model; a YAML that only shares
    # the name (its file stem, say) is built from its own fields.
    if spec.name.lower() in BUILTIN_ARCHS and builtin is not None and \
            (builtin.layers, builtin.sequence) == (spec.layers, spec.sequence):
        return replace(BUILTIN_ARCHS[spec.name.lower()], compute_dtype=spec.dtype,
                       optimizer=optimizer)
    if spec.family == "wide_resnet":
        raise SpecError("model", spec.name, "only built-in wide_resnet sizes have a JAX model")
    h, layers = spec.hidden, spec.layers
    vocab = layers[-1].params // (h + 1)
    pos_rows = (layers[0].params - vocab * h - 2 * h) // h
    blocks = layers[1:-1]
    dense = [b for b in blocks if b.kind != "moe"]
    moe = [b for b in blocks if b.kind == "moe"]
    ffn = 8 if moe else (dense[0].params - 4 * h * h - 9 * h) // (2 * h * h + h) if dense else 4
    experts = (moe[0].params - 4 * h * h - 8 * h) // (h + 16 * h * h) if moe else 0
    return Arch("moe" if moe else "gpt", hidden=h, num_blocks=len(blocks), heads=spec.heads,
                vocab=vocab, seq_len=spec.sequence, pos_rows=pos_rows, ffn_mult=ffn,
                experts=experts, expert_group=spec.min_tokens_per_shard or 2048,
                compute_dtype=spec.dtype, optimizer=optimizer)


# --------------------------------------------------------------------------- contexts


class TensorParallel:
    """Tensor-parallel collectives as the layer code calls them; this base class is the
    global setting, where every array is whole and each method is the plain operation."""

    size = 1

    def enter(self, x):
        """Before a column-parallel op: identity forward, all-reduce of the gradient."""
        return x

    def exit(self, x):
        """After a row-parallel op: all-reduce of the partial sums, identity backward."""
        return x

    def embed(self, table, ids):
        """Rows ``ids`` of an embedding table sharded over its rows (the vocabulary)."""
        return jnp.take(table, ids, axis=0)

    def cross_entropy(self, logits, labels):
        """Mean softmax cross-entropy in fp32, classes sharded over the last axis."""
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()

    def local(self, x, axis: int):
        """This device's slice of a replicated axis that the weights shard (experts)."""
        return x

    def to_experts(self, x):
        """Tokens dispatched ``[experts, groups, capacity, hidden]`` → the experts this
        device holds, with every device's groups (expert parallelism: an all-to-all)."""
        return x

    def from_experts(self, x):
        """The inverse of :meth:`to_experts`: the experts' outputs back to their groups."""
        return x

    def slice_channels(self, x):
        """The last axis cut to this device's channels (backward: all-gather)."""
        return x

    def gather_channels(self, x):
        """Channels sharded over the last axis made whole (backward: own slice)."""
        return x

    def batch_mean(self, x, axes: tuple[int, ...]):
        """Mean over ``axes``, the batch included: across the data-parallel group too."""
        return x.mean(axis=axes)


GLOBAL_TP = TensorParallel()


@dataclass(frozen=True)
class ShardCtx:
    """How layer code constrains activations and names its collectives.

    ``act`` pins an activation whose leading axis is the batch to batch sharding over
    ``dp`` (Megatron keeps block boundaries replicated over tp); ``tp`` is the
    tensor-parallel collectives of a hand-partitioned program (default: none);
    ``dp_shards`` the data-parallel devices a global array's batch splits over (each
    routes its own tokens in MoE groups, as the runner's devices do).
    """

    act: Callable[[Any], Any] = field(default=lambda x: x)
    tp: TensorParallel = GLOBAL_TP
    dp_shards: int = 1


NO_SHARD = ShardCtx()


def _cdt(arch: Arch):
    return DTYPES[arch.compute_dtype]


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


# --------------------------------------------------------------------------- layer shapes


def layer_kind(arch: Arch, index: int) -> str:
    """``embed``, ``block``, ``moe_block``, ``stem``, ``bottleneck`` or ``head``."""
    if not 0 <= index < arch.num_layers:
        raise SpecError("layer", index, f"{arch.family} has layers 0..{arch.num_layers - 1}")
    if index == arch.num_layers - 1:
        return "head"
    if index == 0:
        return "stem" if arch.family == "wide_resnet" else "embed"
    if arch.family == "wide_resnet":
        return "bottleneck"
    if arch.family == "moe" and (index - 1) % 2 == 0:
        return "moe_block"
    return "block"


def _wrn_block_geometry(arch: Arch, index: int) -> tuple[int, int, int, int, bool]:
    """(in_channels, f, stride, spatial_in, projection) of bottleneck ``index`` (1-based)."""
    C = arch.base_channels
    i, spatial, in_ch = index - 1, arch.image_size // 4, C
    for stage, nblocks in enumerate(WRN_STAGE_BLOCKS):
        f = C * 2 ** stage
        for b in range(nblocks):
            stride = 2 if (b == 0 and stage > 0) else 1
            if i == 0:
                return in_ch, f, stride, spatial, b == 0
            i -= 1
            in_ch = 4 * f
            spatial //= stride
    raise AssertionError("unreachable")


def layer_param_shapes(arch: Arch, index: int) -> dict:
    """fp32 master-weight shapes of one layer (a pytree of ShapeDtypeStruct)."""
    kind, h = layer_kind(arch, index), arch.hidden
    if kind == "embed":
        return {"tok": _sds((arch.vocab, h)), "pos": _sds((arch.pos_rows, h)),
                "ln_g": _sds((h,)), "ln_b": _sds((h,))}
    if kind in ("block", "moe_block"):
        hd = h // arch.heads
        p = {"wqkv": _sds((h, 3, arch.heads, hd)), "bqkv": _sds((3, arch.heads, hd)),
             "wo": _sds((arch.heads, hd, h)), "bo": _sds((h,)),
             "ln1_g": _sds((h,)), "ln1_b": _sds((h,)), "ln2_g": _sds((h,)), "ln2_b": _sds((h,))}
        f = arch.ffn_mult * h
        if kind == "moe_block":
            E = arch.experts
            p.update(wg=_sds((h, E)), wi=_sds((E, h, f)), wo2=_sds((E, f, h)))
        else:
            p.update(w1=_sds((h, f)), b1=_sds((f,)), w2=_sds((f, h)), b2=_sds((h,)))
        return p
    if kind == "stem":
        C = arch.base_channels
        return {"conv": _sds((7, 7, 3, C)), "bn_g": _sds((C,)), "bn_b": _sds((C,))}
    if kind == "bottleneck":
        cin, f, _, _, proj = _wrn_block_geometry(arch, index)
        fw = f * arch.width
        p = {"c1": _sds((1, 1, cin, f)), "g1": _sds((f,)), "b1": _sds((f,)),
             "c2": _sds((3, 3, f, fw)), "g2": _sds((fw,)), "b2": _sds((fw,)),
             "c3": _sds((1, 1, fw, 4 * f)), "g3": _sds((4 * f,)), "b3": _sds((4 * f,))}
        if proj:
            p.update(cp=_sds((1, 1, cin, 4 * f)), gp=_sds((4 * f,)), bp=_sds((4 * f,)))
        return p
    if arch.family == "wide_resnet":  # head
        c = 32 * arch.base_channels
        return {"w": _sds((c, arch.num_classes)), "b": _sds((arch.num_classes,))}
    return {"w": _sds((h, arch.vocab)), "b": _sds((arch.vocab,))}


def layer_state_shapes(arch: Arch, index: int) -> dict:
    """Non-trained state (batch-norm running statistics) of one layer."""
    kind = layer_kind(arch, index)
    if kind == "stem":
        C = arch.base_channels
        return {"m": _sds((C,)), "v": _sds((C,))}
    if kind == "bottleneck":
        shapes = layer_param_shapes(arch, index)
        return {f"{mv}{k[1:]}": _sds(s.shape) for k, s in shapes.items() if k[0] == "g"
                for mv in "mv"}
    return {}


# The parameters of a MoE layer that hold its experts (leading axis: the expert), the ones
# expert parallelism splits over data parallelism too.
EXPERT_PARAMS = ("wi", "wo2")


def layer_param_specs(arch: Arch, index: int) -> dict:
    """PartitionSpec per parameter for tensor parallelism over mesh axis ``tp``."""
    kind, shapes = layer_kind(arch, index), layer_param_shapes(arch, index)
    table = {
        "tok": P("tp", None), "wqkv": P(None, None, "tp", None), "bqkv": P(None, "tp", None),
        "wo": P("tp", None, None), "w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None),
        "wi": P("tp", None, None), "wo2": P("tp", None, None),
        "c1": P(None, None, None, "tp"), "g1": P("tp"), "c2": P(None, None, "tp", None),
        "c3": P(None, None, None, "tp"), "g3": P("tp"), "b3": P("tp"),
        "cp": P(None, None, None, "tp"), "gp": P("tp"), "bp": P("tp"),
    }
    if kind == "head":
        return {"w": P(None, "tp"), "b": P("tp")}
    if kind == "bottleneck":
        table["b1"] = P("tp")
    return {k: table.get(k, P()) for k in shapes}


def layer_state_specs(arch: Arch, index: int) -> dict:
    """Running statistics shard like the channels they describe."""
    specs = layer_param_specs(arch, index)
    return {k: specs.get("g" + k[1:], P()) for k in layer_state_shapes(arch, index)}


def init_layer_params(arch: Arch, index: int, key) -> dict:
    """Real fp32 weights for one layer (small normal init, unit norms, zero biases)."""
    shapes = layer_param_shapes(arch, index)
    out = {}
    for i, (name, s) in enumerate(sorted(shapes.items())):
        if len(s.shape) == 1:
            one = name.startswith(("ln", "g", "bn_g"))
            out[name] = jnp.ones(s.shape) if one else jnp.zeros(s.shape)
        else:
            fan_in = math.prod(s.shape[:-1]) if name not in ("wo",) else s.shape[0] * s.shape[1]
            std = 1.0 / math.sqrt(max(1, fan_in))
            out[name] = std * jax.random.normal(jax.random.fold_in(key, i), s.shape)
    return out


def init_layer_state(arch: Arch, index: int) -> dict:
    return {k: (jnp.ones if k.startswith("v") else jnp.zeros)(s.shape)
            for k, s in layer_state_shapes(arch, index).items()}


# --------------------------------------------------------------------------- layer math


def _layer_norm(x, g, b, eps=1e-12):
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = ((xf - mu) ** 2).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * g + b).astype(x.dtype)


def _attention(p, x, arch: Arch, tp: TensorParallel):
    dt = x.dtype
    qkv = jnp.einsum("bsm,mthd->bsthd", tp.enter(x), p["wqkv"].astype(dt)) + p["bqkv"].astype(dt)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.asarray(math.sqrt(q.shape[-1]), dt)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dt)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return tp.exit(jnp.einsum("bqhd,hdm->bqm", ctx, p["wo"].astype(dt))) + p["bo"].astype(dt)


def moe_group_size(arch: Arch, tokens: int) -> int:
    """Tokens per GShard group for ``tokens`` tokens on one device."""
    return min(arch.expert_group, tokens)


def _moe_ffn(p, x, arch: Arch, tp: TensorParallel, dp_shards: int = 1):
    """GShard top-2 routing with dense one-hot dispatch and combine einsums.

    Routing is computed whole on every tensor-parallel device; each device then runs
    its slice of the experts and the partial outputs are summed (``tp.exit``). Under
    expert parallelism each data-parallel device routes its own tokens to every expert
    and ``tp.to_experts`` / ``tp.from_experts`` move them to and from the device that
    holds each expert.
    """
    dt, (B, S, M) = x.dtype, x.shape
    group = moe_group_size(arch, B * S // dp_shards)  # no group across two devices' tokens
    if (B * S) % group:
        raise SpecError("tokens", B * S, f"MoE needs a multiple of {group} tokens per micro-batch shard")
    E, C = arch.experts, arch.capacity
    xg = x.reshape(-1, group, M)
    logits = jnp.einsum("gsm,me->gse", xg, p["wg"].astype(dt)).astype(jnp.float32)
    gates = jax.nn.softmax(logits, axis=-1)
    idx1 = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(idx1, E, dtype=jnp.float32)
    idx2 = jnp.argmax(gates * (1.0 - mask1), axis=-1)
    mask2 = jax.nn.one_hot(idx2, E, dtype=jnp.float32)
    pos1 = jnp.cumsum(mask1, axis=1) - mask1
    mask1 = mask1 * (pos1 < C)
    pos2 = jnp.cumsum(mask2, axis=1) - mask2 + mask1.sum(axis=1, keepdims=True)
    mask2 = mask2 * (pos2 < C)
    g1 = (gates * mask1).sum(-1)
    g2 = (gates * mask2).sum(-1)
    denom = jnp.maximum(g1 + g2, 1e-9)
    g1, g2 = g1 / denom, g2 / denom
    loc1 = jax.nn.one_hot((pos1 * mask1).sum(-1).astype(jnp.int32), C, dtype=jnp.float32)
    loc2 = jax.nn.one_hot((pos2 * mask2).sum(-1).astype(jnp.int32), C, dtype=jnp.float32)
    combine = (g1[..., None, None] * mask1[..., None] * loc1[:, :, None, :]
               + g2[..., None, None] * mask2[..., None] * loc2[:, :, None, :]).astype(dt)
    combine = tp.local(tp.enter(combine), axis=2)
    dispatch = (combine > 0).astype(dt)
    expert_in = tp.to_experts(jnp.einsum("gsec,gsm->egcm", dispatch, tp.enter(xg)))
    hidden = jax.nn.relu(jnp.einsum("egcm,emh->egch", expert_in, p["wi"].astype(dt)))
    expert_out = tp.from_experts(jnp.einsum("egch,ehm->egcm", hidden, p["wo2"].astype(dt)))
    return tp.exit(jnp.einsum("gsec,egcm->gsm", combine, expert_out)).reshape(B, S, M)


def _dense_ffn(p, x, tp: TensorParallel):
    dt = x.dtype
    hid = jax.nn.gelu(tp.enter(x) @ p["w1"].astype(dt) + p["b1"].astype(dt), approximate=False)
    return tp.exit(hid @ p["w2"].astype(dt)) + p["b2"].astype(dt)


def _conv(x, w, stride=1):
    pad = "SAME" if w.shape[0] > 1 else "VALID"
    return jax.lax.conv_general_dilated(x, w.astype(x.dtype), (stride, stride), pad,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _batch_norm(x, g, b, m, v, tp: TensorParallel, momentum=0.9, eps=1e-5):
    mean = tp.batch_mean(x, (0, 1, 2))
    var = tp.batch_mean((x - mean) ** 2, (0, 1, 2))
    y = (x - mean) * jax.lax.rsqrt(var + eps) * g + b
    return y, momentum * m + (1 - momentum) * jax.lax.stop_gradient(mean), \
        momentum * v + (1 - momentum) * jax.lax.stop_gradient(var)


def apply_layer(arch: Arch, index: int, params: dict, state: dict, x, ctx: ShardCtx = NO_SHARD):
    """Forward of one layer: returns (output, new_state).

    The head returns per-example logits; ``loss_fn`` turns them into the loss.
    """
    kind, dt, tp = layer_kind(arch, index), _cdt(arch), ctx.tp
    if kind == "embed":
        s = x.shape[1]
        pos = jnp.minimum(jnp.arange(s), arch.pos_rows - 1)
        y = tp.embed(params["tok"], x) + jnp.take(params["pos"], pos, axis=0)[None]
        return ctx.act(_layer_norm(y, params["ln_g"], params["ln_b"]).astype(dt)), state
    if kind in ("block", "moe_block"):
        x = _layer_norm(x + _attention(params, x, arch, tp), params["ln1_g"], params["ln1_b"])
        ffn = _moe_ffn(params, x, arch, tp, ctx.dp_shards) if kind == "moe_block" else _dense_ffn(params, x, tp)
        return ctx.act(_layer_norm(x + ffn, params["ln2_g"], params["ln2_b"])), state
    if kind == "stem":
        y = _conv(x.astype(dt), params["conv"], 2)
        y, m, v = _batch_norm(y, params["bn_g"], params["bn_b"], state["m"], state["v"], tp)
        y = jax.lax.reduce_window(jax.nn.relu(y), -jnp.inf, jax.lax.max, (1, 3, 3, 1),
                                  (1, 2, 2, 1), "SAME")
        return ctx.act(y), {"m": m, "v": v}
    if kind == "bottleneck":
        # c1 and c3 (and the projection) shard their output channels, c2 its input
        # channels: y1 and y3 are channel-sharded, y2 is whole after its all-reduce.
        _, _, stride, _, proj = _wrn_block_geometry(arch, index)
        new = {}

        def bn(y, tag):
            y, new["m" + tag], new["v" + tag] = _batch_norm(
                y, params["g" + tag], params["b" + tag], state["m" + tag], state["v" + tag], tp)
            return y

        y = jax.nn.relu(bn(_conv(tp.enter(x), params["c1"]), "1"))
        y = jax.nn.relu(bn(tp.exit(_conv(y, params["c2"], stride)), "2"))
        y = bn(_conv(tp.enter(y), params["c3"]), "3")
        short = bn(_conv(tp.enter(x), params["cp"], stride), "p") if proj else tp.slice_channels(x)
        return ctx.act(tp.gather_channels(jax.nn.relu(y + short))), new
    if arch.family == "wide_resnet":  # head
        pooled = tp.enter(x.mean(axis=(1, 2)))
        return pooled @ params["w"].astype(pooled.dtype) + params["b"].astype(pooled.dtype), state
    x = tp.enter(x)
    return x @ params["w"].astype(x.dtype) + params["b"].astype(x.dtype), state


def loss_fn(logits, labels, tp: TensorParallel = GLOBAL_TP):
    """Mean softmax cross-entropy in fp32."""
    return tp.cross_entropy(logits, labels)


# --------------------------------------------------------------------------- stages


@dataclass(frozen=True)
class Stage:
    """Layers [layer_start, layer_end) of a model with a micro-batch size."""

    arch: Arch
    layer_start: int
    layer_end: int
    micro_batch: int
    remat: bool = True

    def __post_init__(self):
        if not 0 <= self.layer_start < self.layer_end <= self.arch.num_layers:
            raise SpecError("layers", (self.layer_start, self.layer_end),
                            f"give 0 ≤ start < end ≤ {self.arch.num_layers}")
        if self.micro_batch < 1:
            raise SpecError("micro_batch", self.micro_batch, "give a positive sample count")

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.arch.num_layers

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


def activation_shape(arch: Arch, index: int, micro_batch: int) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of the input of layer ``index`` (layer 0: the model input)."""
    if arch.family != "wide_resnet":
        if index == 0:
            return (micro_batch, arch.seq_len), jnp.int32
        return (micro_batch, arch.seq_len, arch.hidden), _cdt(arch)
    if index == 0:
        return (micro_batch, arch.image_size, arch.image_size, 3), jnp.float32
    if index == arch.num_layers - 1:
        s = arch.image_size // 32
        return (micro_batch, s, s, 32 * arch.base_channels), _cdt(arch)
    cin, _, _, spatial, _ = _wrn_block_geometry(arch, index)
    return (micro_batch, spatial, spatial, cin), _cdt(arch)


def label_shape(arch: Arch, micro_batch: int) -> tuple[int, ...]:
    return (micro_batch, arch.seq_len) if arch.family != "wide_resnet" else (micro_batch,)


def stage_forward(stage: Stage, params: list, state: list, x, ctx: ShardCtx = NO_SHARD, finish=None,
                  remat_layer=None):
    """Run a stage's layers; each layer under jax.checkpoint when remat is on.

    ``finish`` (the last stage's loss) is applied to the last layer's output inside that
    layer's checkpoint, so a backward recomputes it rather than keep its residuals (the
    fp32 log-softmax: s × vocabulary per sample). ``remat_layer(i, fn)``, if given,
    replaces ``jax.checkpoint(fn)`` for the i-th layer (ZeRO-3 gathers its weights there).
    """
    new_state = []
    last = stage.layers[-1]
    for i, layer in enumerate(stage.layers):
        def one(p, s, h, layer=layer):
            y, s = apply_layer(stage.arch, layer, p, s, h, ctx)
            return (finish(y) if finish is not None and layer == last else y), s
        fn = remat_layer(i, one) if remat_layer is not None else jax.checkpoint(one) if stage.remat else one
        x, s = fn(params[i], state[i], x)
        new_state.append(s)
    return x, new_state


def stage_grad(stage: Stage, params, state, x, target, ctx: ShardCtx = NO_SHARD, runs=None):
    """Forward and backward of one micro-batch through a stage.

    ``target`` is the labels on the last stage and the cotangent of the stage's output
    elsewhere. With ``runs`` (``layer_runs``) params and state are per run, stacked.
    Returns (loss or None, param grads, input cotangent or None, new state).
    """
    def fwd(p, h):
        if runs is None:
            finish = (lambda out: loss_fn(out, target, ctx.tp)) if stage.is_last else None
            return stage_forward(stage, p, state, h, ctx, finish)
        out, s = runs_forward(stage, runs, p, state, h, ctx)
        if stage.is_last:
            return loss_fn(out, target, ctx.tp), s
        return out, s

    if stage.is_first:
        out, vjp, new_state = jax.vjp(lambda p: fwd(p, x), params, has_aux=True)
        cot = jnp.ones((), out.dtype) if stage.is_last else target.astype(out.dtype)
        (g_params,) = vjp(cot)
        g_x = None
    else:
        out, vjp, new_state = jax.vjp(fwd, params, x, has_aux=True)
        cot = jnp.ones((), out.dtype) if stage.is_last else target.astype(out.dtype)
        g_params, g_x = vjp(cot)
    loss = out if stage.is_last else None
    return loss, g_params, g_x, new_state


# --------------------------------------------------------------------------- scanned runs
# For compiling, repeated identical layers run under ``lax.scan`` with their weights
# stacked on a leading axis: the program (and its compile time) stays the size of one
# unit however many layers the stage has. XLA's cost analysis counts a loop body once, so
# ``estimator.compiled`` adds the other trip-count − 1 executions.


def layer_signature(arch: Arch, index: int) -> tuple:
    """What makes two layers interchangeable: kind, parameter shapes, in and out shapes."""
    shapes = tuple(sorted((k, v.shape) for k, v in layer_param_shapes(arch, index).items()))
    out = activation_shape(arch, index + 1, 1)[0] if index + 1 < arch.num_layers else None
    return (layer_kind(arch, index), shapes, activation_shape(arch, index, 1)[0], out)


def layer_runs(arch: Arch, layers: range, max_period: int = 2) -> tuple[tuple[int, int, int], ...]:
    """Cover ``layers`` with runs ``(first layer, period, repeats)`` of identical units.

    A unit is ``period`` consecutive layers (2 for MoE's alternating MoE/dense blocks);
    a layer that repeats nothing is a run of one.
    """
    sig = {i: layer_signature(arch, i) for i in layers}
    runs, i, end = [], layers.start, layers.stop
    while i < end:
        best = (1, 1)
        for period in range(1, max_period + 1):
            count = 1
            while i + (count + 1) * period <= end and all(
                    sig[i + count * period + j] == sig[i + j] for j in range(period)):
                count += 1
            if count >= 2 and count * period > best[0] * best[1]:
                best = (period, count)
        if best[1] == 1:
            best = (1, 1)
        runs.append((i, best[0], best[1]))
        i += best[0] * best[1]
    return tuple(runs)


def _stacked(tree, count: int, fn):
    return jax.tree.map(fn, tree, is_leaf=lambda x: isinstance(x, (P, jax.ShapeDtypeStruct))) \
        if count > 1 else tree


def run_param_shapes(arch: Arch, run: tuple[int, int, int]) -> list:
    first, period, count = run
    return [_stacked(layer_param_shapes(arch, first + j), count,
                     lambda s: _sds((count, *s.shape), s.dtype)) for j in range(period)]


def run_state_shapes(arch: Arch, run: tuple[int, int, int]) -> list:
    first, period, count = run
    return [_stacked(layer_state_shapes(arch, first + j), count,
                     lambda s: _sds((count, *s.shape), s.dtype)) for j in range(period)]


def run_param_specs(arch: Arch, run: tuple[int, int, int]) -> list:
    first, period, count = run
    return [_stacked(layer_param_specs(arch, first + j), count, lambda sp: P(None, *sp))
            for j in range(period)]


def run_state_specs(arch: Arch, run: tuple[int, int, int]) -> list:
    first, period, count = run
    return [_stacked(layer_state_specs(arch, first + j), count, lambda sp: P(None, *sp))
            for j in range(period)]


def runs_forward(stage: Stage, runs, params: list, state: list, x, ctx: ShardCtx = NO_SHARD):
    """A stage's forward over runs (params and state per run, stacked when repeated)."""
    new_state = []
    for run, p_run, s_run in zip(runs, params, state):
        first, period, count = run

        def unit(h, ps, first=first, period=period):
            p_unit, s_unit = ps
            out_s = []
            for j in range(period):
                def one(p, s, hh, layer=first + j):
                    return apply_layer(stage.arch, layer, p, s, hh, ctx)
                fn = jax.checkpoint(one) if stage.remat else one
                h, sj = fn(p_unit[j], s_unit[j], h)
                out_s.append(sj)
            return h, out_s

        if count == 1:
            x, s_new = unit(x, (p_run, s_run))
        else:
            x, s_new = jax.lax.scan(unit, x, (p_run, s_run))
        new_state.append(s_new)
    return x, new_state


def stage_param_shapes(stage: Stage) -> list:
    return [layer_param_shapes(stage.arch, i) for i in stage.layers]


def stage_state_shapes(stage: Stage) -> list:
    return [layer_state_shapes(stage.arch, i) for i in stage.layers]


def count_params(arch: Arch, layers: range | None = None) -> int:
    """Trainable parameters of the given layers (all layers by default)."""
    layers = range(arch.num_layers) if layers is None else layers
    return sum(math.prod(s.shape) for i in layers
               for s in jax.tree.leaves(layer_param_shapes(arch, i)))


def stage_train_step(stage: Stage, optimizer, ctx: ShardCtx = NO_SHARD,
                     micro_batches: int = 1, runs=None) -> Callable:
    """One iteration of a stage: forward and backward of ``micro_batches`` micro-batches
    (gradients accumulated in fp32), then one optimizer update.

    The returned function maps ``(params, opt_state, model_state, xs, targets)`` to
    ``(params, opt_state, model_state, loss or None, input cotangents or None)``, where
    ``xs`` and ``targets`` carry a leading micro-batch axis when ``micro_batches > 1``.
    """
    def step(params, opt_state, model_state, xs, targets):
        if micro_batches == 1:
            loss, grads, g_x, model_state = stage_grad(stage, params, model_state, xs, targets,
                                                       ctx, runs)
        else:
            grads, losses, g_xs = None, [], []
            for k in range(micro_batches):
                loss_k, g_k, gx_k, model_state = stage_grad(
                    stage, params, model_state, xs[k], targets[k], ctx, runs)
                grads = g_k if grads is None else jax.tree.map(jnp.add, grads, g_k)
                losses.append(loss_k)
                g_xs.append(gx_k)
            grads = jax.tree.map(lambda g: g / micro_batches, grads)
            loss = None if losses[0] is None else jnp.mean(jnp.stack(losses))
            g_x = None if g_xs[0] is None else jnp.stack(g_xs)
        params, opt_state = optimizer.update(grads, opt_state, params)
        return params, opt_state, model_state, loss, g_x

    return step
