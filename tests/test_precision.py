"""The runner's precision (``job_scripts.precision``): fp16 training with dynamic loss
scaling in the SPMD pipeline, and which GPUs get it.

The check is against fp32: one SGD step's weight update is the gradient times the learning
rate, so comparing updates compares gradients. With a 32,768-token vocabulary and 8,192
tokens a step, the loss's gradient per logit is ~1e-8, below fp16's smallest subnormal:
unscaled, most weights get no update at all.
"""

import pytest

from conftest import in_jax_child

TINY_GPT = "tests/fixtures/runner/tiny-gpt.yaml"
VOCAB, BATCH = 32768, 256
ONE = "cell=v100x1:s1 plan=[dp1tp1] mb=1 remat=1"
PLANS = [ONE,
         "cell=v100x4:s2 plan=[dp2tp1|dp1tp2] mb=2 remat=1 layers=0,2,4",  # pipeline, dp and tp
         "cell=v100x4:s1 plan=[dp4tp1] mb=4 remat=0 zero=2",  # gradients reduce-scattered as they come
         "cell=v100x4:s1 plan=[dp2tp2] mb=2 remat=1 zero=3"]


# Wide-ResNet in fp16: batch-norm statistics are model state, which a skipped step keeps.
WRN_FP16 = dict(family="wide_resnet", base_channels=4, width=2, image_size=32, num_classes=8,
                compute_dtype="fp16", optimizer="sgd_nesterov")


def _pipeline(dtype: str, plan_text: str, saved_scale: dict | None = None, wrn: bool = False,
              vocab: int = VOCAB):
    import jax
    from dataclasses import replace

    from estimator import jax_models as jm
    from estimator.jax_optim import sgd_nesterov
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    if wrn:
        from estimator.cells import StagePlan
        from job_scripts.plan import ParallelPlan
        arch = jm.Arch(**WRN_FP16)
        plan = ParallelPlan((StagePlan(0, arch.num_layers, 2, 1),), 2, True, 0)
    else:
        spec = load_model(TINY_GPT)
        arch = replace(jm.arch_from_model(spec), vocab=vocab, compute_dtype=dtype)
        plan = plan_from_string(plan_text, spec, arch, BATCH, parse_plan(plan_text).num_gpus)[0]
    pipe = Pipeline(arch, plan, jax.devices()[:plan.num_gpus], BATCH, sgd_nesterov(lr=0.1 if not wrn else 1e-3))
    if saved_scale is not None:
        pipe.set_loss_scale(saved_scale)
    return arch, pipe


def _updates(dtype: str, plan_text: str, saved_scale: dict | None = None) -> dict:
    """One step's weight updates (by name), the loss, and the loss scale after it."""
    from job_scripts.data import stream_for
    from job_scripts.precision import to_json

    arch, pipe = _pipeline(dtype, plan_text, saved_scale)
    state = pipe.init(0)
    before = {k: v for k, v in pipe.host_arrays(state).items() if k.startswith("params/")}
    batch = stream_for(arch, 0, BATCH).batch(1)
    state, loss = pipe.step(state, batch.inputs, batch.targets)
    after = pipe.host_arrays(state)
    return {"updates": {k: after[k] - before[k] for k in before}, "loss": float(loss),
            "scale": to_json(pipe.loss_scale) if pipe.loss_scale is not None else None}


def _against_fp32() -> dict:
    import numpy as np

    exact = _updates("fp32", ONE)

    def compare(out):
        lost = sum(int(np.sum((out["updates"][k] == 0) & (d != 0))) for k, d in exact["updates"].items())
        moved = sum(int(np.sum(d != 0)) for d in exact["updates"].values())
        err = max(float(np.linalg.norm(out["updates"][k] - d) / np.linalg.norm(d)) for k, d in exact["updates"].items())
        return {"lost": lost / moved, "error": err, "loss": out["loss"], "scale": out["scale"]}

    return {"fp32_loss": exact["loss"],
            "unscaled": compare(_updates("fp16", ONE, {"scale": 1.0, "good_steps": 0})),
            "scaled": {plan: compare(_updates("fp16", plan)) for plan in PLANS}}


