"""The SPMD pipeline against an independent oracle, the per-stage pipeline.

Every plan runs as one ``shard_map`` program (``job_scripts.pipeline``); the oracle
(``tests/reference_pipeline.py``) runs each stage as its own automatically partitioned
program and moves activations with ``device_put``. They share only the layer code. For
each plan both train the same steps from the same seed, and their losses and whole
training states (weights, optimizer moments, batch-norm statistics) must agree to
float32 rounding: a wrong collective, a gradient scaled by dp or tp, a stage boundary
resharded wrongly or a residual unpacked from the wrong place shows up as a mismatch.

JAX runs in a spawn child with 8 CPU devices (pytest's own process may have started JAX
with one).
"""

import multiprocessing
import os

import pytest

from conftest import in_jax_child
from estimator.compiled import _worker_init, child_xla_flags

TINY_GPT = "tests/fixtures/runner/tiny-gpt.yaml"
TINY = {
    "moe": dict(family="moe", hidden=32, num_blocks=2, heads=4, vocab=64, seq_len=16, experts=4,
                expert_group=32, ffn_mult=2, compute_dtype="fp32", optimizer="adafactor"),
    "wide_resnet": dict(family="wide_resnet", base_channels=4, width=2, image_size=32,
                        num_classes=8, compute_dtype="fp32", optimizer="sgd_nesterov"),
}


def _child_init(xla_flags: str, cache_dir: str) -> None:
    """The child's 8 CPU devices, and XLA's persistent compilation cache in ``cache_dir``
    for every program it compiles: the oracle compiles the same per-stage programs for
    many plans (one stage layout at every ZeRO level), and the cache compiles each once.
    The programs and their results are the same."""
    _worker_init(xla_flags)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    ctx = multiprocessing.get_context("spawn")
    cache_dir = str(tmp_path_factory.mktemp("xla-cache"))
    with ctx.Pool(1, initializer=_child_init, initargs=(child_xla_flags(8), cache_dir)) as pool:
        yield pool


def _compare(arch_kw: dict | None, plan_text: str | None, stages: list | None, micro_batches: int,
             remat: bool, steps: int, lr: float | None = None, batch_size: int = 16, zero: int = 0) -> dict:
    """Train ``steps`` steps with both pipelines; return their losses and the worst state
    difference, relative to each array's largest magnitude."""
    import os
    import sys

    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(__file__))
    from reference_pipeline import Trainer

    from estimator import jax_models as jm
    from estimator.cells import StagePlan
    from estimator.jax_optim import optimizer_for, sgd_nesterov
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import ParallelPlan, plan_from_string

    if arch_kw is None:
        spec = load_model(TINY_GPT)
        arch = jm.arch_from_model(spec)
        plan = plan_from_string(plan_text, spec, arch, batch_size, parse_plan(plan_text).num_gpus)[0]
    else:
        arch = jm.Arch(**arch_kw)
        bounds = np.linspace(0, arch.num_layers, len(stages) + 1).astype(int)
        plan = ParallelPlan(tuple(StagePlan(int(bounds[i]), int(bounds[i + 1]), *stage)
                                  for i, stage in enumerate(stages)), micro_batches, remat, zero)
    # wide_resnet on random images has gradients of ~50: a small step keeps it stable.
    opt = sgd_nesterov(lr=lr) if lr else optimizer_for(arch.optimizer)
    devices = jax.devices()[:plan.num_gpus]
    stream = stream_for(arch, 0, batch_size)
    pipe = Pipeline(arch, plan, devices, batch_size, opt)
    state = pipe.init(0)
    oracle = Trainer(arch, plan, devices, batch_size, opt)
    oracle.init(0)
    spmd, ref = [], []
    for step in range(1, steps + 1):
        b = stream.batch(step)
        state, loss = pipe.step(state, b.inputs, b.targets)
        spmd.append(float(loss))
        ref.append(oracle.step(b.inputs, b.targets))
    mine, theirs = pipe.host_arrays(state), oracle.state_arrays()
    opt_elements = {dt: int(b.shape[-1]) for dt, b in state["opt"].items()}
    params_elements = {dt: int(b.shape[-1]) for dt, b in state["params"].items()}
    worst = max((float(np.max(np.abs(mine[k] - theirs[k])) / max(1e-3, float(np.max(np.abs(theirs[k]))))), k)
                for k in theirs)
    return {"spmd": spmd, "ref": ref, "worst": worst, "names": sorted(mine) == sorted(theirs),
            "label": plan.label(), "opt_elements": opt_elements, "params_elements": params_elements,
            "weights": sum(int(np.prod(v.shape)) for k, v in theirs.items() if k.startswith("params/"))}


