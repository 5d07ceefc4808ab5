"""Tuning inside the allocation: measured candidates, the budget, the cache, a stop request.

Runs in a spawn child with 4 CPU devices; the tiny GPT's plans compile in seconds. The
decision is checked against the measurements themselves (the fastest measured plan is
chosen), never against the analytic model.
"""

import json
from pathlib import Path

import pytest

from conftest import in_jax_child
from estimator.contract import ADMIN_COMMENT_PLAN

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = str(ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml")
START = "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=2 remat=1"


def _tune(cache_dir: str) -> dict:
    import jax

    from estimator import jax_models as jm
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.run_config import TuneConfig
    from job_scripts.tuning import TuneRequest, tune_plan

    spec = load_model(TINY_GPT)
    arch = jm.arch_from_model(spec)

    def request(remaining: int, batch: int = 16, start: str | None = START):
        return TuneRequest(TINY_GPT, spec, arch, batch, "a100", 4, jax.devices()[:4], 2, start, remaining, "cpu")

    out = {}
    roomy = TuneConfig(True, budget_s=600, budget_frac=1.0, cache_dir=Path(cache_dir))
    first = tune_plan(request(10**6), roomy, agree=lambda x: x, stop=lambda: False, writer=True)
    out["first"] = {"plan": first.plan, "source": first.source, "seconds": first.iteration_time_s,
                    "measured": [(m.plan, m.iteration_time_s) for m in first.measured]}
    out["cells"] = sorted({parse_plan(p).cell_label for p, _ in out["first"]["measured"]})
    out["micro_batches"] = sorted({parse_plan(p).micro_batches for p, _ in out["first"]["measured"]})
    again = tune_plan(request(10**6), roomy, agree=lambda x: x, stop=lambda: False, writer=True)
    out["again"] = {"plan": again.plan, "source": again.source, "measured": len(again.measured)}
    other_batch = tune_plan(request(10**6, batch=32), TuneConfig(True, 600, 1.0, Path(cache_dir)),
                            agree=lambda x: x, stop=lambda: True, writer=False)
    out["other_batch"] = {"source": other_batch.source, "measured": len(other_batch.measured)}
    # Two steps left: 5 % of their run time is far less than measuring one more candidate.
    short = tune_plan(request(2), TuneConfig(True, 600, 0.05, None), agree=lambda x: x,
                      stop=lambda: False, writer=False)
    out["short"] = {"plan": short.plan, "source": short.source, "measured": len(short.measured)}
    return out


def test_tuning_measures_from_the_daemons_plan_keeps_the_fastest_and_caches_it(tmp_path):
    out = in_jax_child(4, _tune, str(tmp_path))
    first = out["first"]
    measured = dict(first["measured"])
    plans = [p for p, _ in first["measured"]]
    assert plans[0] == START and len(plans) == len(set(plans)) >= 4
    assert out["cells"] == ["a100x4:s2"]  # the Cell stays; only the plan inside it is tuned
    assert len(out["micro_batches"]) >= 2  # micro-batch counts were searched by measurement
    assert first["plan"] == min(measured, key=measured.get) and first["seconds"] == measured[first["plan"]]
    assert first["source"] == "tuned"
    # The same model, batch and Cell again: the cached plan, nothing measured.
    assert out["again"] == {"plan": first["plan"], "source": "cached", "measured": 0}
    assert len(list(tmp_path.glob("*.json"))) == 1
    # Another global batch is another key; a stop request leaves the start plan unmeasured.
    assert out["other_batch"] == {"source": ADMIN_COMMENT_PLAN, "measured": 0}
    assert out["short"] == {"plan": START, "source": ADMIN_COMMENT_PLAN, "measured": 1}


def test_a_tuning_budget_below_zero_is_refused():
    from estimator.errors import SpecError
    from job_scripts.run_config import resolve_config
    from job_scripts.slurm_env import SlurmAllocation

    alloc = SlurmAllocation(None, (), 0, None, None, 0)
    with pytest.raises(SpecError, match="SLURM_EXT_TUNE_BUDGET_FRAC"):
        resolve_config({"global_batch": 8}, {"SLURM_EXT_TUNE_BUDGET_FRAC": "-1"}, alloc, {}, False)


class _Device:
    device_kind = "cpu"


def _request(start: str | None):
    from estimator import jax_models as jm
    from estimator.models import load_model
    from job_scripts.tuning import TuneRequest

    spec = load_model(TINY_GPT)
    return TuneRequest(TINY_GPT, spec, jm.arch_from_model(spec), 16, "a100", 4, [_Device()] * 4, 2, start,
                       10**6, "cpu")


@pytest.mark.parametrize("start", [START, None])
def test_a_stop_requested_before_tuning_measures_nothing(monkeypatch, start):
    from job_scripts import tuning
    from job_scripts.run_config import TuneConfig

    measured = []

    def measure(req, text, agree):
        measured.append(text)
        return tuning.Measured(text, 0.1, 1.0)

    monkeypatch.setattr(tuning, "measure_plan", measure)
    tuned = tuning.tune_plan(_request(start), TuneConfig(True, 600, 1.0, None), agree=lambda x: x,
                             stop=lambda: True, writer=False)
    assert measured == []  # no compile while the daemon waits for the checkpoint
    if start:
        assert (tuned.plan, tuned.source, tuned.measured) == (START, ADMIN_COMMENT_PLAN, ())
    else:
        # Nothing measured: not "tuned".
        assert tuned.plan == tuning.best_estimated(_request(None)) and tuned.source == "estimated"


def test_the_budget_holds_when_a_candidate_fails_and_nothing_is_measured_without_one(monkeypatch):
    """The share of the job's remaining time is taken at the first plan that ran, not only
    when the first one measured ran; no budget, or no iteration left, measures nothing."""
    from dataclasses import replace

    from job_scripts import tuning
    from job_scripts.run_config import TuneConfig

    measured = []

    def measure(req, text, agree):
        measured.append(text)
        ok = len(measured) > 1  # the daemon's plan runs out of memory; the others run
        return tuning.Measured(text, 0.1 if ok else None, 1.0, None if ok else "out of device memory")

    monkeypatch.setattr(tuning, "measure_plan", measure)
    two_left = replace(_request(START), remaining_iterations=2)  # 0.05 × 2 × 0.1 s: one more at most
    tuning.tune_plan(two_left, TuneConfig(True, 600, 0.05, None), agree=lambda x: x, stop=lambda: False,
                     writer=False)
    assert len(measured) == 2
    for req, budget_s in ((_request(START), 0.0), (replace(_request(START), remaining_iterations=0), 600.0)):
        measured.clear()
        tuned = tuning.tune_plan(req, TuneConfig(True, budget_s, 1.0, None), agree=lambda x: x, stop=lambda: False,
                                 writer=False)
        assert measured == [] and (tuned.plan, tuned.source) == (START, ADMIN_COMMENT_PLAN)


def test_the_tuned_plans_cache_keeps_the_zero_level_and_expert_parallelism_apart():
    from job_scripts.tuning import cache_key

    keys = [cache_key(_request(p)) for p in (START, START + " zero=2", START.replace("dp2tp1|", "dp2tp1ep|"))]
    assert [(k["zero_level"], k["expert_parallel"]) for k in keys] == [(0, False), (2, False), (0, True)]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3


def test_a_search_cut_short_by_a_stop_is_not_cached(monkeypatch, tmp_path):
    from job_scripts import tuning
    from job_scripts.run_config import TuneConfig

    measured = []

    def measure(req, text, agree):
        measured.append(text)
        return tuning.Measured(text, 0.1 * len(measured), 1.0)

    monkeypatch.setattr(tuning, "measure_plan", measure)
    monkeypatch.setattr(tuning, "cache_key", lambda req: {"key": "k"})  # no device kind to read
    for stop_after, files in ((2, 0), (None, 1)):
        measured.clear()
        tuned = tuning.tune_plan(_request(START), TuneConfig(True, 600, 1.0, tmp_path), agree=lambda x: x,
                                 stop=lambda: stop_after is not None and len(measured) >= stop_after, writer=True)
        assert tuned.plan == START and len(measured) == (2 if stop_after else len(tuned.measured)) > 1
        assert len(list(tmp_path.glob("*.json"))) == files  # only the whole search is kept


@pytest.mark.parametrize("env, given, key", [
    ({"SLURM_EXT_TUNE_BUDGET_S": "nan"}, {}, "SLURM_EXT_TUNE_BUDGET_S"),
    ({"SLURM_EXT_TUNE_BUDGET_FRAC": "nan"}, {}, "SLURM_EXT_TUNE_BUDGET_FRAC"),
    ({"SLURM_EXT_TUNE": "maybe"}, {}, "SLURM_EXT_TUNE"),
    ({}, {"warmup_steps": -5}, "warmup_steps"),
])
def test_a_malformed_tuning_or_warm_up_setting_is_refused_not_taken(env, given, key):
    """NaN budgets (tuning stopped after one plan, or the fraction ignored), an unknown word
    for on/off (tuning turned on) and a negative warm-up (read as 0) were all taken."""
    from estimator.errors import SpecError
    from job_scripts.run_config import resolve_config
    from job_scripts.slurm_env import SlurmAllocation

    alloc = SlurmAllocation(None, (), 0, None, None, 0)
    with pytest.raises(SpecError, match=key):
        resolve_config({"global_batch": 8, **given}, env, alloc, {}, False)


@pytest.mark.parametrize("word, enabled", [("off", False), ("No", False), ("yes", True), (" 1 ", True)])
def test_tuning_is_turned_on_and_off_by_the_words_for_it(word, enabled):
    from job_scripts.run_config import resolve_config
    from job_scripts.slurm_env import SlurmAllocation

    alloc = SlurmAllocation(None, (), 0, None, None, 0)
    assert resolve_config({"global_batch": 8}, {"SLURM_EXT_TUNE": word}, alloc, {}, False).tune.enabled is enabled


def _choose_from_a_plan_that_cannot_run_here(ckpt: str, plan: str, devices: int, model: str = TINY_GPT) -> str:
    """The runner's choice (``run.choose_plan``) when the AdminComment's plan cannot run on
    these devices (a micro-batch count that does not divide the batch; another GPU count)."""
    from estimator import jax_models as jm
    from estimator.models import load_model
    from job_scripts import run, runtime
    job = runtime.start(model=model, global_batch=16, iterations=10, devices=devices, platform="cpu",
                        checkpoint_dir=ckpt, compile_cache="", tune=True, tune_budget_s=0.0, env={},
                        stop=runtime.StopSignal())
    job.plan_text, job.plan_source = plan, ADMIN_COMMENT_PLAN
    spec = load_model(model)
    return run.choose_plan(job, spec, jm.arch_from_model(spec), 10).plan


def test_tuning_from_a_plan_that_cannot_run_here_keeps_its_zero_level_and_not_its_stages(tmp_path):
    """The daemon chose ZeRO-1 (replicated states did not fit): the search dropped it. A
    stale 4-stage plan on 2 devices limited the search to 4 stages: no plan, exit 2."""
    zero = in_jax_child(4, _choose_from_a_plan_that_cannot_run_here, str(tmp_path / "a"),
                        "cell=a100x4:s1 plan=[dp4tp1] mb=3 remat=1 zero=1", 4)
    assert zero.endswith("zero=1"), zero
    stale = in_jax_child(2, _choose_from_a_plan_that_cannot_run_here, str(tmp_path / "b"),
                         "cell=a100x4:s4 plan=[dp1tp1|dp1tp1|dp1tp1|dp1tp1] mb=4 remat=1", 2)
    assert stale.startswith("cell=a100x2:"), stale
    # Refused for its ZeRO level itself (Adafactor keeps factored states whole): not kept.
    adafactor = tmp_path / "tiny-adafactor.yaml"
    adafactor.write_text(Path(TINY_GPT).read_text().replace("optimizer: adamw", "optimizer: adafactor"))
    plain = in_jax_child(4, _choose_from_a_plan_that_cannot_run_here, str(tmp_path / "c"),
                         "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=1", 4, str(adafactor))
    assert plain.startswith("cell=a100x4:") and "zero=" not in plain, plain


def _measure_out_of_memory() -> dict:
    """Measure the start plan; then, with the process's address space capped 1 GiB above
    what it uses, the same plan at a global batch whose step needs several GiB (XLA's
    allocation fails: a real out-of-memory); then the first again, uncapped."""
    import resource

    import jax

    from estimator import jax_models as jm
    from estimator.models import load_model
    from job_scripts.tuning import TuneRequest, measure_plan

    spec = load_model(TINY_GPT)
    arch = jm.arch_from_model(spec)

    def measure(batch: int):
        req = TuneRequest(TINY_GPT, spec, arch, batch, "a100", 4, jax.devices()[:4], 2, START, 10**6, "cpu")
        m = measure_plan(req, START, lambda x: x)
        return {"seconds": m.iteration_time_s, "error": m.error}

    out = {"before": measure(16)}
    used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    unlimited = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), unlimited[1]))
    try:
        out["huge"] = measure(1 << 16)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, unlimited)
    out["live_bytes"] = sum(a.nbytes for a in jax.live_arrays())  # the failed candidate's freed
    out["after"] = measure(16)
    return out