def test_fp16_with_loss_scaling_updates_every_weight_as_fp32_does_under_every_plan():
    out = in_jax_child(4, _against_fp32)
    # What fp16 without scaling loses: most weights' gradients underflow to zero.
    assert out["unscaled"]["lost"] > 0.3 and out["unscaled"]["error"] > 0.3
    for plan, scaled in out["scaled"].items():
        assert scaled["lost"] < 1e-3, (plan, scaled)
        assert scaled["error"] < 0.05, (plan, scaled)
        assert scaled["loss"] == pytest.approx(out["fp32_loss"], rel=1e-3), plan
        assert scaled["scale"] == {"scale": 2.0**15, "good_steps": 1}, plan


def _overflow(plan_text: str, wrn: bool = False) -> dict:
    import numpy as np

    from job_scripts.data import stream_for
    from job_scripts.precision import from_arrays, to_json

    arch, pipe = _pipeline("fp16", plan_text, {"scale": 2.0**40, "good_steps": 7}, wrn, vocab=128)
    state = pipe.init(0)
    first = pipe.host_arrays(state)
    stream = stream_for(arch, 0, BATCH)
    b = stream.batch(1)
    state, _ = pipe.step(state, b.inputs, b.targets)  # 2**40 × the loss overflows fp16
    skipped = pipe.host_arrays(state)
    out = {"unchanged": all(np.array_equal(first[k], skipped[k]) for k in first),
           "kinds": sorted({k.split("/")[0] for k in first}), "finite": bool(pipe.last_step_finite),
           "after_overflow": to_json(pipe.loss_scale)}
    # Then a scale that does not overflow (Wide-ResNet's gradients are ~50: 1).
    pipe.loss_scale = from_arrays(pipe.loss_scale.loss_scale / (2.0**39 if wrn else 2.0**24), pipe.loss_scale.counter)
    state, _ = pipe.step(state, b.inputs, b.targets)
    stepped = pipe.host_arrays(state)
    out["moved"] = sum(int(np.sum(stepped[k] != first[k])) for k in first if k.startswith("params/"))
    out["after_good_step"], out["finite_after"] = to_json(pipe.loss_scale), bool(pipe.last_step_finite)
    # What the tuner and the memory benchmarks do: compile for abstract arguments.
    out["temp_bytes"] = int(pipe.compile().memory_analysis().temp_size_in_bytes)
    return out


@pytest.mark.parametrize("plan", PLANS + ["wide_resnet [dp2tp1] mb=2"])
def test_an_overflowing_step_is_skipped_whole_and_the_scale_halves(plan):
    """Every update path: a single stage, a pipeline's per-stage update, ZeRO-2's and
    ZeRO-3's chunked ones, and a model with batch-norm state."""
    wrn = plan.startswith("wide_resnet")
    out = in_jax_child(4, _overflow, plan, wrn)
    assert out["temp_bytes"] > 0
    # Weights, optimizer state (momentum) and model state as they were.
    assert out["unchanged"] and out["kinds"] == (["opt", "params", "state"] if wrn else ["opt", "params"])
    assert out["after_overflow"] == {"scale": 2.0**39, "good_steps": 0} and not out["finite"]
    assert out["moved"] > 0
    assert out["after_good_step"] == {"scale": 1.0 if wrn else 2.0**15, "good_steps": 1} and out["finite_after"]


def _traced_init_then_step() -> dict:
    import jax

    from job_scripts.data import stream_for
    from job_scripts.precision import to_json

    arch, pipe = _pipeline("fp16", ONE, vocab=128)
    shapes = jax.eval_shape(pipe.init, 0)  # abstract: must leave no tracer as the loss scale
    traced_scale = pipe.loss_scale
    state = pipe.init(0)
    b = stream_for(arch, 0, BATCH).batch(1)
    state, loss = pipe.step(state, b.inputs, b.targets)
    return {"traced_scale": traced_scale, "kinds": sorted(shapes), "loss": float(loss),
            "scale": to_json(pipe.loss_scale)}


def test_tracing_init_leaves_the_loss_scale_to_the_real_init():
    out = in_jax_child(1, _traced_init_then_step)
    assert out["traced_scale"] is None and out["kinds"] == ["opt", "params", "state"]
    assert out["scale"] == {"scale": 2.0**15, "good_steps": 1} and out["loss"] > 0


