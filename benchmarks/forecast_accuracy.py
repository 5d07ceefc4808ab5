"""How right the forecasts are: trace replays that forecast jobs at their arrival.

Each run is one ``slurm-ext simulate ... --forecast-every N`` on crius-1280, seed 0: at
the arrival of every N-th job the replay runs the policy forward from that round, as the
daemon does (``policy/forecast.py``), and keeps the job's forecast start and end beside
what then happened. The replay runs on measured rates and the forecast on estimates, so
the error includes the estimator's. Runs go two at a time (one per core).

Prints one JSON object: ``{"command", "runs": [{"command", "trace", "density",
"offered_load", "policies": {NAME: {"jobs", "avg_jct_s", "avg_queue_s", "forecast_jobs",
"forecast_with_end", "forecast_extrapolated", "forecast_start_abs_err_s",
"forecast_end_abs_err_s", "forecast_start_err_per_wait", "forecast_end_err_per_jct"}}}]}``
(errors as ``{"p50", "p90"}``; see ``docs/simulation.md``).

Usage: ``python benchmarks/forecast_accuracy.py [--runs itp:1:10 philly:0.1:10 philly:0.5:20
philly:1:50] [--policy cells-ilp --policy crius] [--out FILE]`` (a run is
TRACE:DENSITY:EVERY; the full set took 15–26 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_output import emit

ROOT = Path(__file__).resolve().parents[1]
TRACES = {"itp": "itp_cluster08.csv", "philly": "philly_2week.csv"}
KEPT = ("jobs", "avg_jct_s", "avg_queue_s", "forecast_jobs", "forecast_with_end", "forecast_extrapolated",
        "forecast_start_abs_err_s", "forecast_end_abs_err_s", "forecast_start_err_per_wait",
        "forecast_end_err_per_jct")


def _replay(trace_dir: Path, run: str, policies: list[str]) -> dict:
    name, density, every = run.split(":")
    trace = trace_dir / TRACES[name]
    args = ["simulate", "--trace", str(trace), "--cluster", "crius-1280", "--forecast-every", every]
    for policy in policies:
        args += ["--policy", policy]
    if float(density) != 1.0:
        args += ["--density", density]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "slurm_ext", *args, "--json", str(out), "--quiet"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        report = json.loads(out.read_text())
    shown = " ".join(a if a != str(trace) else f"../shared/data/traces/{trace.name}" for a in args)
    return {"command": f"slurm-ext {shown}", "trace": trace.name, "density": float(density),
            "offered_load": report.get("offered_load"),
            "policies": {p: {k: s.get(k) for k in KEPT} for p, s in report["policies"].items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=["itp:1:10", "philly:0.1:10", "philly:0.5:20", "philly:1:50"],
                   help="TRACE:DENSITY:EVERY, TRACE one of " + ", ".join(TRACES))
    p.add_argument("--policy", action="append", help="policy to replay (repeat); default cells-ilp and crius")
    p.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "traces"), help="trace directory")
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args(argv)
    for run in args.runs:
        if run.count(":") != 2 or run.split(":")[0] not in TRACES:
            p.error(f"--runs: {run!r} is not TRACE:DENSITY:EVERY with TRACE one of {', '.join(TRACES)}")
    policies = args.policy or ["cells-ilp", "crius"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda r: _replay(Path(args.traces), r, policies), args.runs))
    emit({"command": "python benchmarks/forecast_accuracy.py " + " ".join(argv or sys.argv[1:]), "runs": runs},
         args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
