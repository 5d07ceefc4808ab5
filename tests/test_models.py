import pytest

from estimator.errors import SpecError
from estimator.models import BUILTIN_MODELS, load_model, model_from_dict

# "true params" of MODELS.md, counted from the Flax definitions behind the measured tables.
TRUE_PARAMS_B = {
    "gpt-760m": 0.838, "gpt-1.3b": 1.419, "gpt-2.6b": 2.781, "gpt-6.7b": 6.866, "gpt-15b": 15.63,
    "moe-690m": 0.711, "moe-1.3b": 1.371, "moe-2.4b": 2.416, "moe-10b": 10.22, "moe-27b": 26.71,
    "wide_resnet-500m": 0.495, "wide_resnet-1b": 1.006, "wide_resnet-2b": 1.965,
    "wide_resnet-4b": 4.001, "wide_resnet-6.8b": 6.728,
}


@pytest.mark.parametrize("name", sorted(TRUE_PARAMS_B))
def test_parameter_counts_match_models_md(name):
    assert load_model(name).params / 1e9 == pytest.approx(TRUE_PARAMS_B[name], rel=0.005)


def test_every_builtin_is_listed():
    assert set(BUILTIN_MODELS) == set(TRUE_PARAMS_B)


def test_gpt_flops_match_alpa_formula():
    # Alpa: 96·B·s·h²·L·(1 + s/6h) + 6·B·s·h·V counts forward, backward and recompute of
    # the blocks (4 forward-equivalents) and 3 passes of the head.
    m = load_model("gpt-1.3b")
    s, h, L, V = 1024, 2048, 24, 51200
    blocks = sum(layer.flops_fwd for layer in m.layers if layer.kind == "transformer")
    head = sum(layer.flops_fwd for layer in m.layers if layer.kind == "head")
    alpa = 96 * s * h * h * L * (1 + s / (6 * h)) + 6 * s * h * V
    assert 4 * blocks + 3 * head == pytest.approx(alpa, rel=0.01)


def test_moe_layers_alternate_starting_with_moe():
    kinds = [layer.kind for layer in load_model("moe-1.3b").layers[1:-1]]
    assert kinds == ["moe", "transformer"] * 8


def test_yaml_transformer(tmp_path):
    f = tmp_path / "tiny.yaml"
    f.write_text("hidden: 64\nlayers: 2\nheads: 4\nsequence: 32\nvocab: 128\n")
    m = load_model(str(f))
    assert m.name == "tiny" and m.num_layers == 4 and m.family == "transformer"
    # 12h² + 13h per layer, V·h + s·h + 2h embedding, V·h + V head.
    assert m.params == 2 * (12 * 64 * 64 + 13 * 64) + (128 * 64 + 32 * 64 + 2 * 64) + (128 * 64 + 128)


@pytest.mark.parametrize("raw, field", [
    ({"hidden": 64, "layers": 2, "heads": 4, "sequence": 32}, "vocab"),
    ({"hidden": 64, "layers": 0, "heads": 4, "sequence": 32, "vocab": 8}, "layers"),
    ({"hidden": 64, "layers": 2, "heads": 5, "sequence": 32, "vocab": 8}, "heads"),
    ({"hidden": 64, "layers": 2, "heads": 4, "sequence": 32, "vocab": 8, "dtype": "int8"}, "dtype"),
    ({"hidden": 64, "layers": 2, "heads": 4, "sequence": 32, "vocab": 8, "colour": 1}, "colour"),
    ({"hidden": "big", "layers": 2, "heads": 4, "sequence": 32, "vocab": 8}, "hidden"),
    # A MoE model's dense layers have the runner's ratio 8: another was silently ignored.
    ({"hidden": 64, "layers": 4, "heads": 4, "sequence": 32, "vocab": 8, "experts": 4, "ffn_ratio": 4}, "ffn_ratio"),
])
def test_yaml_errors_name_the_field(raw, field):
    with pytest.raises(SpecError) as e:
        model_from_dict(raw)
    assert e.value.field == field


def test_malformed_yaml_and_unknown_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden: [1,\n")
    with pytest.raises(SpecError, match="malformed YAML"):
        load_model(str(bad))
    with pytest.raises(SpecError, match="not a built-in"):
        load_model("gpt-9000")


def test_layer_classes_group_layers_that_differ_only_by_name():
    from estimator.models import BUILTIN_MODELS
    gpt = BUILTIN_MODELS["gpt-760m"]  # embedding, 24 equal blocks, head
    assert gpt.layer_classes == (0,) + (1,) * 24 + (25,)
    moe = BUILTIN_MODELS["moe-690m"]  # MoE blocks on even indices, dense on odd
    assert moe.layer_classes[1:9] == (1, 2, 1, 2, 1, 2, 1, 2)
    for i, k in enumerate(moe.layer_classes):
        assert moe.layers[k].flops_fwd == moe.layers[i].flops_fwd and moe.layers[k].kind == moe.layers[i].kind
    wrn = BUILTIN_MODELS["wide_resnet-500m"]  # a stage's first block (projection, stride) differs
    assert len(set(wrn.layer_classes)) < wrn.num_layers and wrn.layer_classes[1] != wrn.layer_classes[2]


def test_divisors_are_every_divisor_in_order():
    from estimator.batching import divisors, more_micro_batches
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 500))
    assert more_micro_batches(16_777_213, 1) == 16_777_213  # a large prime: found by its root
    assert more_micro_batches(96, 4) == 8 and more_micro_batches(97, 4) == 97