def _one_device_overflows() -> list[bool]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from job_scripts.precision import finite_everywhere

    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("pp", "d0"))
    grads = np.ones((2, 2, 3), np.float32)
    grads[1, 0, 2] = np.inf  # one device of one stage
    f = jax.shard_map(lambda g: finite_everywhere({"float32": g}, ("pp", "d0"))[None, None],
                      mesh=mesh, in_specs=P("pp", "d0"), out_specs=P("pp", "d0"))
    return [bool(v) for v in np.asarray(jax.jit(f)(jnp.asarray(grads))).ravel()]


def test_one_devices_overflow_skips_the_step_on_every_device():
    assert in_jax_child(4, _one_device_overflows) == [False] * 4


@pytest.mark.parametrize("saved", [{"scale": 0.5, "good_steps": 0}, {"scale": float("nan"), "good_steps": 0},
                                   {"scale": 1024.0, "good_steps": 2000}, {"scale": "big"}, {}, [3]])
def test_a_checkpointed_loss_scale_that_is_not_one_is_refused_in_one_line(saved):
    import jax
    from jax.sharding import SingleDeviceSharding

    from job_scripts.checkpoint import CheckpointError
    from job_scripts.precision import new_loss_scale

    with pytest.raises(CheckpointError, match="loss scale") as e:
        new_loss_scale(SingleDeviceSharding(jax.devices()[0]), saved)
    assert "\n" not in str(e.value)


def test_skipped_steps_are_logged_and_eight_in_a_row_at_scale_one_stop_the_training(caplog):
    from job_scripts.precision import SKIPS_AT_SCALE_ONE_LIMIT, DivergedError, check_step

    assert check_step(5, True, 2.0**15, 3) == 0  # a good step ends a run of skips
    assert check_step(6, False, 2.0**15, 3) == 0  # a skip above scale 1 is the search
    assert "step 6 skipped" in caplog.text and "32768" in caplog.text
    skips = 0
    for step in range(SKIPS_AT_SCALE_ONE_LIMIT - 1):
        skips = check_step(step, False, 1.0, skips)
    assert skips == SKIPS_AT_SCALE_ONE_LIMIT - 1
    with pytest.raises(DivergedError, match="diverged") as e:
        check_step(99, False, 1.0, skips)
    assert "\n" not in str(e.value)


def _runner_with_nan_weights(checkpoint_dir: str, model: str = "tests/fixtures/runner/tiny-gpt-fp16.yaml") -> int:
    """The built-in runner on a model (fp16 unless ``model`` says) whose initial weights are
    NaN (the one fault put in): every step's gradients are non-finite at any scale."""
    import jax.numpy as jnp

    from job_scripts import pipeline, run

    init = pipeline.Pipeline.init

    def nan_init(self, seed):
        state = init(self, seed)
        return {**state, "params": {dt: b * jnp.nan for dt, b in state["params"].items()}}

    pipeline.Pipeline.init = nan_init
    return run.main(["--model", model, "--global-batch", "16",
                     "--iterations", "40", "--devices", "1", "--platform", "cpu", "--checkpoint-dir", checkpoint_dir,
                     "--checkpoint-every", "4", "--plan", "cell=v100x1:s1 plan=[dp1tp1] mb=1 remat=1"])


def test_a_run_whose_gradients_never_come_finite_stops_with_exit_3(tmp_path, capfd):
    from estimator.contract import EXIT_DIVERGED
    from job_scripts.precision import INITIAL_LOSS_SCALE, SKIPS_AT_SCALE_ONE_LIMIT

    assert in_jax_child(1, _runner_with_nan_weights, str(tmp_path / "ckpt")) == EXIT_DIVERGED == 3
    err = capfd.readouterr().err
    # Halved every step from 2**15 to 1, then eight skips at 1.
    last = 15 + SKIPS_AT_SCALE_ONE_LIMIT
    assert INITIAL_LOSS_SCALE == 2.0**15
    assert "step 1 skipped: its fp16 gradients overflowed at loss scale 32768" in err
    assert f"step {last} skipped" in err and f"step {last + 1} " not in err
    assert err.count("job_scripts.run: error:") == 1 and "the model diverged" in err
    # No checkpoint of a step inside the streak at scale 1 (steps 16 on): a resubmitted job
    # would resume past them as if they had trained.
    steps = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert steps and max(steps) < 16, steps