GPT_PLANS = [
    "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1",
    "cell=a100x2:s1 plan=[dp1tp2] mb=1 remat=0",
    "cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=2 remat=1 layers=0,2,4",  # dp → tp across the boundary
    "cell=a100x4:s2 plan=[dp1tp2|dp2tp1] mb=4 remat=0",  # tp → dp, every intermediate kept
    "cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=4 remat=1",
    "cell=a100x8:s4 plan=[dp2tp1|dp1tp2|dp2tp1|dp1tp2] mb=8 remat=1",
    # ZeRO-1: AdamW's moments split over each stage's data-parallel group
    "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=1",
    "cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=4 remat=1 zero=1",
    "cell=a100x8:s4 plan=[dp2tp1|dp1tp2|dp2tp1|dp1tp2] mb=8 remat=0 zero=1",
    # Stages split alike: one update outside the stage switch, replicated and ZeRO-1
    "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=4 remat=1",
    "cell=a100x8:s2 plan=[dp2tp2|dp2tp2] mb=4 remat=0 zero=1",
    # ZeRO-2: each micro-batch's gradients reduce-scattered into a chunk accumulator
    "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=2",
    "cell=a100x4:s1 plan=[dp2tp2] mb=2 remat=0 zero=2",
    "cell=a100x8:s2 plan=[dp2tp2|dp2tp2] mb=4 remat=0 zero=2",
    "cell=a100x8:s4 plan=[dp2tp1|dp2tp1|dp2tp1|dp2tp1] mb=8 remat=1 zero=2",
    # ZeRO-3: weights split over dp too, each layer's gathered inside its checkpoint
    "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=3",
    "cell=a100x4:s1 plan=[dp2tp2] mb=2 remat=1 zero=3",
    "cell=a100x8:s2 plan=[dp2tp2|dp2tp2] mb=4 remat=1 zero=3",
    "cell=a100x8:s4 plan=[dp2tp1|dp2tp1|dp2tp1|dp2tp1] mb=8 remat=1 zero=3",
]


@pytest.mark.parametrize("plan", GPT_PLANS)
def test_every_gpt_plan_trains_exactly_as_the_per_stage_pipeline(child, plan):
    out = child.apply(_compare, (None, plan, None, 0, True, 3))
    assert out["names"]
    assert out["spmd"] == pytest.approx(out["ref"], rel=1e-5)
    assert out["worst"][0] < 1e-4, out["worst"]  # weights and AdamW moments, float32 rounding
    assert out["spmd"][2] < out["spmd"][0]  # and it learns


def _compare_in_pieces(piece_min: int, *args) -> dict:
    """``_compare`` with the flat update stepping pieces of at least ``piece_min``
    elements (the tiny GPT's stages are far below the default: one piece)."""
    from job_scripts import flat_optimizer

    default, flat_optimizer.UPDATE_PIECE_MIN = flat_optimizer.UPDATE_PIECE_MIN, piece_min
    try:
        return {**_compare(*args), "pieces_of": flat_optimizer.UPDATE_PIECE_MIN}
    finally:  # the child runs the other tests too
        flat_optimizer.UPDATE_PIECE_MIN = default


@pytest.mark.parametrize("plan", ["cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1",
                                  "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=1",
                                  "cell=a100x8:s2 plan=[dp2tp2|dp2tp2] mb=4 remat=0 zero=2",
                                  "cell=a100x8:s4 plan=[dp2tp1|dp2tp1|dp2tp1|dp2tp1] mb=8 remat=1 zero=3",
                                  "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=4 remat=1"])
def test_the_update_stepped_in_pieces_in_place_trains_as_the_per_stage_pipeline(child, plan):
    """The flat update in up to 32 uneven pieces (of at least 1,000 elements, not 2^20)
    takes the same steps as the oracle's whole-tree update."""
    out = child.apply(_compare_in_pieces, (1000, None, plan, None, 0, True, 3))
    assert out["pieces_of"] == 1000
    assert out["spmd"] == pytest.approx(out["ref"], rel=1e-5)
    assert out["worst"][0] < 1e-4, out["worst"]


