"""Checkpoint files (atomic, checksummed, pruned, fallback) and resharding across plans.

The resharding check runs in a ``spawn`` child: XLA's fake CPU device count must be set
before JAX is imported, and pytest may already have imported JAX in this process.
"""

import json
import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

from job_scripts.checkpoint import (CheckpointError, list_checkpoints, load_latest,
                                    save_checkpoint)

TINY_GPT = Path(__file__).parent / "fixtures" / "runner" / "tiny-gpt.yaml"


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"params/layer_000/w": rng.standard_normal((4, 3)).astype(np.float32),
            "opt/layer_000/count": np.asarray(seed, np.int32)}


def test_round_trip_keeps_arrays_step_and_meta(tmp_path):
    save_checkpoint(tmp_path, 7, _arrays(1), {"plan": "p", "data": {"next_step": 8}})
    ck = load_latest(tmp_path)
    assert ck.step == 7 and ck.meta == {"plan": "p", "data": {"next_step": 8}}
    for name, a in _arrays(1).items():
        np.testing.assert_array_equal(ck.arrays[name], a)
        assert ck.arrays[name].dtype == a.dtype


def test_keeps_the_newest_two(tmp_path):
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, _arrays(step), {}, keep=2)
    assert list_checkpoints(tmp_path) == [8, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000006.json", "ckpt-00000006.npz", "ckpt-00000008.json", "ckpt-00000008.npz"]


def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog):
    save_checkpoint(tmp_path, 4, _arrays(4), {})
    newest = save_checkpoint(tmp_path, 6, _arrays(6), {})
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the arrays
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        ck = load_latest(tmp_path)
    assert ck.step == 4
    np.testing.assert_array_equal(ck.arrays["params/layer_000/w"], _arrays(4)["params/layer_000/w"])
    assert "checksum" in caplog.text and "step 6" in caplog.text


def test_partial_checkpoints_are_ignored(tmp_path):
    save_checkpoint(tmp_path, 4, _arrays(4), {})
    # A kill while writing step 6: the arrays were renamed but no manifest exists yet,
    # and a temporary file of step 8 was left behind.
    (tmp_path / "ckpt-00000006.npz").write_bytes(b"PK\x03\x04 truncated")
    (tmp_path / "ckpt-00000008.npz.tmp").write_bytes(b"half")
    assert load_latest(tmp_path).step == 4
    # A truncated .npz under a complete manifest fails its checksum.
    save_checkpoint(tmp_path, 10, _arrays(10), {})
    path = tmp_path / "ckpt-00000010.npz"
    path.write_bytes(path.read_bytes()[:100])
    assert load_latest(tmp_path).step == 4


def test_unreadable_manifest_and_nothing_valid(tmp_path):
    assert load_latest(tmp_path / "missing") is None
    save_checkpoint(tmp_path, 3, _arrays(3), {})
    (tmp_path / "ckpt-00000003.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        load_latest(tmp_path)


def test_manifest_records_checksum_and_size(tmp_path):
    path = save_checkpoint(tmp_path, 5, _arrays(5), {"cell": "a100x4:s1"})
    manifest = json.loads((tmp_path / "ckpt-00000005.json").read_text())
    assert manifest["bytes"] == path.stat().st_size
    assert len(manifest["sha256"]) == 64 and manifest["meta"]["cell"] == "a100x4:s1"


# --------------------------------------------------------------------------- resharding


def _reshard_child(directory: str, queue) -> None:
    """dp4 → checkpoint → dp2tp2 → checkpoint → pp2 (2 stages), on 4 fake CPU devices."""
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                               "--xla_backend_optimization_level=0")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from estimator import jax_models as jm
    from estimator.cells import StagePlan
    from estimator.models import load_model
    from job_scripts.train import ParallelPlan, Trainer

    arch = jm.arch_from_model(load_model(str(TINY_GPT)))
    n = arch.num_layers
    plans = {
        "dp4": ParallelPlan((StagePlan(0, n, 4, 1),), 1),
        "dp2tp2": ParallelPlan((StagePlan(0, n, 2, 2),), 2),
        "pp2": ParallelPlan((StagePlan(0, 2, 2, 1), StagePlan(2, n, 1, 2)), 4),
    }
    opt = jm.optimizer_for(arch)
    first = Trainer(arch, plans["dp4"], jax.devices(), 16, opt)
    # Fresh weights do not depend on the plan either (tp-sharded initialisation included).
    first.init(0)
    sharded = Trainer(arch, plans["dp2tp2"], jax.devices(), 16, opt)
    sharded.init(0)
    a, b = first.state_arrays(), sharded.state_arrays()
    same_init = sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    # Random values everywhere (optimizer moments and counters included), so a leaf
    # that is dropped, swapped or left at its initial value cannot go unnoticed.
    rng = np.random.default_rng(0)
    specs = {k: (v.shape, np.dtype(v.dtype)) for k, v in first.array_specs().items()}
    original = {k: (rng.standard_normal(shape) * 3).astype(dt) if dt.kind == "f"
                else rng.integers(0, 1000, shape).astype(dt) for k, (shape, dt) in specs.items()}
    first.load_arrays(original)
    save_checkpoint(directory, 1, first.state_arrays(), {"plan": "dp4"})
    shard_shapes = {}
    for step, name in enumerate(("dp2tp2", "pp2"), start=2):
        trainer = Trainer(arch, plans[name], jax.devices(), 16, opt)
        trainer.load_arrays(load_latest(directory).arrays)
        w1 = trainer.stages[-1].values["params"][-2]["w1"]  # the last block's FFN input matrix
        shard_shapes[name] = (tuple(w1.shape), tuple(w1.addressable_shards[0].data.shape))
        save_checkpoint(directory, step, trainer.state_arrays(), {"plan": name})
    final = load_latest(directory)
    same = sorted(final.arrays) == sorted(original) and all(
        np.array_equal(final.arrays[k], original[k]) and final.arrays[k].dtype == original[k].dtype
        for k in original)
    queue.put({"step": final.step, "same": same, "names": len(original), "shards": shard_shapes,
               "same_init": same_init})


def test_checkpoint_reshards_dp4_to_dp2tp2_to_pp2_exactly(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_reshard_child, args=(str(tmp_path), queue))
    child.start()
    result = queue.get(timeout=240)
    child.join(30)
    assert child.exitcode == 0
    assert result["step"] == 3
    assert result["same"], "parameters or optimizer state changed across dp4 → dp2tp2 → pp2"
    assert result["same_init"], "initial weights differ between dp4 and dp2tp2"
    assert result["names"] > 20
    # Under tp=2 the FFN input matrix (64 × 256) really is split by columns.
    assert result["shards"]["dp2tp2"] == ((64, 256), (64, 128))
    assert result["shards"]["pp2"] == ((64, 256), (64, 128))