@pytest.mark.parametrize("kind, gpu", [("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA A100-SXM4-40GB", "a100"),
                                       ("Tesla V100S-PCIE-32GB", "v100"), ("Quadro GV100", "v100"),
                                       ("NVIDIA A10", "a10"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA A40", "a40"), ("cpu", None), ("TFRT_CPU_0", None)])
def test_the_device_kind_names_its_catalog_type(kind, gpu):
    from job_scripts.precision import catalog_type_of_device
    assert catalog_type_of_device(kind) == gpu


def test_volta_has_no_bf16_tensor_cores_and_an_fp16_model_trains_there_in_fp16():
    from dataclasses import replace

    from estimator import jax_models as jm
    from estimator.gpus import gpu_type
    from estimator.models import load_model
    from job_scripts.precision import training_arch

    assert gpu_type("v100").peak_tflops("bf16") == gpu_type("v100").fp32_tflops == 15.7
    assert gpu_type("v100").peak_tflops("fp16") == 125.0
    assert gpu_type("a100").peak_tflops("bf16") == gpu_type("a100").peak_tflops("fp16") == 312.0
    a16 = replace(jm.arch_from_model(load_model(TINY_GPT)), compute_dtype="fp16")
    assert training_arch(a16, "v100").compute_dtype == "fp16"
    assert training_arch(a16, "V100").compute_dtype == "fp16"
    for gpu in ("a100", "h100", "a10", "some-new-gpu", ""):
        assert training_arch(a16, gpu).compute_dtype == "bf16", gpu
    a32 = replace(a16, compute_dtype="fp32")
    assert training_arch(a32, "v100") is a32 and training_arch(a32, "a100") is a32


@pytest.mark.parametrize("capability, dtype", [("7.5", "fp16"), ("7.0", "fp16"), ("8.0", "bf16"), ("8.9", "bf16"),
                                               ("9.0", "bf16"), (None, "bf16")])
def test_a_gpu_outside_the_catalog_trains_in_what_its_tensor_cores_take(capability, dtype):
    """A T4 (Turing, compute capability 7.5) is in no catalog: its tensor cores take fp16
    only, so an fp16 model trains there in fp16 with loss scaling, not in bf16 on its CUDA
    cores. The device's capability decides over the type's name; a device that says none
    (a CPU) leaves the catalog's rule."""
    from dataclasses import replace
    from types import SimpleNamespace

    from estimator import jax_models as jm
    from estimator.models import load_model
    from job_scripts.precision import device_takes_bf16, training_arch

    a16 = replace(jm.arch_from_model(load_model(TINY_GPT)), compute_dtype="fp16")
    said = {} if capability is None else {"compute_capability": capability}
    device = SimpleNamespace(device_kind="Tesla T4", **said)
    assert device_takes_bf16(device) is (None if capability is None else dtype == "bf16")
    assert training_arch(a16, "t4", device_takes_bf16(device)).compute_dtype == dtype
    assert training_arch(a16, "v100", device_takes_bf16(SimpleNamespace())).compute_dtype == "fp16"


def test_a_run_without_loss_scaling_stops_at_its_first_non_finite_loss_and_saves_nothing(tmp_path, capfd):
    """fp32 (bf16 alike): no step is skipped, so a NaN loss means the weights are gone; the
    run stops there (exit 3) before it saves over its good checkpoints."""
    from estimator.contract import EXIT_DIVERGED
    assert in_jax_child(1, _runner_with_nan_weights, str(tmp_path / "ckpt"),
                        "tests/fixtures/runner/tiny-gpt.yaml") == EXIT_DIVERGED
    err = capfd.readouterr().err
    assert "step 1's loss is nan: the model diverged" in err and "step 2 " not in err
    assert not any(p.name.isdigit() for p in (tmp_path / "ckpt").glob("*"))  # nothing saved