@pytest.mark.parametrize("plan", ["cell=a100x2:s2 plan=[dp1tp1|dp1tp1] mb=3 remat=1",
                                  "cell=a100x2:s1 plan=[dp2tp1] mb=3 remat=0"])
def test_odd_global_batch_of_6_in_3_micro_batches_trains_as_the_per_stage_pipeline(child, plan):
    out = child.apply(_compare, (None, plan, None, 0, True, 3, None, 6))
    assert out["spmd"] == pytest.approx(out["ref"], rel=1e-5)
    assert out["worst"][0] < 1e-4, out["worst"]


@pytest.mark.parametrize("stages,mb,remat", [([(2, 2)], 2, True), ([(2, 1), (1, 2)], 2, True),
                                             ([(1, 2), (2, 1), (1, 2), (2, 1)], 4, False)])
def test_moe_experts_sharded_over_tp_train_as_the_per_stage_pipeline(child, stages, mb, remat):
    out = child.apply(_compare, (TINY["moe"], None, stages, mb, remat, 3))
    assert out["spmd"] == pytest.approx(out["ref"], rel=1e-5)
    # Adafactor divides by tiny second moments of zero-initialised biases: looser.
    assert out["worst"][0] < 1e-2, out["worst"]


@pytest.mark.parametrize("blocks,stages,mb,remat", [(2, [(4, 1, True)], 2, True),
                                                    (2, [(2, 1, True), (1, 2)], 2, False),
                                                    (4, [(2, 1), (2, 1, True)], 4, True),
                                                    (2, [(2, 2, True)], 2, True),
                                                    (4, [(2, 2, True), (4, 1, True)], 2, False)])
def test_moe_experts_split_over_dp_train_as_the_per_stage_pipeline(child, blocks, stages, mb, remat):
    """Expert parallelism (``ep``): each device holds its share of the experts (with tp,
    its tp rank's block split over the dp group) and its tokens reach them by all-to-all;
    the oracle keeps every expert on every replica. The same steps, losses and states
    (experts, their Adafactor moments) follow."""
    out = child.apply(_compare, ({**TINY["moe"], "num_blocks": blocks}, None, stages, mb, remat, 3))
    assert out["names"]
    assert "ep" in out["label"]
    assert out["spmd"] == pytest.approx(out["ref"], rel=1e-5)
    assert out["worst"][0] < 1e-2, out["worst"]


@pytest.mark.parametrize("stages,mb", [([(1, 4)], 1), ([(2, 1), (1, 2)], 2), ([(4, 1)], 1)])
def test_wide_resnet_channels_and_synced_batch_norm_match_the_per_stage_pipeline(child, stages, mb):
    # One step: this tiny network's batch norm amplifies rounding (gradients of ~50), so
    # any two programs drift apart after the first update; the first must agree.
    out = child.apply(_compare, (TINY["wide_resnet"], None, stages, mb, True, 1, 1e-3))
    assert out["spmd"] == pytest.approx(out["ref"], rel=1e-5)
    assert out["worst"][0] < 1e-4, out["worst"]


