"""Training plans measured on this machine's devices, against the analytic estimate.

Each plan (``--plans``, or ``--auto``: the single-stage plans of the local devices) runs
in a fresh child process, so its peak memory is its own and a plan that runs out of
memory or hangs (``--plan-timeout-s``) costs only its own row. The child builds the
runner's SPMD program (``job_scripts.pipeline.Pipeline``) on the first devices the plan
needs, trains warm-up steps (the first compiles) and ``--steps`` timed steps on
synthetic data, each step waited for, and reports the step times, the devices'
``peak_bytes_in_use`` (accelerators only), the compiled step's ``memory_analysis()``
and whether the loss stayed finite. The parent scores the same stages, micro-batches
and remat with ``estimator.estimate.score_plan`` on a one-node allocation of
``--gpu-type`` (as ``job_scripts.tuning.PlanSpace`` does inside a job) and prints per
plan the measured and estimated seconds per step and peak GB per device, their ratios
and accuracies (1 − |est − meas| / meas, floored at 0), a summary and the environment,
as JSON (``benchmarks.bench_output.emit``). Progress, one line per plan with its wall
time, goes to stderr.

The estimate's peak includes its fixed reserve (CUDA context, workspace:
``estimate.reserve_gb``), which ``peak_bytes_in_use`` does not see. Children on a GPU
may take ``MemoryOptions().usable_frac`` of its memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``
unless set), the share the estimator assumes.

On one H200 (jax 0.11.2), a gpt-760m or gpt-1.3b plan took 95-105 s of wall time: ~5 s
to start JAX, ~45 s to compile the initialisation and ~45-50 s to compile the step.
``--init zeros`` skips the initialisation's compile (all-zero buffers: the step's time
and memory are the same, its loss is not); ``--budget-s`` bounds a whole run.

Usage (one GPU)::

    PYTHONPATH=. python3 benchmarks/plan_measure.py --model gpt-760m --global-batch 8 --auto \
        --micro-batches 1 2 --max-plans 2 --budget-s 300 --json /tmp/plan_measure_gpt-760m.json

CPU fake devices (tests)::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. python \
        benchmarks/plan_measure.py --model tests/fixtures/runner/tiny-gpt.yaml --global-batch 16 \
        --plans "cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=4 remat=1" --steps 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

log = logging.getLogger("plan_measure")

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
GB = 1e9  # the estimator's GB
MICRO_BATCH_CHOICES = (1, 2, 4)
STDERR_TAIL_LINES = 6
PROBE = "probe"  # the child's plan argument that only reports the environment


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Environment:
    """What the child saw: JAX, its backend and devices."""

    jax_version: str
    backend: str
    device_kind: str
    device_count: int


@dataclass(frozen=True)
class Measurement:
    """One plan measured in a child process (the JSON it hands back).

    Times in seconds; ``step_s`` the timed steps in order. Memory: the largest
    ``peak_bytes_in_use`` over the plan's devices (None where the backend has none, e.g.
    CPU) and the compiled step's ``memory_analysis()`` fields (None when unavailable).
    """

    plan: str
    environment: Environment | None = None
    build_s: float | None = None  # the Pipeline built (traced shapes, no compile)
    init_s: float | None = None  # weights and optimizer state initialised, compile included
    first_step_s: float | None = None  # the first step, its compilation included
    step_s: tuple[float, ...] = ()
    peak_bytes_in_use: int | None = None
    bytes_limit: int | None = None
    compiled_memory: dict | None = None
    memory_analysis_s: float | None = None
    loss: float | None = None  # the last step's, when finite
    loss_finite: bool | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(raw: dict) -> "Measurement":
        known = {f.name for f in fields(Measurement)}
        raw = {k: v for k, v in raw.items() if k in known}
        env = raw.get("environment")
        raw["environment"] = Environment(**env) if env else None
        raw["step_s"] = tuple(raw.get("step_s") or ())
        return Measurement(**raw)


@dataclass(frozen=True)
class MeasureRequest:
    """What a child measures."""

    model: str
    global_batch: int
    plan: str
    warmup_steps: int
    steps: int
    memory_analysis: bool
    init: str = "random"  # random: the runner's initialisation; zeros: every buffer zero
    compile_cache_dir: str | None = None  # XLA's persistent cache, this plan's alone


# --------------------------------------------------------------------------- pure helpers


def gpu_type_for(backend: str, device_kind: str) -> tuple[str, str | None]:
    """The catalog GPU type of a device kind ('NVIDIA H100 80GB HBM3' → h100), and a note
    when it is a stand-in (CPU, or a kind the catalog does not name)."""
    from estimator.gpus import CATALOG
    kind = device_kind.lower()
    if backend == "cpu":
        return "a100", f"backend is cpu ({device_kind}): estimates are for a100, not this machine"
    # Longest names first, whole words only: 'a10' must not match 'A100-SXM4-40GB'.
    for name in sorted(CATALOG, key=len, reverse=True):
        if re.search(rf"(?<![a-z0-9]){re.escape(name)}(?![0-9])", kind):
            return name, None
    return "a100", f"device kind {device_kind!r} is not in the GPU catalog: estimates are for a100 (give --gpu-type)"


def _spread(items: list, count: int) -> list:
    """``count`` items spread evenly over ``items`` (first and last included)."""
    if len(items) <= count:
        return items
    if count <= 1:
        return items[:count]
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def auto_plans(num_devices: int, global_batch: int, gpu_type: str, max_plans: int,
               micro_batches: tuple[int, ...] = MICRO_BATCH_CHOICES) -> list[str]:
    """Single-stage plans of ``num_devices`` devices: every dp × tp, the micro-batch
    counts whose micro-batch splits over dp, remat on and off; at most ``max_plans`` of
    them, spread evenly over that list."""
    structures = [(num_devices // tp, tp) for tp in (2 ** k for k in range(num_devices.bit_length()))
                  if num_devices % tp == 0]
    plans = [f"cell={gpu_type}x{num_devices}:s1 plan=[dp{dp}tp{tp}] mb={mb} remat={remat}"
             for (dp, tp), mb, remat in itertools.product(structures, micro_batches, (1, 0))
             if global_batch % mb == 0 and (global_batch // mb) % dp == 0]
    return _spread(plans, max_plans)


def accuracy(estimate: float | None, measured: float | None) -> float | None:
    """1 − relative error of ``estimate`` against ``measured``, floored at 0 (as
    ``benchmarks/estimator_accuracy.py``); None when either is missing."""
    if estimate is None or measured is None or measured <= 0 or not math.isfinite(estimate):
        return None
    return max(0.0, 1.0 - abs(estimate - measured) / measured)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or not math.isfinite(a):
        return None
    return a / b


def _rounded(v: float | None, digits: int = 6) -> float | None:
    return None if v is None else round(v, digits)


def summarize(values: list[float | None]) -> dict:
    """Median, mean and worst of the values present."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"plans": 0, "median": None, "mean": None, "worst": None}
    return {"plans": len(vals), "median": round(statistics.median(vals), 4),
            "mean": round(statistics.fmean(vals), 4), "worst": round(min(vals), 4)}


