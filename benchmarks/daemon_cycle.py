"""How long one observe → decide → act cycle of the daemon takes with 2,000 queued jobs.

Starts the lab cluster, submits ``--jobs`` elastic jobs (a mix of models and sizes, all
held by the submit hook, as on a busy cluster), then runs ``--cycles`` daemon rounds in a
row and prints one JSON object:

``{"command", "jobs_queued", "policy", "submit_s", "warmup": [cycle...], "cycles":
[cycle...], "first_cycle_s", "steady_cycle_s", "steady_max_s", "steady_parts_s",
"steady_share", "acting": [cycle...], "acting_cycle_s", "acting_mean_s", "acting_max_s",
"target_s", "meets_target", "cpus", "load_avg_1m", "slurm"}`` where each
cycle is ``{"cycle", "total_s", "observe_s", "estimate_s", "decide_s", "act_s", "jobs",
"managed", "new_specs", "actions"}``.

- ``observe_s``: the job listings (``squeue -O``, three of them), the grants of newly
  running GPU jobs (``scontrol -d show job``), ``sinfo --json``, and their parsing;
- ``estimate_s``: job specs (the first cycle reads every batch script), Cell estimates
  (cached per distinct spec in the state store) and the policy's Snapshot;
- ``decide_s``: the policy's ``decide``; ``act_s``: every Slurm update the round made
  (starts and the per-round budget of "why it waits" AdminComment updates).
- ``warmup``: the cold round(s), while the daemon reads every new job's spec (one batch
  script each) and computes their estimates; ``first_cycle_s`` is the first of them.
- ``cycles``: rounds after every spec is known; ``steady_cycle_s`` is their median, what
  a running daemon pays per round with 2,000 jobs queued, ``steady_max_s`` the slowest;
  ``steady_parts_s`` the median of each part and ``steady_share`` its share of the sum
  (the machine may be shared: the share says where the time goes even when it is loaded).
- ``acting``: rounds that act. Before each, two running elastic jobs are cancelled, and the
  round starts waiting jobs on the GPUs they freed (and rescales what the policy moves:
  a rescale's round signals and goes on, later rounds finish it). ``acting_cycle_s`` is
  their median, ``acting_mean_s`` their mean, ``acting_max_s`` the slowest.

Backends: ``--backend cli|pyslurm|both`` (with ``--slurm-prefix /opt/slurm-25.11`` for
pyslurm). With ``both`` the two share one queue and one daemon: warm-up with the first,
then each steady and acting round is taken once per backend in turn (the top-level keys
describe the CLI's rounds), and ``backends`` holds each one's figures: its steady and
acting rounds (median, mean, worst), and ``read_s``, the time of one ``jobs()`` plus
``nodes()`` (what a backend changes: median, mean, worst of ``--reads``). ``ratio`` gives
pyslurm ÷ CLI of the medians.

Usage: ``python benchmarks/daemon_cycle.py [--jobs 2000] [--cycles 5] [--acting-cycles 5]
[--policy cells-ilp] [--backend cli|pyslurm|both] [--slurm-prefix P] [--reads 10] [--out FILE]
[--profile FILE]`` (``--profile``: cProfile stats of the steady cycles).
Needs root and Slurm (the lab); takes a few minutes, most of it submitting the jobs.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from estimator.cluster import load_cluster
from slurm_ext.backend import make_client
from slurm_ext.config import DaemonConfig, resolve
from slurm_ext.daemon import Daemon
from slurm_ext.lab import LabCluster, find_free_base_port, poll
from slurm_ext.run import run_command
from slurm_ext.slurm_client import SlurmClient, SubmitRequest
from slurm_ext.slurm_install import install_from
from slurm_ext.store import Store
from bench_output import emit  # noqa: E402

SCRIPT = """#!/bin/bash
#ELASTIC iterations=100000
trap 'exit 86' USR1
while true; do sleep 1 & wait $!; done
"""
SPECS = ("model=gpt-760m global_batch=32", "model=gpt-1.3b global_batch=64",
         "model=gpt-2.6b global_batch=64 gpus=8", "model=moe-690m global_batch=32 gpus=2",
         "model=moe-1.3b global_batch=64", "model=wide_resnet-500m global_batch=128 gpus=4",
         "model=wide_resnet-1b global_batch=256 gpu_type=v100", "model=gpt-6.7b global_batch=32 gpus=16")
TARGET_S = 2.0
PARTS = ("observe_s", "estimate_s", "decide_s", "act_s")


def submit_all(client: SlurmClient, n: int, workdir: Path) -> float:
    """Submit n elastic jobs with 4 sbatch calls in flight; returns the seconds it took."""
    started = time.perf_counter()

    def one(i: int) -> int:
        return client.submit(SubmitRequest(script=SCRIPT, name=f"bench-{i}", comment=f"elastic {SPECS[i % len(SPECS)]}",
                                           output="/dev/null", workdir=str(workdir)))

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - started


def _row(i: int, r) -> dict:
    return {"cycle": i, "total_s": round(r.total_s, 3), "observe_s": round(r.observe_s, 3),
            "estimate_s": round(r.estimate_s, 3), "decide_s": round(r.decide_s, 3),
            "act_s": round(r.act_s, 3), "jobs": r.jobs, "managed": r.managed,
            "new_specs": r.new_specs, "actions": len(r.actions)}


def _stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "mean": round(statistics.fmean(values), 3),
            "max": round(max(values), 3)} if values else None


def _reads(client: SlurmClient, n: int) -> dict:
    """Seconds of one jobs() + nodes(), n times: what a backend changes in a round."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        client.jobs()
        client.nodes()
        times.append(time.perf_counter() - started)
    return _stats(times)