def test_a_candidate_out_of_device_memory_fails_alone_and_the_search_goes_on():
    import multiprocessing

    from estimator.compiled import _worker_init, child_xla_flags

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, initializer=_worker_init, initargs=(child_xla_flags(4),)) as pool:
        # A child killed by the allocation (not an error) would leave apply waiting for ever.
        out = pool.apply_async(_measure_out_of_memory).get(timeout=600)
    assert out["before"]["error"] is None and out["before"]["seconds"] > 0
    assert out["huge"]["seconds"] is None
    assert out["huge"]["error"].startswith("out of device memory: "), out["huge"]
    assert "out of memory" in out["huge"]["error"].lower(), out["huge"]
    assert out["live_bytes"] < 64 << 20, out["live_bytes"]
    assert out["after"]["error"] is None and out["after"]["seconds"] > 0  # JAX still runs plans


class _TwoProcesses:
    """Two threads standing in for a job's two processes: ``agree(rank)`` is the runner's
    ``agree_max`` of that process, their maximum exchanged at a barrier as the runner's
    allgather does."""

    def __init__(self):
        import threading
        self.barrier, self.values = threading.Barrier(2, timeout=30), [0.0, 0.0]

    def agree(self, rank: int):
        def agree(value: float) -> float:
            self.values[rank] = value
            self.barrier.wait()
            top = max(self.values)
            self.barrier.wait()  # both read before either writes again
            return top
        return agree