def summarize_ratios(values: list[float | None]) -> dict:
    """Median, geometric mean and range of the ratios present (1 is exact)."""
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return {"plans": 0, "median": None, "geomean": None, "min": None, "max": None}
    return {"plans": len(vals), "median": round(statistics.median(vals), 4),
            "geomean": round(statistics.geometric_mean(vals), 4), "min": round(min(vals), 4),
            "max": round(max(vals), 4)}


def _one_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"


# --------------------------------------------------------------------------- the estimate


def runner_plan(model: str, global_batch: int, text: str):
    """The ``ParallelPlan`` the runner makes of ``text`` (layer ranges as it splits them),
    on as many devices as the plan names.

    Raises:
        SpecError: a plan the runner refuses (malformed, or not runnable on the model and batch).
    """
    from estimator import jax_models as jm
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.plan import plan_from_string

    spec = load_model(model)
    return plan_from_string(text, spec, jm.arch_from_model(spec), global_batch, parse_plan(text).num_gpus)[0]


def estimate_plan(model: str, global_batch: int, gpu_type: str, plan) -> dict:
    """The analytic score of ``plan`` (a ``ParallelPlan``) on a one-node allocation of
    ``gpu_type``, built as ``job_scripts.tuning.PlanSpace`` builds a job's allocation."""
    from estimator.cells import Cell
    from estimator.cluster import cluster_from_dict
    from estimator.errors import SpecError
    from estimator.estimate import EstimateOptions, score_plan
    from estimator.jobs import JobSpec
    from estimator.memory import MemoryOptions

    n = plan.num_gpus
    options = EstimateOptions(memory=MemoryOptions(zero_level=plan.zero_level))
    cell = Cell(gpu_type, n, n, plan.num_stages)
    try:
        cluster = cluster_from_dict({"name": "allocation", "node_groups": [
            {"gpu_type": gpu_type, "nodes": 1, "gpus_per_node": n}]})
        score = score_plan(JobSpec(model, global_batch, n, gpu_type), cell, cluster, plan.stages,
                           plan.micro_batches, plan.remat, options)
    except SpecError as e:
        return {"error": str(e)}
    return {"cell": cell.label(), "iteration_time_s": _rounded(score.iteration_time_s),
            "peak_memory_gb": _rounded(score.peak_memory_gb, 4), "feasible": score.feasible,
            "reason": score.reason, "stage_micro_batch_s": [_rounded(t) for t in score.stage_times_s],
            "comm_source": score.comm_source, "reserve_gb": MemoryOptions().reserve_gb}