def _summary(rounds: dict) -> dict:
    return {"steady_s": _stats([c["total_s"] for c in rounds["cycles"]]),
            "steady_observe_s": _stats([c["observe_s"] for c in rounds["cycles"]]),
            "steady_act_s": _stats([c["act_s"] for c in rounds["cycles"]]),
            "acting_s": _stats([c["total_s"] for c in rounds["acting"]]),
            "acting_act_s": _stats([c["act_s"] for c in rounds["acting"]]),
            "read_s": rounds["read_s"], "cycles": rounds["cycles"], "acting": rounds["acting"]}


def _ratio(summaries: dict) -> dict:
    """pyslurm ÷ CLI of each median (below 1: pyslurm is faster)."""
    a, b = summaries["pyslurm"], summaries["cli"]
    return {k: round(a[k]["median"] / b[k]["median"], 3) if a[k] and b[k] and b[k]["median"] else None
            for k in ("steady_s", "steady_observe_s", "acting_s", "acting_act_s", "read_s")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--cycles", type=int, default=5, help="steady cycles measured after warm-up")
    parser.add_argument("--acting-cycles", type=int, default=5,
                        help="rounds measured after two running jobs were cancelled each")
    parser.add_argument("--max-warmup", type=int, default=20, help="cold rounds at most, while specs are read")
    parser.add_argument("--policy", default=DaemonConfig().policy, help="the daemon's policy (default: its default)")
    parser.add_argument("--backend", choices=("cli", "pyslurm", "both"), default="cli",
                        help="the Slurm backend(s) measured (both: round by round in turn)")
    parser.add_argument("--slurm-prefix", default=os.environ.get("SLURM_EXT_SLURM_PREFIX"),
                        help="the Slurm to run (default $SLURM_EXT_SLURM_PREFIX, else the system's)")
    parser.add_argument("--reads", type=int, default=10, help="jobs()+nodes() reads timed per backend")
    parser.add_argument("--out", help="also write the JSON to this file")
    parser.add_argument("--profile", help="write cProfile stats of the steady cycles to this file")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="slurm-ext-bench-"))
    os.chmod(root, 0o755)
    lab = LabCluster(root / "lab", base_port=find_free_base_port(load_cluster("lab"), range(19400, 20400, 40)),
                     install=install_from(args.slurm_prefix))
    lab.up()
    try:
        names = ("cli", "pyslurm") if args.backend == "both" else (args.backend,)
        clients = {b: make_client(b, args.slurm_prefix, timeout_s=120, env=lab.env()) for b in names}
        client = clients[names[0]]
        submit_s = submit_all(client, args.jobs, root)
        # Every new spec is read in the first round here (the service default reads 50 per
        # round and follows up within seconds): the warm-up is then one long cold round.
        config = resolve({"state_db": str(root / "state.db"), "policy": args.policy,
                          "max_new_specs_per_round": args.jobs}, {}, {})
        daemon = Daemon(config, client, Store(config.state_db), out=lambda line: None)
        warmup, cycles = [], []
        # Warm-up: the daemon reads new specs (one batch script each) at a bounded rate per
        # round; these cold rounds are reported apart from the steady ones measured after.
        for _ in range(args.max_warmup):
            r = daemon.round()
            warmup.append(_row(len(warmup) + 1, r))
            if r.unread_specs == 0:
                break
        profiler = cProfile.Profile() if args.profile else None
        per_backend = {b: {"cycles": [], "acting": []} for b in names}
        for i in range(args.cycles):
            for b in names:
                daemon.use_client(clients[b])
                if profiler:
                    profiler.enable()
                r = daemon.round()
                if profiler:
                    profiler.disable()
                per_backend[b]["cycles"].append(_row(i + 1, r))
        if profiler:
            profiler.dump_stats(args.profile)
        for i in range(args.acting_cycles):
            for b in names:
                victims = [j.job_id for j in client.jobs() if j.is_running and j.is_elastic][:2]
                for job_id in victims:
                    client.cancel(job_id)
                poll(lambda: not any((j := client.job(v)) and j.is_active for v in victims), 30)
                daemon.use_client(clients[b])
                per_backend[b]["acting"].append(_row(i + 1, daemon.round()))
        for b in names:
            per_backend[b]["read_s"] = _reads(clients[b], args.reads)
        cycles, acting = per_backend[names[0]]["cycles"], per_backend[names[0]]["acting"]
        summaries = {b: _summary(v) for b, v in per_backend.items()}
        version = run_command(["sinfo", "--version"], timeout_s=10, env=lab.env()).stdout.strip()
        steady = statistics.median(c["total_s"] for c in cycles)
        parts = {k: round(statistics.median(c[k] for c in cycles), 3) for k in PARTS}
        emit({
            "command": "python benchmarks/daemon_cycle.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "jobs_queued": args.jobs, "policy": args.policy, "submit_s": round(submit_s, 1),
            "warmup": warmup, "cycles": cycles, "first_cycle_s": warmup[0]["total_s"],
            "steady_cycle_s": round(steady, 3),
            "steady_max_s": max(c["total_s"] for c in cycles), "steady_parts_s": parts,
            "steady_share": {k: round(v / max(sum(parts.values()), 1e-9), 3) for k, v in parts.items()},
            "acting": acting,
            "acting_cycle_s": round(statistics.median(c["total_s"] for c in acting), 3) if acting else None,
            "acting_mean_s": round(statistics.fmean(c["total_s"] for c in acting), 3) if acting else None,
            "acting_max_s": max((c["total_s"] for c in acting), default=None),
            "target_s": TARGET_S, "meets_target": steady <= TARGET_S, "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 1), "slurm": version,
            "backend": args.backend, "backends": summaries,
            "ratio": _ratio(summaries) if len(names) == 2 else None}, args.out)
        return 0
    finally:
        lab.down(timeout_s=120)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