def test_processes_that_read_different_tuned_plans_all_tune(monkeypatch, tmp_path):
    """Another job's tuning lands in the cache between two processes' reads: one found a
    plan, the other none. Each acting on its own read, one trained while the other
    measured, each waiting in collectives the other never ran."""
    from concurrent.futures import ThreadPoolExecutor

    from estimator.plan_string import parse_plan
    from job_scripts import tuning
    from job_scripts.run_config import TuneConfig

    req = _request(START)
    seen, empty = tmp_path / "seen", tmp_path / "empty"
    seen.mkdir(), empty.mkdir()
    key = {"key": "k"}
    tuning.write_json_atomic(tuning._cache_path(seen, key), {"plan": START, "iteration_time_s": 0.5})

    def measure(req, text, agree):  # every candidate "runs", the fewer micro-batches the faster
        return tuning.Measured(text, 0.01 * parse_plan(text).micro_batches, 0.1)

    def both(dirs):
        group = _TwoProcesses()
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(tuning.tune_plan, req, TuneConfig(True, 600, 1.0, d), group.agree(rank),
                                lambda: False, False) for rank, d in enumerate(dirs)]
            return [(t.source, t.plan) for t in (f.result() for f in runs)]

    monkeypatch.setattr(tuning, "cache_key", lambda req: key)  # no device kind to read
    monkeypatch.setattr(tuning, "measure_plan", measure)
    assert both([seen, seen]) == [("cached", START)] * 2
    for dirs in ([seen, empty], [empty, empty]):  # every process measures, and all agree
        (first, second) = both(dirs)
        assert first == second and first[0] == "tuned", (first, second)