# --------------------------------------------------------------------------- the child


def _environment() -> Environment:
    import jax
    devices = jax.devices()
    return Environment(jax.__version__, jax.default_backend(), devices[0].device_kind, len(devices))


def _peak_bytes(devices) -> tuple[int | None, int | None]:
    """Largest ``peak_bytes_in_use`` and ``bytes_limit`` over ``devices`` (None: not kept)."""
    peaks, limits = [], []
    for d in devices:
        try:
            stats = d.memory_stats()
        except (AttributeError, NotImplementedError, RuntimeError):
            stats = None
        if stats:
            peaks.append(stats.get("peak_bytes_in_use"))
            limits.append(stats.get("bytes_limit"))
    peaks, limits = [p for p in peaks if p is not None], [v for v in limits if v is not None]
    return (max(peaks) if peaks else None), (max(limits) if limits else None)


def _compiled_memory(pipe) -> dict | None:
    """The compiled step's memory analysis (bytes per device), None when XLA gives none."""
    mem = pipe.compile().memory_analysis()
    if mem is None:
        return None
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
             "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
    out = {n: int(getattr(mem, n)) for n in names if getattr(mem, n, None) is not None}
    # Donated inputs alias outputs: count them once.
    out["total_bytes"] = (out.get("argument_size_in_bytes", 0) + out.get("output_size_in_bytes", 0)
                          - out.get("alias_size_in_bytes", 0) + out.get("temp_size_in_bytes", 0))
    out["peak_bytes"] = out.get("peak_memory_in_bytes") or out["total_bytes"]
    return out


