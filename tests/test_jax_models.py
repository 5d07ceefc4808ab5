"""The JAX models: sizes agree with the estimator's specs, shardings fit, steps train.

JAX is imported inside the tests (not at module import) so that other test modules can
still set XLA flags before JAX starts. Training steps run in one spawn child with the
compile-friendly CPU flags of compile workers (small programs compile 2-3x faster).
"""

import math
import multiprocessing
from dataclasses import replace
from pathlib import Path

import pytest

from estimator.models import BUILTIN_MODELS, load_model, model_from_dict

TINY = {
    "gpt": dict(family="gpt", hidden=32, num_blocks=2, heads=4, vocab=64, seq_len=16,
                compute_dtype="fp32"),
    "moe": dict(family="moe", hidden=32, num_blocks=2, heads=4, vocab=64, seq_len=16, experts=4,
                expert_group=32, ffn_mult=2, compute_dtype="fp32", optimizer="adafactor"),
    "wide_resnet": dict(family="wide_resnet", base_channels=4, width=2, image_size=32,
                        num_classes=10, compute_dtype="fp32", optimizer="sgd_nesterov"),
}


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_every_layer_has_the_estimators_parameter_count(name):
    from estimator import jax_models as jm
    spec = load_model(name)
    arch = jm.arch_from_model(spec)
    assert arch.num_layers == spec.num_layers
    for i, layer in enumerate(spec.layers):
        assert jm.count_params(arch, range(i, i + 1)) == layer.params, (name, i, layer.name)


def test_yaml_transformers_map_to_the_same_sizes():
    from estimator import jax_models as jm
    for raw in ({"name": "d", "hidden": 64, "layers": 3, "heads": 4, "sequence": 32, "vocab": 100,
                 "ffn_ratio": 2, "dtype": "bf16"},
                {"name": "m", "hidden": 64, "layers": 4, "heads": 4, "sequence": 32, "vocab": 100,
                 "experts": 8, "optimizer": "adafactor"}):
        spec = model_from_dict(raw)
        arch = jm.arch_from_model(spec)
        assert (arch.vocab, arch.pos_rows, arch.compute_dtype) == (100, 32, spec.dtype)
        assert arch.experts == raw.get("experts", 0)
        assert jm.count_params(arch) == spec.params


def test_a_yaml_model_named_like_a_built_in_is_its_own_model():
    """A file gpt-760m.yaml (its stem the name) with a longer context and a smaller
    vocabulary trained as the built-in gpt-760m, while the daemon planned for the YAML."""
    from estimator import jax_models as jm
    from estimator.models import load_model
    raw = {"name": "gpt-760m", "hidden": 1536, "layers": 24, "heads": 16, "sequence": 2048, "vocab": 32000}
    arch = jm.arch_from_model(model_from_dict(raw))
    assert (arch.seq_len, arch.vocab) == (2048, 32000)
    assert jm.count_params(arch) == model_from_dict(raw).params
    assert jm.arch_from_model(load_model("gpt-760m")) == replace(jm.builtin_arch("gpt-760m"), optimizer="adamw",
                                                                 compute_dtype="fp16")


@pytest.mark.parametrize("name", ["gpt-760m", "gpt-15b", "moe-690m", "moe-27b", "wide_resnet-500m",
                                  "wide_resnet-6.8b"])
@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_parallel_specs_fit_every_parameter(name, tp):
    from estimator import jax_models as jm
    arch = jm.builtin_arch(name)
    sharded = 0
    for i in range(arch.num_layers):
        shapes, specs = jm.layer_param_shapes(arch, i), jm.layer_param_specs(arch, i)
        assert set(shapes) == set(specs)
        for key, shape in shapes.items():
            spec = tuple(specs[key])
            assert len(spec) <= len(shape.shape), (i, key)
            for dim, axis in zip(shape.shape, spec):
                if axis == "tp":
                    sharded += 1
                    assert dim % tp == 0, (i, key, shape.shape, spec)
    assert sharded >= arch.num_layers  # every layer has tensor-parallel weights