def test_zero1_splits_the_optimizer_state_over_dp_and_trains_as_replicated_states(child):
    """ZeRO-1 against the oracle's replicated states: the same losses, weights and AdamW
    moments (checked by the GPT plans above), and each device keeps a quarter of them."""
    whole = child.apply(_compare, (None, "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", None, 0, True, 1))
    split = child.apply(_compare, (None, "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=1", None, 0, True, 1))
    assert whole["opt_elements"]["float32"] >= 2 * whole["weights"]  # μ and ν of every weight
    assert split["opt_elements"]["float32"] <= 2 * (-(-whole["weights"] // 4))


def test_zero3_splits_the_weights_over_dp_and_trains_as_replicated_weights(child):
    """ZeRO-3 against the same plan with whole weights: the same losses and state (the
    oracle's, as above), and each device keeps a quarter of the weights (each layer's
    chunk rounded up) and of AdamW's moments."""
    plan = "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1"
    whole = child.apply(_compare, (None, plan, None, 0, True, 2))
    split = child.apply(_compare, (None, plan + " zero=3", None, 0, True, 2))
    assert whole["params_elements"]["float32"] >= whole["weights"]
    quarter = -(-whole["weights"] // 4) + 4  # up to 3 elements of padding per layer (4 layers)
    assert whole["weights"] // 4 <= split["params_elements"]["float32"] <= quarter
    assert split["opt_elements"]["float32"] <= 2 * quarter + 1  # μ, ν and the step count
    assert split["spmd"] == pytest.approx(whole["spmd"], rel=1e-5)
    assert split["spmd"] == pytest.approx(split["ref"], rel=1e-5) and split["worst"][0] < 1e-4


@pytest.mark.parametrize("stages,mb,zero", [([(4, 1)], 2, 1), ([(2, 1), (1, 2)], 2, 1), ([(2, 1), (2, 1)], 2, 1),
                                            ([(4, 1)], 2, 2), ([(2, 1), (2, 1)], 2, 2),
                                            ([(4, 1)], 2, 3), ([(2, 1), (2, 1)], 2, 3)])
def test_zero_with_sgd_momentum_and_batch_norm_matches_the_per_stage_pipeline(child, stages, mb, zero):
    out = child.apply(_compare, (TINY["wide_resnet"], None, stages, mb, True, 1, 1e-3, 16, zero))
    assert f"zero={zero}" in out["label"]
    assert out["spmd"] == pytest.approx(out["ref"], rel=1e-5)
    assert out["worst"][0] < 1e-4, out["worst"]


def _hlo_and_refusal() -> dict:
    import jax

    from estimator import jax_models as jm
    from estimator.errors import SpecError
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from job_scripts.pipeline import Pipeline
    from estimator.cells import StagePlan
    from job_scripts.plan import ParallelPlan, check_plan, plan_from_string

    spec = load_model(TINY_GPT)
    arch = jm.arch_from_model(spec)
    plan = plan_from_string("cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=4 remat=1", spec, arch, 16, 4)[0]
    text = Pipeline(arch, plan, jax.devices()[:4], 16, optimizer_for(arch.optimizer)).compile().as_text()
    errors = []
    for bad in ("cell=a100x8:s1 plan=[dp1tp8] mb=1 remat=1",  # 4 heads cannot split 8 ways
                "cell=a100x4:s1 plan=[dp4tp1] mb=8 remat=1"):  # micro-batches of 2 over dp 4
        try:
            plan_from_string(bad, spec, arch, 16, 4 if "x4" in bad else 8)
        except SpecError as e:
            errors.append(str(e))
    zero = []
    moe = jm.Arch(**TINY["moe"])
    half = arch.num_layers // 2
    for bad, a, n in ((ParallelPlan((StagePlan(0, moe.num_layers, 2, 1),), 2, True, 1), moe, 2),  # Adafactor
                      (ParallelPlan((StagePlan(0, arch.num_layers, 2, 1),), 2, False, 3), arch, 2),  # no remat
                      (ParallelPlan((StagePlan(0, half, 2, 1), StagePlan(half, arch.num_layers, 1, 2)), 4, True, 2),
                       arch, 4)):  # ZeRO-2 over stages split differently
        try:
            check_plan(bad, a, 16, n)
        except SpecError as e:
            zero.append(str(e))
    return {"permutes": text.count("collective-permute"), "errors": errors, "zero": zero}


def test_stages_exchange_micro_batches_by_collective_permutes_and_bad_plans_say_why(child):
    out = child.apply(_hlo_and_refusal)
    assert out["permutes"] >= 2  # forward activations one way, gradients the other
    assert len(out["errors"]) == 2
    for message in out["errors"]:
        assert "\n" not in message and "plan [dp" in message
    assert "must divide dimension" in out["errors"][0]
    assert "must divide the micro-batch of 2 samples" in out["errors"][1]
    assert len(out["zero"]) == 3 and all("\n" not in m for m in out["zero"])
    assert "adafactor" in out["zero"][0] and "ZeRO-3 gathers" in out["zero"][1] and "remat=1" in out["zero"][1]
    assert "split alike" in out["zero"][2]


def _traced_step(plan_text: str):
    """The tiny GPT's step under ``plan_text``, traced: (closed jaxpr, pipeline)."""
    import jax
    import numpy as np

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    spec = load_model(TINY_GPT)
    arch = jm.arch_from_model(spec)
    plan = plan_from_string(plan_text, spec, arch, 16, parse_plan(plan_text).num_gpus)[0]
    pipe = Pipeline(arch, plan, jax.devices()[:plan.num_gpus], 16, optimizer_for(arch.optimizer))
    state = pipe.init(0)
    x_shape, x_dtype = jm.activation_shape(arch, 0, 16)
    xs, ys = pipe.place_batch(np.zeros(x_shape, x_dtype), np.zeros(jm.label_shape(arch, 16), np.int32))
    return jax.make_jaxpr(pipe._step)(state["params"], state["opt"], state["state"], pipe._zero_stash(), xs, ys), pipe


def _jaxprs(jaxpr):
    """``jaxpr`` and every jaxpr nested in its equations (branches, scans, shard_map)."""
    from jax.extend import core as jcore

    yield jaxpr
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    yield from _jaxprs(sub)


def _closed_over_arrays(plan_text: str) -> dict:
    """The shapes of every array the traced step closes over (constants of the program),
    through every nested jaxpr; and the residual and activation row lengths."""
    from jax.extend import core as jcore

    closed, pipe = _traced_step(plan_text)
    out = []
    for jaxpr in _jaxprs(closed):
        out += [tuple(c.shape) for c in getattr(jaxpr, "consts", ()) if hasattr(c, "shape")]
        out += [tuple(v.val.shape) for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns for v in eqn.invars
                if isinstance(v, jcore.Literal) and getattr(v.val, "shape", ())]
    return {"closed_over": out, "rows": sorted({*pipe.res_lengths.values(), *pipe.act_lengths.values()})}


def _update_barriers(piece_min: int, plan_text: str) -> int:
    """Optimization barriers in the traced step with the flat update's pieces of at least
    ``piece_min`` elements: one per piece when it steps in pieces."""
    from job_scripts import flat_optimizer

    default, flat_optimizer.UPDATE_PIECE_MIN = flat_optimizer.UPDATE_PIECE_MIN, piece_min
    try:
        closed, _ = _traced_step(plan_text)
    finally:
        flat_optimizer.UPDATE_PIECE_MIN = default
    return sum(eqn.primitive.name == "optimization_barrier"
               for jaxpr in _jaxprs(closed) for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns)


def _whole_buffer_concatenates(plan_text: str) -> int:
    """Concatenations in the traced step whose result is as long as a device's weight
    buffer: a packed copy built whole from pieces."""
    closed, pipe = _traced_step(plan_text)
    whole = set(pipe.lengths["params"].values())
    return sum(eqn.primitive.name == "concatenate" and eqn.outvars[0].aval.shape[0] in whole
               for jaxpr in _jaxprs(closed) for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns)


@pytest.mark.parametrize("plan", ["cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=4 remat=1",
                                  "cell=a100x4:s2 plan=[dp1tp2|dp1tp2] mb=4 remat=0"])
def test_a_pipeline_packs_its_gradients_layer_by_layer(child, plan):
    """A pipeline's backward branch writes each micro-batch's weight gradients into their
    packed buffer layer by layer: concatenated whole, XLA built the buffer in two nested
    concatenations and held the inner one beside it (gpt-760m on a 2-stage dp 2 pipeline
    compiled for an H100: 10.8 → 10.2 GB, program revision 8)."""
    assert child.apply(_whole_buffer_concatenates, (plan,)) == 0


def _slot_writes_in_micro_batch_loop(plan_text: str) -> int:
    """Dynamic-update-slices into a whole weight-sized buffer inside the step's scans (the
    micro-batch loop): one per weight array when gradients are summed into the packed
    buffer slot by slot."""
    closed, pipe = _traced_step(plan_text)
    whole = set(pipe.lengths["params"].values())
    scans = [eqn.params["jaxpr"] for jaxpr in _jaxprs(closed) for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns
             if eqn.primitive.name == "scan"]
    return sum(eqn.primitive.name == "dynamic_update_slice" and eqn.outvars[0].aval.shape[0] in whole
               for scan in scans for jaxpr in _jaxprs(scan) for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns)


@pytest.mark.parametrize("plan", ["cell=a100x1:s1 plan=[dp1tp1] mb=4 remat=1",
                                  "cell=a100x4:s1 plan=[dp2tp2] mb=2 remat=0",
                                  "cell=a100x4:s1 plan=[dp4tp1] mb=2 remat=1 zero=1"])
def test_a_single_stage_sums_its_micro_batch_gradients_array_by_array(child, plan):
    """A single stage of several micro-batches sums each weight's gradient as its own array
    and packs the sum once: summed into the packed buffer slot by slot (program revisions
    6-8), XLA on a GPU rewrote the whole buffer for each slot (gpt-1.3b on one H200, two
    micro-batches: 1.86 s a step, 0.29 s with revision 9)."""
    assert child.apply(_slot_writes_in_micro_batch_loop, (plan,)) == 0


def test_the_pipeline_step_closes_over_no_array(child):
    """An idle tick's zero rows are made inside the step: held as constants of the program
    they cost a residual row of memory for good (program revision 5)."""
    out = child.apply(_closed_over_arrays, ("cell=a100x2:s2 plan=[dp1tp1|dp1tp1] mb=4 remat=0",))
    assert out["rows"] and max(out["rows"]) > 1000
    assert out["closed_over"] == []


@pytest.mark.parametrize("plan,in_pieces", [("cell=a100x1:s1 plan=[dp1tp1] mb=2 remat=1", True),
                                             ("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", True),
                                             ("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=1", True),
                                             ("cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=4 remat=1", True),
                                             ("cell=a100x2:s2 plan=[dp1tp1|dp1tp1] mb=4 remat=1", False),
                                             ("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=2", False)])
def test_the_flat_update_steps_in_pieces_where_it_saves_memory(child, plan, in_pieces):
    """AdamW's flat update steps in pieces (a barrier each) on one stage and on a pipeline
    whose update is one program, saving a copy of the whole optimizer state (gpt-1.3b on
    4 GPUs compiled for an H100: 34.1 → 25.6 GB, program revision 7); inside a stage's
    switch branch and under ZeRO-2, where pieces compiled larger, it steps whole."""
    barriers = child.apply(_update_barriers, (1000, plan))
    assert (barriers >= 8) if in_pieces else (barriers == 0), barriers


def test_a_measurement_describes_the_program_until_a_revision_changes_it():
    from job_scripts.pipeline import (PIPELINE_ONLY_REVISIONS, PROGRAM_REVISION, SINGLE_STAGE_ONLY_REVISIONS,
                                      WHOLE_GRADIENT_SUM_ONLY_REVISIONS, describes_current)

    assert describes_current(PROGRAM_REVISION, 1, 2) and describes_current(PROGRAM_REVISION, 4, 4)
    for stages, mb, other in ((1, 2, PIPELINE_ONLY_REVISIONS), (4, 4, SINGLE_STAGE_ONLY_REVISIONS),
                              (1, 1, PIPELINE_ONLY_REVISIONS | WHOLE_GRADIENT_SUM_ONLY_REVISIONS)):
        # A plan's program is the same since the last revision that changed plans like it.
        last = max(r for r in range(2, PROGRAM_REVISION + 1) if r not in other)
        assert describes_current(last, stages, mb) and not describes_current(last - 1, stages, mb)
    # The latest changed single stages summing whole gradients over several micro-batches:
    # not pipelines, one micro-batch's program, nor ZeRO-2's or 3's split sums.
    assert not describes_current(PROGRAM_REVISION - 1, 1, 2)
    assert describes_current(PROGRAM_REVISION - 1, 2, 4) and describes_current(PROGRAM_REVISION - 1, 1, 1)
    assert describes_current(PROGRAM_REVISION - 1, 1, 4, split_gradients=True)


def _every_tuner_plan(num_gpus: int) -> dict:
    """Every feasible plan the exhaustive tuner scores for the tiny GPT's Cells (a superset
    of what ``estimate`` and ``tune`` emit), checked; a few run."""
    import random

    import jax

    from estimator import jax_models as jm
    from estimator.cells import Cell
    from estimator.cluster import load_cluster
    from estimator.errors import SpecError
    from estimator.estimate import stage_counts
    from estimator.jax_optim import optimizer_for
    from estimator.jobs import JobSpec
    from estimator.models import load_model
    from estimator.tuner import TuneOptions, tune
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    spec = load_model(TINY_GPT)
    arch = jm.arch_from_model(spec)
    plans, refused = [], []
    for stages in stage_counts(num_gpus, spec.num_layers):
        result = tune(JobSpec(TINY_GPT, 16), Cell("a100", num_gpus, num_gpus, stages), load_cluster("crius-1280"),
                      TuneOptions(prune="none"))
        for p in result.ranked:
            if not p.score.feasible:  # scored, never emitted
                continue
            text = result.plan_string(p)
            try:
                plans.append(plan_from_string(text, spec, arch, 16, num_gpus)[0])
            except SpecError as e:
                refused.append(f"{text}: {e}")
    losses = []
    batch = stream_for(arch, 0, 16).batch(1)
    for plan in random.Random(7).sample(plans, 4):
        pipe = Pipeline(arch, plan, jax.devices()[:num_gpus], 16, optimizer_for(arch.optimizer))
        losses.append(float(pipe.step(pipe.init(0), batch.inputs, batch.targets)[1]))
    return {"plans": len(plans), "refused": refused, "losses": losses}


def test_every_plan_the_tuner_can_emit_for_a_cell_runs(child):
    out = child.apply(_every_tuner_plan, (4,))
    assert out["plans"] > 50
    assert out["refused"] == []
    # Four of them, picked at random, take a step from the same weights: the same loss.
    assert out["losses"] == pytest.approx([out["losses"][0]] * 4, rel=1e-5)


def _residual_rows(model: str, global_batch: int, plan_text: str) -> list[int]:
    """Bytes of one residual row of each stage, as the runner lays them out (traced, not
    compiled)."""
    import jax
    import numpy as np

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    spec, n = load_model(model), parse_plan(plan_text).num_gpus
    arch = jm.arch_from_model(spec)
    plan = plan_from_string(plan_text, spec, arch, global_batch, n)[0]
    pipe = Pipeline(arch, plan, jax.devices()[:n], global_batch, optimizer_for(arch.optimizer))
    return [sum(int(count) * np.dtype(dt).itemsize for dt, count in r.layout.lengths) for r in pipe.residuals]


# Stage boundaries that put the embedding, a block (an MoE one first for moe) and the next
# one in stages of their own, the rest (with the head) in the last.
RESIDUAL_PLANS = [("gpt-760m", 1, "0,1,2,3,26"), ("gpt-760m", 2, "0,1,2,3,26"), ("moe-690m", 1, "0,1,2,3,10"),
                  ("moe-690m", 2, "0,1,2,3,10"), ("wide_resnet-500m", 1, "0,1,2,3,18")]


@pytest.mark.parametrize("model,tp,bounds", RESIDUAL_PLANS)
@pytest.mark.parametrize("remat", [0, 1])
def test_the_memory_model_counts_the_residual_rows_the_runner_keeps(model, tp, bounds, remat):
    """A pipeline keeps one row per micro-batch in flight; the memory model's row (the vjp's
    residuals and the cast weights without remat, each layer's input with it) matches the
    runner's own layout stage by stage, for transformer, MoE and Wide-ResNet layers under
    tp. Before the model counted them, pipelines without remat were estimated at half the
    memory their compiled program holds."""
    from estimator.memory import pipeline_row_bytes, remat_row_bytes
    from estimator.models import DTYPE_BYTES, load_model

    spec = load_model(model)
    text = f"cell=h100x{4 * tp}:s4 plan=[{'|'.join([f'dp1tp{tp}'] * 4)}] mb=4 remat={remat} layers={bounds}"
    # A fresh process each: building a real model's pipeline allocates its zero rows (11 GB
    # for gpt-760m without remat), which the shared child would pile up.
    rows = in_jax_child(8, _residual_rows, model, 8, text)  # 2 samples per micro-batch
    edges = [int(b) for b in bounds.split(",")]
    for s, got in enumerate(rows):
        layers = spec.layers[edges[s]:edges[s + 1]]
        if remat:
            want = 2 * remat_row_bytes(layers)
        else:
            want = pipeline_row_bytes(layers, 1, tp, 2, DTYPE_BYTES[spec.dtype], False)
        # Without remat the embedding's own residuals (its layer norm's; more under tp,
        # whose vocabulary-parallel lookup the model does not itemise) are small beside a
        # block's: every other stage within 5 %.
        if remat or s > 0:
            assert want == pytest.approx(got, rel=0.05), (s, got, want)