def _zero_state(pipe) -> dict:
    """Every buffer of ``pipe``'s training state zero, laid out as ``pipe.init`` lays it
    out: the step's time and memory are the same, and the initialisation is not compiled
    (on a GPU that takes about as long as compiling the step)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    shapes = jax.eval_shape(pipe.init, 0)
    sharding = NamedSharding(pipe.mesh, pipe.container_spec)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                   out_shardings=jax.tree.map(lambda _: sharding, shapes))()


def measure(req: MeasureRequest) -> Measurement:
    """Build, compile and time one plan on the first devices it needs (in this process)."""
    import jax

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string
    from job_scripts.precision import TIMING_LOSS_SCALE, training_arch

    if req.compile_cache_dir:
        # memory_analysis() compiles the step again; where XLA's in-memory cache does not
        # serve it, this plan's own disk cache does (the cost of one more compile otherwise).
        jax.config.update("jax_compilation_cache_dir", req.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    env = _environment()
    got: dict = {"environment": env}
    try:
        n = parse_plan(req.plan).num_gpus
        if n > env.device_count:
            raise ValueError(f"the plan needs {n} devices, this machine has {env.device_count}")
        devices = jax.devices()[:n]
        spec = load_model(req.model)
        # The dtype the runner trains in on the plan's GPU (an fp16 model in bf16 on Ampere and later).
        arch = training_arch(jm.arch_from_model(spec), parse_plan(req.plan).gpu_type)
        plan = plan_from_string(req.plan, spec, arch, req.global_batch, n)[0]
        batch = stream_for(arch, 0, req.global_batch).batch(1)
        t0 = time.perf_counter()
        pipe = Pipeline(arch, plan, devices, req.global_batch, optimizer_for(arch.optimizer))
        got["build_s"] = time.perf_counter() - t0
        pipe.set_loss_scale(TIMING_LOSS_SCALE)  # fp16: timed at scale 1, as tuning times it
        t0 = time.perf_counter()
        state = jax.block_until_ready(_zero_state(pipe) if req.init == "zeros" else pipe.init(0))
        got["init_s"] = time.perf_counter() - t0
        times, loss = [], None
        for i in range(req.warmup_steps + req.steps):
            t0 = time.perf_counter()
            state, loss = jax.block_until_ready(pipe.step(state, batch.inputs, batch.targets))
            if i == 0:
                got["first_step_s"] = time.perf_counter() - t0
            elif i >= req.warmup_steps:
                times.append(time.perf_counter() - t0)
        got["step_s"] = tuple(times)
        got["loss_finite"] = math.isfinite(float(loss))
        got["loss"] = float(loss) if got["loss_finite"] else None  # NaN is not JSON
        if env.backend != "cpu":  # the CPU client keeps no allocator statistics worth reading
            got["peak_bytes_in_use"], got["bytes_limit"] = _peak_bytes(devices)
        if req.memory_analysis:
            # After the peak is read: compiling may allocate (GPU autotuning).
            t0 = time.perf_counter()
            got["compiled_memory"] = _compiled_memory(pipe)
            got["memory_analysis_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - whatever fails (out of memory too) is this plan's result
        got["error"] = _one_line(e)
    return Measurement(req.plan, **got)


def child_main(req: MeasureRequest, out: Path) -> int:
    """Measure one plan (or only the environment) and write the JSON to ``out``."""
    result = Measurement(PROBE, _environment()) if req.plan == PROBE else measure(req)
    out.write_text(json.dumps(result.to_json()))
    return 0


# --------------------------------------------------------------------------- the parent


def run_child(req: MeasureRequest, timeout_s: float) -> Measurement:
    """Run ``req`` in a fresh Python process; its failures become the Measurement's error."""
    with tempfile.TemporaryDirectory(prefix="plan_measure-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, str(SCRIPT), "--child-out", str(out), "--model", req.model,
                "--global-batch", str(req.global_batch), "--plans", req.plan,
                "--warmup-steps", str(req.warmup_steps), "--steps", str(req.steps), "--init", req.init]
        if req.memory_analysis:
            argv += ["--compile-cache-dir", str(Path(tmp) / "xla-cache")]
        else:
            argv.append("--no-memory-analysis")
        env = dict(os.environ)
        # The child imports estimator/ and job_scripts/ from this checkout, not an install.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        from estimator.memory import MemoryOptions
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(MemoryOptions().usable_frac))
        log.debug("running %s", argv)
        try:
            proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, errors="replace", timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return Measurement(req.plan, error=f"timed out after {timeout_s:.0f} s (--plan-timeout-s, --budget-s)")
        try:
            return Measurement.from_json(json.loads(out.read_text()))
        except (OSError, ValueError, TypeError) as e:
            tail = " | ".join(proc.stderr.strip().splitlines()[-STDERR_TAIL_LINES:])
            return Measurement(req.plan, error=f"child exited {proc.returncode} without a result "
                                               f"({type(e).__name__}); stderr: {tail}")


def plan_row(m: Measurement, est: dict, wall_s: float) -> dict:
    """One plan's measured and estimated figures side by side."""
    ok = m.error is None and bool(m.step_s)
    median = statistics.median(m.step_s) if ok else None
    peak_gb = m.peak_bytes_in_use / GB if m.peak_bytes_in_use is not None else None
    compiled_gb = m.compiled_memory["peak_bytes"] / GB if m.compiled_memory else None
    est_t, est_mem = est.get("iteration_time_s"), est.get("peak_memory_gb")
    measured = None
    if m.environment is not None:
        measured = {
            "build_s": _rounded(m.build_s, 3), "init_s": _rounded(m.init_s, 3),
            "compile_first_step_s": _rounded(m.first_step_s, 3),
            "steps": len(m.step_s),
            "step_s": {"median": _rounded(median), "mean": _rounded(statistics.fmean(m.step_s)),
                       "worst": _rounded(max(m.step_s))} if ok else None,
            "peak_memory_gb": _rounded(peak_gb, 4), "bytes_limit_gb": _rounded(
                m.bytes_limit / GB if m.bytes_limit is not None else None, 3),
            "compiled_memory_gb": _rounded(compiled_gb, 4), "compiled_memory": m.compiled_memory,
            "memory_analysis_s": _rounded(m.memory_analysis_s, 3),
            "loss": _rounded(m.loss), "loss_finite": m.loss_finite,
        }
    return {
        "plan": m.plan, "ok": ok, "error": m.error, "wall_s": round(wall_s, 2),
        "measured": measured, "estimate": est,
        "time_ratio_est_over_measured": _rounded(_ratio(est_t, median), 4),
        "time_accuracy": _rounded(accuracy(est_t, median), 4),
        "memory_ratio_est_over_measured": _rounded(_ratio(est_mem, peak_gb), 4),
        "memory_accuracy": _rounded(accuracy(est_mem, peak_gb), 4),
        "memory_ratio_est_over_compiled": _rounded(_ratio(est_mem, compiled_gb), 4),
    }