def test_layer_runs_group_identical_layers():
    from estimator import jax_models as jm
    assert jm.layer_runs(jm.builtin_arch("gpt-1.3b"), range(26)) == ((0, 1, 1), (1, 1, 24), (25, 1, 1))
    assert jm.layer_runs(jm.builtin_arch("moe-1.3b"), range(18)) == ((0, 1, 1), (1, 2, 8), (17, 1, 1))
    assert jm.layer_runs(jm.builtin_arch("gpt-1.3b"), range(3, 9)) == ((3, 1, 6),)
    wrn = jm.layer_runs(jm.builtin_arch("wide_resnet-1b"), range(18))
    # Each ResNet stage's first block (projection, stride) differs from the rest.
    assert wrn == ((0, 1, 1), (1, 1, 1), (2, 1, 2), (4, 1, 1), (5, 1, 3), (8, 1, 1), (9, 1, 5),
                   (14, 1, 1), (15, 1, 2), (17, 1, 1))


def _init(arch, layers, seed=0):
    import jax
    from estimator import jax_models as jm
    key = jax.random.PRNGKey(seed)
    return ([jm.init_layer_params(arch, i, jax.random.fold_in(key, i)) for i in layers],
            [jm.init_layer_state(arch, i) for i in layers])


def _batch(arch, n):
    import jax.numpy as jnp
    from estimator import jax_models as jm
    shape, dtype = jm.activation_shape(arch, 0, n)
    if dtype == jnp.int32:
        x = (jnp.arange(math.prod(shape)).reshape(shape) * 7) % arch.vocab
    else:
        x = jnp.sin(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)
    y = (jnp.arange(math.prod(jm.label_shape(arch, n))) % 5).reshape(jm.label_shape(arch, n))
    return x, y


@pytest.fixture(scope="module")
def child():
    from estimator.compiled import _worker_init, child_xla_flags
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, initializer=_worker_init, initargs=(child_xla_flags(1),)) as pool:
        yield pool


def test_scan_and_remat_do_not_change_loss_or_gradients(child):
    assert child.apply(_scan_and_remat_check) is True


def _scan_and_remat_check() -> bool:
    import jax
    import jax.numpy as jnp
    from estimator import jax_models as jm
    arch = jm.Arch(**TINY["gpt"])
    layers = range(arch.num_layers)
    params, state = _init(arch, layers)
    x, y = _batch(arch, 4)
    plain = jm.Stage(arch, 0, arch.num_layers, 4, remat=False)
    loss0, g0, _, _ = jax.jit(lambda p: jm.stage_grad(plain, p, state, x, y))(params)
    # The same layers as scanned runs (blocks stacked) under rematerialization.
    runs = jm.layer_runs(arch, layers)
    assert runs == ((0, 1, 1), (1, 1, 2), (3, 1, 1))
    stacked = [[params[0]], [jax.tree.map(lambda *a: jnp.stack(a), params[1], params[2])], [params[3]]]
    r_state = [[{}], [{}], [{}]]
    remat = jm.Stage(arch, 0, arch.num_layers, 4, remat=True)
    loss1, g1, _, _ = jax.jit(lambda p: jm.stage_grad(remat, p, r_state, x, y, runs=runs))(stacked)
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-6)
    for k in g0[1]:
        assert jnp.allclose(g1[1][0][k][0], g0[1][k], atol=1e-6)
        assert jnp.allclose(g1[1][0][k][1], g0[2][k], atol=1e-6)
    assert jnp.allclose(g1[0][0]["tok"], g0[0]["tok"], atol=1e-6)
    return True


@pytest.mark.parametrize("family, first", [("gpt", 0), ("moe", 0), ("wide_resnet", 15)])
def test_each_family_trains_with_its_optimizer(child, family, first):
    out = child.apply(_train, (family, first))
    losses = out["losses"]
    assert out["optimizer"] == TINY[family].get("optimizer", "adamw")
    assert out["g_x_is_none"] == (first == 0)  # only a first stage has no input gradient
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert out["params_finite"]
    if family == "wide_resnet":
        assert out["bn_stats_moved"]  # batch-norm running statistics were updated