def test_a_search_its_budget_cut_is_searched_again_by_a_run_with_more_time(monkeypatch, tmp_path):
    from dataclasses import replace

    from job_scripts import tuning
    from job_scripts.run_config import TuneConfig

    import time
    from types import SimpleNamespace

    measured, clock_s = [], [0.0]

    def measure(req, text, agree):
        measured.append(text)
        clock_s[0] += 1.0
        return tuning.Measured(text, 0.1, 1.0)

    monkeypatch.setattr(tuning, "measure_plan", measure)
    monkeypatch.setattr(tuning, "cache_key", lambda req: {"key": "k"})  # no device kind to read
    # Each measurement takes one second of the tuning's clock, the rest none.
    monkeypatch.setattr(tuning, "time", SimpleNamespace(perf_counter=lambda: clock_s[0], time=time.time))
    cfg = TuneConfig(True, 600, 0.5, tmp_path)

    def tune(remaining_iterations):
        measured.clear()
        tuned = tuning.tune_plan(replace(_request(START), remaining_iterations=remaining_iterations), cfg,
                                 agree=lambda x: x, stop=lambda: False, writer=True)
        return tuned.source, len(measured)

    # 0.5 × 40 × 0.1 s = 2 s: two candidates of 1 s each, a search cut short.
    source, count = tune(40)
    assert (source, count) == ("tuned", 2)
    assert tune(40) == ("cached", 0)  # this run could not search longer
    source, count = tune(10**6)  # this one may take 600 s: it searches the whole space
    assert source == "tuned" and count > 2
    assert tune(10**6) == ("cached", 0) and tune(40) == ("cached", 0)
