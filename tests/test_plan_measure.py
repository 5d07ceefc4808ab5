"""benchmarks/plan_measure.py: plans measured in child processes against the estimate.

One end-to-end run on 4 CPU fake devices (tiny GPT): a single-stage and a two-stage plan
are measured, a malformed plan becomes that plan's error, and pulp/highspy are blocked
in every process (the GPU image has neither). Plus the pure helpers.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "plan_measure.py"
TINY = ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml"
PLANS = ("cell=a100x4:s1 plan=[dp2tp2] mb=2 remat=1",
         "cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=4 remat=1")
BAD = "cell=a100x4:s1 plan=[dp3tp1] mb=2 remat=1"  # dp must be a power of two
# XLA flags that make CPU compiles fast (as job_scripts.runtime sets for CPU runs).
FAST_CPU = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _module():
    spec = importlib.util.spec_from_file_location("plan_measure", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_measures_plans_in_children_and_reports_a_bad_plan_as_its_error(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("pulp", "highspy"):  # not on the GPU image: importing either fails the run
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(blocked), str(ROOT)]), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_CPU}")
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(TINY), "--global-batch", "16",
                           "--plans", *PLANS, BAD, "--steps", "3", "--warmup-steps", "1",
                           "--plan-timeout-s", "120", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    rows = {r["plan"]: r for r in result["plans"]}
    assert list(rows) == [*PLANS, BAD]
    for text in PLANS:
        row = rows[text]
        assert row["ok"], row["error"]
        times = row["measured"]["step_s"]
        assert all(math.isfinite(times[k]) and times[k] > 0 for k in ("median", "mean", "worst"))
        assert times["median"] <= times["worst"]
        assert row["measured"]["compile_first_step_s"] > 0 and row["measured"]["loss_finite"] is True
        assert row["measured"]["peak_memory_gb"] is None  # CPU keeps no allocator peak
        assert row["measured"]["compiled_memory"]["peak_bytes"] > 0
        assert row["estimate"]["iteration_time_s"] > 0 and row["estimate"]["peak_memory_gb"] > 0
        assert row["time_ratio_est_over_measured"] > 0 and 0 <= row["time_accuracy"] <= 1
        assert row["wall_s"] > 0
    assert rows[PLANS[1]]["estimate"]["cell"] == "a100x4:s2"
    bad = rows[BAD]
    assert not bad["ok"] and "dp3tp1" in bad["error"] and bad["measured"] is None
    summary = result["summary"]
    assert (summary["plans"], summary["plans_ok"], summary["plans_failed"]) == (3, 2, 1)
    for key in ("time_accuracy", "memory_accuracy"):
        assert set(summary[key]) == {"plans", "median", "mean", "worst"}
    assert summary["time_accuracy"]["plans"] == 2
    assert result["environment"]["backend"] == "cpu" and result["environment"]["device_count"] == 4
    assert result["gpu_type"] == "a100" and "cpu" in result["gpu_type_note"]
    assert len(result["wall_s"]["per_plan"]) == 3
    assert all(f"[{i}/3]" in proc.stderr for i in (1, 2, 3)) and "FAILED" in proc.stderr


def test_zero_init_trains_from_all_zero_buffers(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_CPU}")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(TINY), "--global-batch", "8",
                           "--gpu-type", "h100",
                           "--plans", "cell=h100x2:s1 plan=[dp1tp2] mb=2 remat=0", "--init", "zeros", "--steps", "2",
                           "--warmup-steps", "1", "--no-memory-analysis"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)["plans"]
    assert row["ok"], row["error"]
    # Zero weights: uniform predictions over the 128-token vocabulary.
    assert row["measured"]["loss"] == pytest.approx(math.log(128), rel=1e-4)
    assert row["measured"]["compiled_memory"] is None and row["measured"]["memory_analysis_s"] is None
    assert row["estimate"]["cell"] == "h100x2:s1"


def test_gpu_type_from_device_kind():
    m = _module()
    assert m.gpu_type_for("gpu", "NVIDIA H100 80GB HBM3") == ("h100", None)
    assert m.gpu_type_for("gpu", "NVIDIA H200") == ("h200", None)
    assert m.gpu_type_for("gpu", "NVIDIA A100-SXM4-40GB") == ("a100", None)
    assert m.gpu_type_for("gpu", "NVIDIA A10") == ("a10", None)
    assert m.gpu_type_for("cpu", "cpu")[0] == "a100" and m.gpu_type_for("cpu", "cpu")[1]
    assert m.gpu_type_for("gpu", "NVIDIA B200")[1]


def test_auto_plans_divide_the_batch_and_stay_few():
    m = _module()
    one = m.auto_plans(1, 8, "h100", 6)
    assert one == [f"cell=h100x1:s1 plan=[dp1tp1] mb={mb} remat={r}" for mb in (1, 2, 4) for r in (1, 0)]
    assert m.auto_plans(1, 6, "h100", 6) == one[:4]  # 4 does not divide 6
    four = m.auto_plans(4, 16, "a100", 5)
    assert len(four) == 5 and four[0].startswith("cell=a100x4:s1 plan=[dp4tp1] mb=1")
    assert m.accuracy(1.5, 1.0) == 0.5 and m.accuracy(3.0, 1.0) == 0.0 and m.accuracy(None, 1.0) is None