def _train(family: str, first: int) -> dict:
    import jax
    import jax.numpy as jnp
    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    arch = jm.Arch(**TINY[family])
    # wide_resnet: the last stage only (its last blocks and the head) keeps compiles short.
    stage = jm.Stage(arch, first, arch.num_layers, 4, remat=False)
    params, state = _init(arch, stage.layers)
    opt = optimizer_for(arch.optimizer)
    opt_state = opt.init(params)
    step = jax.jit(jm.stage_train_step(stage, opt))
    if first == 0:
        x, y = _batch(arch, 4)
    else:
        shape, dtype = jm.activation_shape(arch, first, 4)
        x = jnp.cos(jnp.arange(math.prod(shape), dtype=dtype)).reshape(shape)
        y = jnp.arange(4) % arch.num_classes
    losses = []
    for _ in range(3):
        params, opt_state, state, loss, g_x = step(params, opt_state, state, x, y)
        losses.append(float(loss))
    return {"losses": losses, "optimizer": opt.name, "g_x_is_none": g_x is None,
            "params_finite": all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(params)),
            "bn_stats_moved": bool(state[0].get("m1", jnp.zeros(1)).any())}


def test_optimizer_updates_follow_their_formulas():
    import jax.numpy as jnp
    from estimator.jax_optim import adafactor, adamw, sgd_nesterov
    p = {"w": jnp.array([[1.0, -2.0], [0.5, 0.0]]), "b": jnp.array([0.1, 0.2])}
    g = {"w": jnp.array([[0.3, -0.1], [0.0, 2.0]]), "b": jnp.array([1.0, -1.0])}
    adam = adamw(lr=0.01, weight_decay=0.1)
    new, st = adam.update(g, adam.init(p), p)
    # Step 1: bias-corrected m/sqrt(v) = sign(g) (0 where g = 0), plus decoupled decay.
    want = p["w"] - 0.01 * (jnp.sign(g["w"]) + 0.1 * p["w"])
    assert jnp.allclose(new["w"], want, atol=1e-6)
    assert int(st["count"]) == 1
    sgd = sgd_nesterov(lr=0.1, momentum=0.9)
    s = sgd.init(p)
    p1, s = sgd.update(g, s, p)
    p2, s = sgd.update(g, s, p1)
    # Nesterov: buffer b = 0.9 b + g; step g + 0.9 b. Second step: b = 1.9 g, step 2.71 g.
    assert jnp.allclose(p2["b"], p["b"] - 0.1 * 1.9 * g["b"] - 0.1 * 2.71 * g["b"], atol=1e-6)
    ada = adafactor(lr=0.01, min_dim_to_factor=2)
    st = ada.init(p)
    assert set(st["v"]["w"]) == {"r", "c"} and set(st["v"]["b"]) == {"v"}
    zero_row = {"w": jnp.array([[0.0, 0.0], [1.0, -1.0]]), "b": jnp.zeros(2)}
    new, _ = ada.update(zero_row, st, p)
    assert bool(jnp.isfinite(new["w"]).all()) and bool(jnp.isfinite(new["b"]).all())
    assert jnp.allclose(new["w"][0], p["w"][0])  # no gradient, no move
    assert float(new["w"][1, 0]) < float(p["w"][1, 0]) < float(new["w"][1, 1]) + 1.0


def test_the_estimator_refuses_exactly_the_tp_degrees_the_runner_cannot_shard():
    """``models.tp_problem`` (from ``LayerSpec.tp_split``) agrees with the runner's own
    shapes, layer by layer: a plan the estimator calls feasible is one the runner can run
    (charlm's 4 heads at tp 8 were estimated, then refused by the runner)."""
    from estimator import jax_models as jm
    from estimator.models import tp_problem
    examples = Path(__file__).resolve().parent.parent / "examples"
    specs = list(BUILTIN_MODELS.values()) + [load_model(str(p)) for p in examples.glob("*/model.yaml")]
    assert any(tp_problem(s.layers, 8) for s in specs) and any(not tp_problem(s.layers, 8) for s in specs)
    for spec in specs:
        arch = jm.arch_from_model(spec)
        for i, layer in enumerate(spec.layers):
            shapes, specs_of = jm.layer_param_shapes(arch, i), jm.layer_param_specs(arch, i)
            for tp in (2, 3, 4, 8, 16, 32, 64):
                runner_ok = all(shapes[name].shape[dim] % tp == 0 for name, spec_p in specs_of.items()
                                for dim, axis in enumerate(spec_p) if axis == "tp")
                assert runner_ok == (not tp_problem((layer,), tp)), (spec.name, i, tp)
