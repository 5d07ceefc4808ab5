"""Checkpoints (Orbax): atomic steps, fallback, resharding restore across plans and processes.

JAX runs in child processes: XLA's fake CPU device count must be set before JAX starts
its backends, and pytest may already have started JAX in this process.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import in_jax_child

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "checkpoint_worker.py"
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> None:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("worker did not exit:\n" + proc.communicate()[0][-3000:])
    assert proc.returncode == 0, out[-3000:]


def test_saved_by_two_processes_as_dp2_pp2_restored_by_one_as_tp4_identically(tmp_path):
    """Each process writes the shards of its own stage; one process reads them all into a
    plan of one stage split four ways by tensor parallelism."""
    pp2 = "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=2 remat=1"
    tp4 = "cell=a100x4:s1 plan=[dp1tp4] mb=1 remat=0"
    port = _free_port()
    reference = _worker("reference", tmp_path, pp2, 3)
    savers = [_worker("save", tmp_path, pp2, 3, rank, 2, port) for rank in range(2)]
    for proc in (*savers, reference):
        _finish(proc)
    # Both processes wrote shards: OCDBT keeps one file set per process.
    arrays_dir = tmp_path / "ckpt" / "3" / "arrays"
    assert sorted(p.name for p in arrays_dir.iterdir() if p.name.startswith("ocdbt.process_")) == \
        ["ocdbt.process_0", "ocdbt.process_1"]
    _finish(_worker("restore", tmp_path, tp4, 0))

    restored, saved = np.load(tmp_path / "restored.npz"), np.load(tmp_path / "saved.npz")
    expected = np.load(tmp_path / "reference.npz")
    assert sorted(restored.files) == sorted(saved.files) == sorted(expected.files)
    assert any(k.startswith("opt/") for k in restored.files)
    for name in restored.files:
        # Restored into tp4 exactly as saved by the two processes ...
        assert np.array_equal(restored[name], saved[name]), name
        # ... which is what one process training the same plan holds.
        np.testing.assert_allclose(saved[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def _refusal(call) -> str | None:
    """The message of the CheckpointError ``call()`` raises, or None when it raises none."""
    from job_scripts.checkpoint import CheckpointError
    try:
        call()
    except CheckpointError as e:
        return str(e)
    return None


def _train_two_steps_and_save(pipe, stream, directory: str):
    """Train two steps, checkpoint them; (state, its arrays by name, the saved checkpoint,
    a reader of its save views)."""
    from job_scripts import reshard
    from job_scripts.checkpoint import Checkpoints

    state = pipe.init(0)
    for step in (1, 2):
        state, _ = pipe.step(state, stream.batch(step).inputs, stream.batch(step).targets)
    before = pipe.host_arrays(state)
    ckpt = Checkpoints(Path(directory) / "ckpt")
    ckpt.save(2, reshard.saver(pipe)(state), {"layout": reshard.layout_json(pipe)})
    ckpt.wait()
    saved = ckpt.latest()
    reader = ckpt.reader(saved.step)

    def read(kind, dtype, s, j, lo, hi):
        return reader.read((kind, dtype), (s, j, slice(lo, hi)))
    return state, before, saved, read


def _save_and_reshard(directory: str) -> dict:
    """In a spawn child with 8 CPU devices: train under one plan, restore into others."""
    import jax

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts import reshard
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    spec = load_model(str(ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml"))
    arch = jm.arch_from_model(spec)
    stream = stream_for(arch, 0, 16)

    def make(text, arch=arch):
        n = parse_plan(text).num_gpus
        plan = plan_from_string(text, spec, arch, 16, n)[0]
        return Pipeline(arch, plan, jax.devices()[:n], 16, optimizer_for(arch.optimizer))

    first = make("cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=4 remat=1")
    state, before, saved, read = _train_two_steps_and_save(first, stream, directory)

    out = {"exact": {}, "third": {}}
    for text in ("cell=a100x4:s1 plan=[dp1tp4] mb=2 remat=0",
                 "cell=a100x4:s4 plan=[dp1tp1|dp1tp1|dp1tp1|dp1tp1] mb=4 remat=1",
                 "cell=a100x2:s2 plan=[dp1tp1|dp1tp1] mb=8 remat=1"):
        pipe = make(text)
        restored = reshard.restore(pipe, saved.meta["layout"], read)
        after = pipe.host_arrays(restored)
        out["exact"][text] = all(np.array_equal(after[k], before[k]) for k in before)
        out["third"][text] = float(pipe.step(restored, stream.batch(3).inputs, stream.batch(3).targets)[1])
    # Written once: a dp-replicated buffer saves 1/dp of itself per device.
    view = reshard.saver(first)(state)["params"]["float32"]
    out["view_vs_buffer"] = view.shape[-1] / state["params"]["float32"].shape[-1]
    # (the step donates the state's buffers: nothing reads them after it)
    out["uninterrupted"] = float(first.step(state, stream.batch(3).inputs, stream.batch(3).targets)[1])
    bigger = make("cell=a100x4:s1 plan=[dp4tp1] mb=1 remat=1",
                  jm.Arch(**{**arch.__dict__, "hidden": 128, "heads": 4}))
    out["other_model"] = _refusal(lambda: reshard.restore(bigger, saved.meta["layout"], read))
    return out


def test_any_plan_reads_any_plans_checkpoint_and_trains_on(tmp_path):
    out = in_jax_child(8, _save_and_reshard, str(tmp_path))
    assert all(out["exact"].values()), out["exact"]
    for loss in out["third"].values():
        assert loss == pytest.approx(out["uninterrupted"], rel=1e-5)
    assert out["view_vs_buffer"] <= 0.55  # stage 0 holds dp2 copies, stage 1 dp4
    assert out["other_model"] is not None and "another model" in out["other_model"]
    assert "\n" not in out["other_model"]


def _orbax_basics(directory: str) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from job_scripts.checkpoint import Checkpoints

    root = Path(directory)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    w = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(mesh, P("dp", "tp")))
    ckpt = Checkpoints(root / "ckpt", keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": w * step}, {"note": step})
    ckpt.wait()
    out = {"steps": ckpt.steps(), "latest": ckpt.latest().step, "meta": ckpt.latest().meta}
    # Restored into another sharding (the researcher's path: logical arrays).
    target = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, ("dp", "tp"))))}
    restored = ckpt.restore(3, target)["w"]
    out["restored_ok"] = bool(np.array_equal(np.asarray(restored), np.arange(32).reshape(4, 8) * 3))
    out["restored_spec"] = str(restored.sharding.spec)
    ckpt.close()
    # A damaged newest step falls back to the one before; nothing readable is an error.
    (root / "ckpt" / "3" / "meta" / "metadata").write_text("{not json")
    resumed = Checkpoints(root / "ckpt")
    out["fallback"] = resumed.latest().step
    # The run reaches step 3 again and saves it: the damaged one was set aside, not in the way.
    resumed.save(3, {"w": jax.device_put(np.arange(32.0, dtype=np.float32).reshape(4, 8))}, {"note": 33})
    resumed.wait()
    out["saved_again"] = resumed.latest().meta["note"]
    out["aside"] = sorted(p.name for p in (root / "ckpt").iterdir() if "unreadable" in p.name)
    resumed.close()
    (root / "ckpt" / "3" / "meta" / "metadata").write_text("{not json")
    (root / "ckpt" / "2" / "meta" / "metadata").write_text("[]")
    out["none"] = _refusal(lambda: Checkpoints(root / "ckpt").latest())
    return out


def test_checkpoints_keep_the_newest_reshard_logical_arrays_and_fall_back(tmp_path):
    out = in_jax_child(4, _orbax_basics, str(tmp_path))
    assert out["steps"] == [3, 2] and out["latest"] == 3
    assert out["meta"]["note"] == 3 and out["meta"]["step"] == 3 and out["meta"]["format"] == 2
    assert out["restored_ok"] and "tp" in out["restored_spec"]
    assert out["fallback"] == 2 and out["saved_again"] == 33 and out["aside"] == ["3.unreadable"]
    assert out["none"] is not None and "no readable checkpoint" in out["none"]
    assert json.loads(json.dumps(out))  # plain data crossed the process boundary


def _resume_with_identity(directory: str) -> dict:
    """A job whose identity holds a tuple saves, restarts and looks for its checkpoint."""
    import jax.numpy as jnp

    from estimator.errors import SpecError
    from job_scripts import runtime

    def start(identity):
        # The recorder left uninstalled: the pool ends its worker with SIGTERM.
        return runtime.start(stop=runtime.StopSignal(), env={}, global_batch=8, iterations=4, devices=1,
                             platform="cpu", checkpoint_dir=directory, compile_cache="", identity=identity)

    job = start({"model_version": (3, 1)})
    job.save(1, {"w": jnp.ones(3)}, {"model_version": "the caller's own meta does not write over the identity"})
    job.close()
    out = {"same_job": start({"model_version": (3, 1)}).latest().step}
    for name, identity in (("other_version", {"model_version": (3, 2)}), ("not_json", {"model_version": {3, 1}}),
                           ("reserved", {"data": "wikitext-103-v2"}), ("checked", {"global_batch": 16})):
        try:
            start(identity).latest()
            out[name] = None
        except SpecError as e:
            out[name] = str(e)
    return out


def test_a_restarted_job_finds_its_checkpoint_when_its_identity_holds_a_tuple(tmp_path):
    out = in_jax_child(1, _resume_with_identity, str(tmp_path / "ckpt"))
    assert out["same_job"] == 1  # saved as JSON, where (3, 1) reads back as [3, 1]
    assert out["other_version"].startswith("model_version=[3, 2]: the checkpoint ")
    assert out["not_json"].startswith("identity=") and "give JSON values" in out["not_json"]
    # A name the checkpoint's metadata uses itself was written over, and the job refused its
    # own checkpoint on the next start.
    assert out["reserved"].startswith("identity='data': a name the checkpoint's own metadata uses")
    # The job's own batch is checked already: another value there would pass a wrong checkpoint.
    assert out["checked"].startswith("identity='global_batch': checked already")
    assert "\n" not in out["other_version"] + out["not_json"] + out["reserved"]


def _experts_reshard(directory: str, saved_stages: list, targets: list) -> dict:
    """In a spawn child with 8 CPU devices: train a tiny MoE under ``saved_stages``, with
    its experts split over its stages' devices (each device saves its own), and restore
    into each of ``targets`` (stages, micro-batches), with and without that split."""
    import jax

    from estimator import jax_models as jm
    from estimator.cells import StagePlan
    from estimator.jax_optim import optimizer_for
    from job_scripts import reshard
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import ParallelPlan

    arch = jm.Arch(family="moe", hidden=32, num_blocks=2, heads=4, vocab=64, seq_len=16, experts=4,
                   expert_group=32, ffn_mult=2, compute_dtype="fp32", optimizer="adafactor")
    stream = stream_for(arch, 0, 16)

    def make(stages, mb):
        bounds = np.linspace(0, arch.num_layers, len(stages) + 1).astype(int)
        plan = ParallelPlan(tuple(StagePlan(int(bounds[i]), int(bounds[i + 1]), *s) for i, s in enumerate(stages)),
                            mb, True)
        return Pipeline(arch, plan, jax.devices()[:plan.num_gpus], 16, optimizer_for(arch.optimizer))

    first = make(saved_stages, 2)
    state, before, saved, read = _train_two_steps_and_save(first, stream, directory)

    out = {"exact": {}, "third": {}, "experts_split": any("shards" in leaf for stage in
                                                         saved.meta["layout"]["kinds"]["params"]["stages"]
                                                         for leaf in stage["leaves"])}
    for stages, mb in targets:
        pipe = make(stages, mb)
        restored = reshard.restore(pipe, saved.meta["layout"], read)
        after = pipe.host_arrays(restored)
        label = pipe.plan.label()
        out["exact"][label] = all(np.array_equal(after[k], before[k]) for k in before)
        out["third"][label] = float(pipe.step(restored, stream.batch(3).inputs, stream.batch(3).targets)[1])
    out["uninterrupted"] = float(first.step(state, stream.batch(3).inputs, stream.batch(3).targets)[1])
    return out


@pytest.mark.parametrize("saved,targets", [
    ([(4, 1, True), (4, 1)], [([(1, 2)], 2), ([(2, 1, True)], 2), ([(2, 1, True), (2, 1)], 2), ([(2, 2, True)], 2)]),
    ([(2, 2, True), (2, 2)], [([(4, 1, True)], 2), ([(1, 2)], 2), ([(1, 4, True), (2, 2)], 2)]),
])
def test_expert_parallel_checkpoints_restore_into_any_plan(tmp_path, saved, targets):
    """Each device of an expert-parallel stage holds different experts and saves its own
    buffer (with tp, each tp rank's block of experts split over its dp ranks); plans with
    and without the split, with and without tp, read them back exactly and train on as
    the uninterrupted run does."""
    out = in_jax_child(8, _experts_reshard, str(tmp_path), saved, targets)
    assert out["experts_split"]
    assert all(out["exact"].values()), out["exact"]
    for loss in out["third"].values():
        assert loss == pytest.approx(out["uninterrupted"], rel=1e-5)


def _zero_reshard(directory: str, saved_text: str, targets: list[str]) -> dict:
    """In a spawn child with 8 CPU devices: train the tiny GPT under ``saved_text``,
    checkpoint it, and restore into each of ``targets``."""
    import jax

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts import reshard
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    spec = load_model(str(ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml"))
    arch = jm.arch_from_model(spec)
    stream = stream_for(arch, 0, 16)

    def make(text):
        n = parse_plan(text).num_gpus
        return Pipeline(arch, plan_from_string(text, spec, arch, 16, n)[0], jax.devices()[:n], 16,
                        optimizer_for(arch.optimizer))

    first = make(saved_text)
    state, before, saved, read = _train_two_steps_and_save(first, stream, directory)
    kinds = saved.meta["layout"]["kinds"]
    out = {"exact": {}, "third": {},
           "segments": [stage.get("segments") for stage in kinds["opt"]["stages"]],
           "weight_segments": [stage.get("segments") for stage in kinds["params"]["stages"]]}
    for text in targets:
        pipe = make(text)
        restored = reshard.restore(pipe, saved.meta["layout"], read)
        after = pipe.host_arrays(restored)
        out["exact"][text] = all(np.array_equal(after[k], before[k]) for k in before)
        out["third"][text] = float(pipe.step(restored, stream.batch(3).inputs, stream.batch(3).targets)[1])
    out["uninterrupted"] = float(first.step(state, stream.batch(3).inputs, stream.batch(3).targets)[1])
    return out


@pytest.mark.parametrize("saved,targets", [
    ("cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=4 remat=1 zero=1",
     ["cell=a100x4:s1 plan=[dp1tp4] mb=2 remat=0", "cell=a100x8:s1 plan=[dp8tp1] mb=2 remat=1 zero=1",
      "cell=a100x4:s2 plan=[dp1tp2|dp2tp1] mb=4 remat=1 zero=1"]),
    ("cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=4 remat=1",
     ["cell=a100x8:s2 plan=[dp4tp1|dp2tp2] mb=2 remat=1 zero=1", "cell=a100x2:s1 plan=[dp2tp1] mb=2 remat=1 zero=1",
      "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=4 remat=1 zero=3"]),
    # ZeRO-2 keeps ZeRO-1's state: its checkpoints are read the same way, and it reads theirs.
    ("cell=a100x8:s2 plan=[dp2tp2|dp2tp2] mb=4 remat=1 zero=2",
     ["cell=a100x4:s1 plan=[dp1tp4] mb=2 remat=0", "cell=a100x8:s1 plan=[dp8tp1] mb=2 remat=1 zero=1",
      "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=2"]),
    # ZeRO-3 saves each rank's chunk of every layer's weights too.
    ("cell=a100x8:s2 plan=[dp2tp2|dp2tp2] mb=4 remat=1 zero=3",
     ["cell=a100x4:s1 plan=[dp1tp4] mb=2 remat=0", "cell=a100x8:s1 plan=[dp8tp1] mb=2 remat=1 zero=3",
      "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=1"]),
    # One layer per stage: each stage's chunks are padded to the largest stage's.
    ("cell=a100x8:s4 plan=[dp2tp1|dp2tp1|dp2tp1|dp2tp1] mb=8 remat=1 zero=3",
     ["cell=a100x4:s1 plan=[dp1tp4] mb=2 remat=0", "cell=a100x8:s2 plan=[dp2tp2|dp2tp2] mb=4 remat=1 zero=3"]),
])
def test_zero_checkpoints_restore_into_any_plan(tmp_path, saved, targets):
    """From ZeRO-1 on each data-parallel rank holds and saves its own chunk of the
    optimizer state (under ZeRO-3 of every layer's weights too); plans with and without
    it, with other dp and tp, read the same arrays back exactly and train on as the
    uninterrupted run does."""
    out = in_jax_child(8, _zero_reshard, str(tmp_path), saved, targets)
    assert all(out["exact"].values()), out["exact"]
    for loss in out["third"].values():
        assert loss == pytest.approx(out["uninterrupted"], rel=1e-5)
    assert all(seg is not None for seg in out["segments"]) == ("zero=" in saved)
    zero3 = "zero=3" in saved
    assert all(seg is not None and seg["float32"]["regions"] for seg in out["weight_segments"]) == zero3
    assert all(seg is None for seg in out["weight_segments"]) != zero3


def test_a_checkpoint_path_that_is_a_file_is_refused_before_any_training(tmp_path):
    """Found at the start, not at the first save after hours of training."""
    from job_scripts.checkpoint import Checkpoints

    (tmp_path / "afile").write_text("x")
    message = _refusal(lambda: Checkpoints(tmp_path / "afile"))
    assert message is not None and "not a directory" in message and "\n" not in message


def test_writers_of_one_json_file_at_once_each_write_a_whole_file():
    """Jobs of one model, batch and Cell share a tuned-plan file: concurrent writers must
    neither fail (a shared temporary name was renamed away under one) nor leave parts."""
    import tempfile
    import threading

    from job_scripts.checkpoint import write_json_atomic

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        errors = []

        def write(k):
            try:
                for i in range(40):
                    write_json_atomic(path, {"writer": k, "i": i, "pad": "x" * 4096})
            except OSError as e:
                errors.append(e)
        threads = [threading.Thread(target=write, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert json.loads(path.read_text())["pad"] == "x" * 4096
        assert [p.name for p in Path(d).iterdir()] == ["plan.json"]  # no temporary left behind


BIG_STEP = 2 ** 24 + 1  # not a float32: the processes' agreement must be exact


def _views(directory: str) -> None:
    """Checkpoint directories as two processes may see one: ``a`` with steps 1 and
    BIG_STEP; ``b`` the same where BIG_STEP cannot be read; ``d`` where no step can;
    ``e`` empty; ``f`` and ``g`` with one step each."""
    import shutil

    import jax.numpy as jnp

    from job_scripts.checkpoint import Checkpoints

    root = Path(directory)
    ckpt = Checkpoints(root / "a", keep=2)
    for step in (1, BIG_STEP):
        ckpt.save(step, {"w": jnp.ones(3) * step}, {"note": step})
    ckpt.close()
    for name in ("a2", "a3", "a4", "b", "d", "f", "g"):
        shutil.copytree(root / "a", root / name)
    (root / "b" / str(BIG_STEP) / "meta" / "metadata").write_text("{not json")
    shutil.rmtree(root / "f" / "1")  # f holds only BIG_STEP, g only step 1
    shutil.rmtree(root / "g" / str(BIG_STEP))
    for step in (1, BIG_STEP):
        (root / "d" / str(step) / "meta" / "metadata").write_text("{not json")
    (root / "e").mkdir()


def _latest_in_two_processes(root: Path, views: tuple[str, str]) -> list[dict]:
    """Each of two jax.distributed processes finds its step to resume from in its view."""
    port = _free_port()
    procs = [_worker("latest", root / view, "-", 0, rank, 2, port) for rank, view in enumerate(views)]
    try:
        for proc in procs:
            _finish(proc)
    finally:
        for proc in procs:  # one hung: its peer waits for it
            if proc.poll() is None:
                proc.kill()
    return [json.loads((root / f"{view}.latest.json").read_text()) for view in views]


def test_every_process_resumes_from_the_same_step_or_none_does(tmp_path):
    """One process could not read the newest step: it resumed from the one before while
    the other resumed from the newest (each reading its own shards: a state mixed from
    two steps, and step counts that differ). Checkpoints that only some processes see
    had some resume and others start from step 1. Each case must also end: a process
    that makes one collective fewer than the other leaves both waiting."""
    in_jax_child(1, _views, str(tmp_path))
    assert _latest_in_two_processes(tmp_path, ("a3", "a4")) == [{"step": BIG_STEP}] * 2
    assert _latest_in_two_processes(tmp_path, ("a", "b")) == [{"step": 1}] * 2
    aside = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert f"{BIG_STEP}.unreadable" in aside and str(BIG_STEP) not in aside  # out of the way of the next save
    different = _latest_in_two_processes(tmp_path, ("a2", "e"))
    assert all("processes see different checkpoints" in r.get("error", "") for r in different), different
    unreadable = _latest_in_two_processes(tmp_path, ("d", "e"))
    assert all("no readable checkpoint" in r.get("error", "") for r in unreadable), unreadable
    apart = _latest_in_two_processes(tmp_path, ("f", "g"))  # no step both can read
    assert all("cannot all read one checkpoint" in r.get("error", "") for r in apart), apart


def _train(ckpt: Path, iterations: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "job_scripts.run", "--model", str(ROOT / "tests/fixtures/runner/tiny-gpt.yaml"),
         "--global-batch", "16", "--iterations", str(iterations), "--devices", "2", "--platform", "cpu", "--no-tune",
         "--plan", "cell=a100x2:s1 plan=[dp2tp1] mb=1 remat=0", "--checkpoint-every", "2",
         "--checkpoint-dir", str(ckpt)], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())


def test_a_step_whose_array_files_are_damaged_is_set_aside_and_the_one_before_resumed(tmp_path):
    """Its metadata reads, its data files do not (truncated after the save completed): the
    job had stopped with a traceback and exit 1 (Slurm does not requeue it), the step
    before it intact."""
    ckpt = tmp_path / "ckpt"
    assert _train(ckpt, 4).returncode == 0
    data = [p for p in (ckpt / "4" / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for path in data:
        path.write_bytes(path.read_bytes()[:50])
    again = _train(ckpt, 6)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint of step 4 cannot be read" in again.stderr and "resumed from step 2 " in again.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name[0].isdigit()) == ["4", "4.unreadable", "6"]
    # A lost file of the database's own (its manifest) is damage too, not another layout.
    (ckpt / "6" / "arrays" / "manifest.ocdbt").unlink()
    lost = _train(ckpt, 8)
    assert lost.returncode == 0, lost.stderr[-3000:]
    assert "checkpoint of step 6 cannot be read" in lost.stderr and "resumed from step 4 " in lost.stderr
    # Every step damaged: one line and exit 2, not training over from step 1.
    for step in ("6", "8"):
        (ckpt / step / "arrays" / "_METADATA").write_text("")
    last = _train(ckpt, 10)
    assert last.returncode == 2 and "no readable checkpoint" in last.stderr and "Traceback" not in last.stderr
    assert "step 1 loss" not in last.stderr
    # Its requeue finds only the steps it set aside: the same refusal, not step 1 afresh.
    requeued = _train(ckpt, 10)
    assert requeued.returncode == 2 and "every one was set aside as unreadable" in requeued.stderr
    assert "step 1 loss" not in requeued.stderr
    # A directory of the first format's checkpoints (ckpt-NNNNNNNN.npz) is refused too.
    old = tmp_path / "old"
    old.mkdir()
    (old / "ckpt-00000004.npz").write_bytes(b"PK")
    (old / "ckpt-00000004.json").write_text("{}")
    first_format = _train(old, 6)
    assert first_format.returncode == 2 and "older format (ckpt-*.npz)" in first_format.stderr
    assert "step 1 loss" not in first_format.stderr
