"""Every policy beside the baselines as their papers published them, on equal costs.

For one trace it replays each policy at full density for each seed with the simulator's
defaults: every policy pays the same restart and plan-search costs (``--plan-search
equal``: the runtime's Cell-guided search, which the runtime runs whatever policy chose
the Cell), gavel and sia keep their papers' rounds (360 s and 60 s), the others decide
every 300 s and at every arrival and completion. Then, on the first seed, the
sensitivity variants:

* ``own_charges``: each policy's plan search as the Crius paper charged it (a full
  600 s search per new Cell for the baselines, the pruned one for crius and cells-ilp);
* ``rounds_60_all`` and ``rounds_300_all``: every policy, gavel and sia included, decides
  every 60 s, or every 300 s.

A variant re-runs only the policies it changes (own charges leave crius and cells-ilp as
they are; 300 s rounds for all change only gavel and sia); the others are taken from the
default run of that seed.

Prints one JSON object: ``{"trace", "cluster", "seeds", "runs": {variant: {seed:
{policy: summary}}}, "avg_jct_h": {variant: {policy: {"median", "mean", "worst",
"per_seed"}}}, "vs_crius": {variant: {policy: {"median", "mean", "worst"}}}}``; each
finished run is also written to ``--out`` as it ends, so a long run can be resumed
(``--resume``) and read while it goes. The seeds' ratios to crius are per seed, then
summarized (median, mean, worst = highest).

Usage: ``python benchmarks/baselines_faithful.py --trace ../shared/data/traces/itp_cluster08.csv
--seeds 0 1 2 --out benchmarks/results_baselines_faithful_itp.json``; ``--tables FILE ...``
prints the Markdown tables of finished result files instead (``--merge`` first folds the
runs of the later files into the first, rewriting it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.cluster import load_cluster  # noqa: E402
from policy.measured import load_measured  # noqa: E402
from policy.registry import make_policy  # noqa: E402
from policy.report import summarize  # noqa: E402
from policy.simulator import EstimateCache, SimConfig, simulate, start_costs  # noqa: E402
from policy.trace import map_trace, offered_load, read_trace, trace_kind_for  # noqa: E402

POLICIES = ("crius", "cells-ilp", "sia", "gavel", "gavel-greedy", "elasticflow", "elasticflow-blocking", "fcfs")
OWN_ROUNDS = ("gavel", "sia")  # policies whose papers set their round length
PRUNED_OWN = ("crius", "cells-ilp")  # their own charge is the runtime's pruned search


def variants(policies: tuple[str, ...]) -> dict[str, tuple[SimConfig, tuple[str, ...], float | None]]:
    """variant → (config, policies it re-runs, round length forced on every policy)."""
    base = SimConfig()
    return {
        "equal": (base, policies, None),
        "own_charges": (replace(base, plan_search="own"), tuple(p for p in policies if p not in PRUNED_OWN), None),
        "rounds_60_all": (replace(base, round_s=60.0), policies, 60.0),
        "rounds_300_all": (base, tuple(p for p in policies if p in OWN_ROUNDS), 300.0),
    }


def run_one(name: str, jobs, cluster, table, config: SimConfig, cache, forced_round_s: float | None, load: float) -> dict:
    policy = make_policy(name)
    if forced_round_s is not None and getattr(policy, "round_s", None):
        policy = make_policy(name, round_s=forced_round_s)
    t0 = time.perf_counter()
    result = simulate(policy, jobs, cluster, table, config, cache)
    summary = summarize(result, load)
    for key in ("never_runnable", "left_unfinished"):
        summary[key] = len(summary.get(key) or ())
    return summary | {"costs": start_costs(policy, config), "wall_s": round(time.perf_counter() - t0, 1)}


def aggregate(runs: dict, seeds: list[int]) -> tuple[dict, dict]:
    """Average JCT in hours and its ratio to crius, per variant and policy, over the seeds
    each variant ran (a variant's untouched policies come from the default run)."""
    jct, ratio = {}, {}
    for variant, per_seed in runs.items():
        jct[variant], ratio[variant] = {}, {}
        for seed_key, per_policy in per_seed.items():
            merged = {**runs["equal"].get(seed_key, {}), **per_policy}
            crius = merged.get("crius", {}).get("avg_jct_s")
            for name, s in merged.items():
                if s.get("avg_jct_s") is None:  # it finished no job: no average to take
                    continue
                jct[variant].setdefault(name, []).append(s["avg_jct_s"] / 3600)
                if crius:
                    ratio[variant].setdefault(name, []).append(s["avg_jct_s"] / crius)

    def stats(xs: list[float]) -> dict:
        return {"median": round(statistics.median(xs), 4), "mean": round(statistics.fmean(xs), 4),
                "worst": round(max(xs), 4), "per_seed": [round(x, 4) for x in xs]}

    return ({v: {p: stats(xs) for p, xs in d.items()} for v, d in jct.items()},
            {v: {p: stats(xs) for p, xs in d.items()} for v, d in ratio.items()})


def merge(paths: list[str]) -> dict:
    """The first report with the runs of the others added (same trace), re-summarized."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    first = reports[0]
    for other in reports[1:]:
        if other["trace"] != first["trace"]:
            raise SystemExit(f"cannot merge {other['trace']} into {first['trace']}")
        for variant, per_seed in other["runs"].items():
            for seed, per_policy in per_seed.items():
                first["runs"].setdefault(variant, {}).setdefault(seed, {}).update(per_policy)
    first["seeds"] = sorted({int(s) for r in reports for s in r["runs"].get("equal", {})})
    first["avg_jct_h"], first["vs_crius"] = aggregate(first["runs"], first["seeds"])
    first["command"] = " ; ".join(dict.fromkeys(r["command"] for r in reports))
    Path(paths[0]).write_text(json.dumps(first, indent=1) + "\n")
    return first


def tables(report: dict) -> str:
    """Markdown: average JCT per policy and seed on equal costs, its ratio to crius, and the
    sensitivity variants against the default on the same seeds."""
    eq, ratio = report["avg_jct_h"]["equal"], report["vs_crius"]["equal"]
    seeds = report["runs"]["equal"]
    lines = [f"**{report['trace']}** ({report['cluster']}, density 1, seeds {', '.join(sorted(seeds))}), "
             "equal costs, gavel and sia on their own rounds:", "",
             "| policy | avg JCT per seed (h) | mean (h) | ÷ crius: median / mean / worst | restarts/job | avg queue (h) |",
             "|---|---|---|---|---|---|"]
    for name in sorted(eq, key=lambda n: eq[n]["mean"]):
        runs = [seeds[s][name] for s in sorted(seeds) if name in seeds[s]]
        restarts = statistics.fmean(r["restarts_per_job"] for r in runs)
        queue_h = statistics.fmean(r["avg_queue_s"] for r in runs) / 3600
        r = ratio.get(name, {})
        lines.append(f"| {name} | {' / '.join(f'{x:.3f}' for x in eq[name]['per_seed'])} | {eq[name]['mean']:.3f} | "
                     f"{r.get('median', float('nan')):.3f} / {r.get('mean', float('nan')):.3f} / "
                     f"{r.get('worst', float('nan')):.3f} | {restarts:.3f} | {queue_h:.2f} |")
    variants = [v for v in report["runs"] if v != "equal"]
    if variants:
        lines += ["", "Sensitivity (seed " + ", ".join(sorted(report["runs"][variants[0]])) + "): average JCT in hours, "
                  "÷ crius in brackets; a variant re-runs only the policies it changes.", "",
                  "| policy | equal costs, own rounds | " + " | ".join(variants) + " |",
                  "|---|---|" + "---|" * len(variants)]
        sens_seeds = sorted(report["runs"][variants[0]])
        for name in sorted(eq, key=lambda n: eq[n]["mean"]):
            cells = []
            for v in ["equal", *variants]:
                vals = []
                for s in sens_seeds:
                    merged = {**report["runs"]["equal"].get(s, {}), **report["runs"][v].get(s, {})}
                    if name in merged and "crius" in merged:
                        j = merged[name]["avg_jct_s"]
                        vals.append(f"{j / 3600:.3f} ({j / merged['crius']['avg_jct_s']:.2f})")
                cells.append(" / ".join(vals) or "–")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--tables" in sys.argv:
        ap = argparse.ArgumentParser(description="Markdown tables of finished result files")
        ap.add_argument("--tables", nargs="+", required=True)
        ap.add_argument("--merge", action="store_true", help="fold the later files' runs into the first")
        args = ap.parse_args()
        reports = [merge(args.tables)] if args.merge else [json.loads(Path(p).read_text()) for p in args.tables]
        print("\n".join(tables(r) for r in reports))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--cluster", default="crius-1280")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policy", action="append", help="policies (default: all of crius, cells-ilp, sia, gavel, "
                                                      "gavel-greedy, elasticflow, elasticflow-blocking, fcfs)")
    ap.add_argument("--variant", action="append", help="variants to run (default: all)")
    ap.add_argument("--sensitivity-seeds", type=int, nargs="+", default=None,
                    help="seeds the sensitivity variants run on (default: the first seed)")
    ap.add_argument("--out", required=True, help="JSON file, rewritten after every run")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out")
    args = ap.parse_args()

    policies = tuple(args.policy or POLICIES)
    cluster, table = load_cluster(args.cluster), load_measured(None)
    out = Path(args.out)
    report = json.loads(out.read_text()) if args.resume and out.exists() else {}
    for key, now in (("trace", Path(args.trace).name), ("cluster", args.cluster), ("density", 1.0)):
        if report and report.get(key) != now:  # its runs would be mixed with this one's
            sys.exit(f"baselines_faithful.py: error: {out} holds runs of {key} {report.get(key)!r}, not {now!r}: "
                     "give another --out")
    runs = report.get("runs", {})
    commands = report.get("commands") or ([report["command"]] if report.get("command") else [])
    commands.append("python benchmarks/baselines_faithful.py " + " ".join(sys.argv[1:]))
    # The default variant's seeds the file holds runs of too: its aggregate covers them.
    seeds = sorted(set(args.seeds) | {int(s) for s in runs.get("equal", {})})
    sens_seeds = args.sensitivity_seeds if args.sensitivity_seeds is not None else args.seeds[:1]
    chosen = variants(policies)
    for variant in args.variant or list(chosen):
        config, names, forced = chosen[variant]
        for seed in (args.seeds if variant == "equal" else sens_seeds):
            jobs = map_trace(read_trace(args.trace), table, seed, 1.0, trace_kind_for(args.trace))
            load = offered_load(jobs, cluster.total_gpus())
            cache = EstimateCache(cluster, table, config.oracle)
            for name in names:
                done = runs.get(variant, {}).get(str(seed), {})
                if name in done:
                    continue
                print(f"{variant} seed {seed} {name} ...", file=sys.stderr, flush=True)
                summary = run_one(name, jobs, cluster, table, config, cache, forced, load)
                runs.setdefault(variant, {}).setdefault(str(seed), {})[name] = summary
                print(f"  avg JCT {summary['avg_jct_s'] / 3600:.3f} h in {summary['wall_s']} s",
                      file=sys.stderr, flush=True)
                jct, ratio = aggregate(runs, seeds)
                report = {"trace": Path(args.trace).name, "cluster": args.cluster, "seeds": seeds,
                          "sensitivity_seeds": sens_seeds, "density": 1.0, "command": commands[-1],
                          "commands": commands, "runs": runs, "avg_jct_h": jct, "vs_crius": ratio}
                out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report.get(k) for k in ("trace", "avg_jct_h", "vs_crius")}, indent=1))


if __name__ == "__main__":
    main()
