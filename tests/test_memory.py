import pytest

from estimator.memory import MemoryOptions, stage_memory
from estimator.models import load_model


def test_gpt_1_3b_memory_by_hand():
    """gpt-1.3b, one stage, dp 2, tp 1, 8 samples per micro-batch, remat, ZeRO-0."""
    m = load_model("gpt-1.3b")
    s, h, a, V = 1024, 2048, 32, 51200
    params = 1_419_417_600  # 24·(12h²+13h) + V·h + 512·h + 2h + V·h + V
    assert m.params == params
    mem = stage_memory(m, m.layers, dp=2, tp=1, micro_batch=8, in_flight=1, remat=True,
                       options=MemoryOptions(zero_level=0, reserve_gb=0.0))
    assert mem.weights_gb == pytest.approx(2 * params / 1e9)
    assert mem.gradients_gb == pytest.approx(2 * params / 1e9)
    assert mem.optimizer_gb == pytest.approx(12 * params / 1e9)  # fp32 master + AdamW μ, ν
    # Remat keeps each layer's output (embedding + 24 blocks: s·h fp16; head: 4s bytes) and
    # the largest layer's full activations: the head's fp16 logits + fp32 log-softmax.
    kept = 25 * s * h * 2 + 4 * s
    head_live = s * V * (2 + 4) + s * h * 2
    block_live = 34 * s * h + 5 * a * s * s
    assert head_live > block_live
    assert mem.activations_gb == pytest.approx(8 * (kept + head_live) / 1e9)


def test_zero_levels_shard_states_across_dp():
    m = load_model("gpt-1.3b")
    base = dict(dp=4, tp=1, micro_batch=1, in_flight=1, remat=True)
    z = [stage_memory(m, m.layers, **base, options=MemoryOptions(zero_level=k)) for k in range(4)]
    assert z[1].optimizer_gb == pytest.approx(z[0].optimizer_gb / 4)
    assert z[2].gradients_gb == pytest.approx(z[1].gradients_gb / 4)
    assert z[3].weights_gb == pytest.approx(z[2].weights_gb / 4)


def test_tensor_parallel_splits_weights_and_most_activations():
    m = load_model("gpt-1.3b")
    blocks = m.layers[1:-1]
    one = stage_memory(m, blocks, 1, 1, 4, 1, remat=False)
    four = stage_memory(m, blocks, 1, 4, 4, 1, remat=False)
    assert four.weights_gb == pytest.approx(one.weights_gb / 4)
    assert one.activations_gb / 4 < four.activations_gb < one.activations_gb / 2


def test_remat_keeps_far_less_than_full_activations():
    m = load_model("gpt-1.3b")
    full = stage_memory(m, m.layers, 1, 1, 8, 1, remat=False)
    remat = stage_memory(m, m.layers, 1, 1, 8, 1, remat=True)
    assert remat.activations_gb < full.activations_gb / 5