def _progress(i: int, total: int, row: dict) -> str:
    head = f"[{i}/{total}] {row['plan']}:"
    if not row["ok"]:
        return f"{head} FAILED in {row['wall_s']:.1f} s wall: {row['error']}"
    meas, est = row["measured"], row["estimate"]
    peak = meas["peak_memory_gb"]
    mem = f"peak {peak:.2f} GB" if peak is not None else "peak n/a"
    analysis = "skipped" if meas["memory_analysis_s"] is None else f"{meas['memory_analysis_s']:.1f} s"
    return (f"{head} {meas['step_s']['median']:.4f} s/step median (est {est.get('iteration_time_s')}, "
            f"accuracy {row['time_accuracy']}), {mem} (est {est.get('peak_memory_gb')} GB); "
            f"wall {row['wall_s']:.1f} s: build {meas['build_s']:.1f} s, init {meas['init_s']:.1f} s, "
            f"compile+first step {meas['compile_first_step_s']:.1f} s, memory analysis {analysis}")


def report(args: argparse.Namespace, rows: list[dict], env: Environment | None, gpu_type: str | None,
           gpu_note: str | None, skipped: list[str], wall_s: float) -> dict:
    """The whole result: per-plan rows, their summary, the environment."""
    from job_scripts.pipeline import PROGRAM_REVISION
    ok = [r for r in rows if r["ok"]]
    return {
        "model": args.model, "global_batch": args.global_batch, "gpu_type": gpu_type, "gpu_type_note": gpu_note,
        "program_revision": PROGRAM_REVISION,
        "warmup_steps": args.warmup_steps, "steps_timed": args.steps, "init": args.init,
        "environment": {**asdict(env), "python": sys.version.split()[0]} if env else None,
        "plans": rows,
        "skipped_plans": skipped,
        "summary": {
            "plans": len(rows), "plans_ok": len(ok), "plans_failed": len(rows) - len(ok),
            "time_accuracy": summarize([r["time_accuracy"] for r in ok]),
            "memory_accuracy": summarize([r["memory_accuracy"] for r in ok]),
            "time_ratio_est_over_measured": summarize_ratios([r["time_ratio_est_over_measured"] for r in ok]),
            "memory_ratio_est_over_measured": summarize_ratios(
                [r["memory_ratio_est_over_measured"] for r in ok]),
        },
        "wall_s": {"total": round(wall_s, 2), "per_plan": [r["wall_s"] for r in rows]},
        "command": "python benchmarks/plan_measure.py " + " ".join(_quoted(a) for a in sys.argv[1:]),
    }


def run(args: argparse.Namespace) -> dict:
    """Measure and estimate every plan of ``args``, one child process each."""
    t_begin = time.perf_counter()
    import jax

    from estimator.errors import SpecError
    from estimator.models import load_model
    # This process only scores plans: should anything here touch a device, it must not
    # be the GPU the children measure on (the children's platform is not changed).
    jax.config.update("jax_platforms", "cpu")
    load_model(args.model)  # a clear error now for a model that does not exist

    env, gpu_type, gpu_note = None, args.gpu_type, None

    def learn(found: Environment | None) -> None:
        """Take the first environment a child reports; guess the GPU type from it."""
        nonlocal env, gpu_type, gpu_note
        env = env or found
        if gpu_type is None and env is not None:
            gpu_type, gpu_note = gpu_type_for(env.backend, env.device_kind)
            print(f"{env.device_count} {env.backend} device(s), {env.device_kind}: estimates for {gpu_type}"
                  + (f" ({gpu_note})" if gpu_note else ""), file=sys.stderr, flush=True)

    def left_s() -> float:
        return math.inf if args.budget_s is None else args.budget_s - (time.perf_counter() - t_begin)

    plans = list(args.plans or [])
    if args.auto:  # the plans depend on the device count: ask a child
        probe = run_child(MeasureRequest(args.model, args.global_batch, PROBE, 1, 1, False),
                          min(args.plan_timeout_s, left_s()))
        if probe.environment is None:
            raise SystemExit(f"cannot start JAX in a child process: {probe.error}")
        learn(probe.environment)
        for text in auto_plans(env.device_count, args.global_batch, gpu_type, args.max_plans,
                               tuple(args.micro_batches)):
            try:
                runner_plan(args.model, args.global_batch, text)
                plans.append(text)
            except SpecError:
                continue
    print(f"{len(plans)} plan(s) of {args.model}, global batch {args.global_batch}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    for i, text in enumerate(plans, 1):
        # A plan is started only if the budget holds another plan as long as the longest yet.
        if left_s() < max((r["wall_s"] for r in rows), default=0.0):
            print(f"budget: {left_s():.0f} s left, skipping {len(plans) - i + 1} plan(s)", file=sys.stderr)
            break
        t0 = time.perf_counter()
        try:
            plan = runner_plan(args.model, args.global_batch, text)
        except SpecError as e:  # the runtime would refuse it too: no child needed
            plan, m = None, Measurement(text, error=str(e))
        else:
            m = run_child(MeasureRequest(args.model, args.global_batch, text, args.warmup_steps, args.steps,
                                         args.memory_analysis, args.init), min(args.plan_timeout_s, left_s()))
        learn(m.environment)
        if plan is None:
            est = {"error": m.error}
        elif gpu_type is None:
            est = {"error": "no device was seen to guess the GPU type from: give --gpu-type"}
        else:
            est = estimate_plan(args.model, args.global_batch, gpu_type, plan)
        rows.append(plan_row(m, est, time.perf_counter() - t0))
        print(_progress(i, len(plans), rows[-1]), file=sys.stderr, flush=True)
        if args.json:  # what is done so far survives a run killed from outside
            Path(args.json).write_text(json.dumps(report(args, rows, env, gpu_type, gpu_note, plans[i:],
                                                         time.perf_counter() - t_begin), indent=1) + "\n")
    done = {r["plan"] for r in rows}
    return report(args, rows, env, gpu_type, gpu_note, [p for p in plans if p not in done],
                  time.perf_counter() - t_begin)


def _quoted(arg: str) -> str:
    return f"'{arg}'" if re.search(r"[^\w@%+=:,./-]", arg) else arg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="built-in model name (gpt-760m) or a model YAML path")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--gpu-type", help="catalog GPU type of the estimate (default: from the device kind)")
    p.add_argument("--plans", nargs="+", metavar="PLAN", help="plan strings, e.g. "
                   "'cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=4 remat=1'")
    p.add_argument("--auto", action="store_true", help="the single-stage plans of the local devices")
    p.add_argument("--max-plans", type=int, default=6, help="most --auto plans (default 6)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=list(MICRO_BATCH_CHOICES),
                   help="micro-batch counts --auto tries (default 1 2 4)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--init", choices=("random", "zeros"), default="random",
                   help="random: the runner's initialisation (on a GPU its compile takes about as long as the "
                        "step's); zeros: every weight and optimizer buffer zero, no init compile, same step "
                        "time and memory, a meaningless loss")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps before, the first compiles (default 2)")
    p.add_argument("--plan-timeout-s", type=float, default=300.0, help="a plan's child is killed after this")
    p.add_argument("--budget-s", type=float, help="wall seconds for the whole run: no plan is started that the "
                   "longest plan so far would not fit in, and a child is killed when the budget ends")
    p.add_argument("--no-memory-analysis", dest="memory_analysis", action="store_false",
                   help="skip the compiled step's memory_analysis() (one more compile if XLA does not cache it)")
    p.add_argument("--json", metavar="OUT", help="also write the JSON here")
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--compile-cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child_out and not (args.plans or args.auto):
        p.error("give --plans or --auto")
    if args.steps < 1 or args.warmup_steps < 1:
        p.error("--steps and --warmup-steps must be at least 1 (the first warm-up step compiles)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_out:
        req = MeasureRequest(args.model, args.global_batch, args.plans[0], args.warmup_steps, args.steps,
                             args.memory_analysis, args.init, args.compile_cache_dir)
        return child_main(req, Path(args.child_out))
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from bench_output import emit
    emit(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
