"""How long one forecast takes: cells-ilp run forward from a busy cluster's snapshot.

The snapshot is ``benchmarks/policy_scale.py``'s: synthetic estimates, jobs arriving over
a day, those whose request fits running and the rest queued. The daemon runs the forecast
every ``forecast_every_s`` (60 s by default), so its cost is paid about once a minute, and
it starts from the round's own decision: the time here is what the forecast adds.

Prints one JSON object: ``{"command", "runs": [{"gpus", "jobs", "queued", "running",
"max_decisions", "seconds": [...], "median_s", "mean_s", "worst_s", "decisions",
"forecast_start", "forecast_end", "horizon_h"}], "target_s"}``. ``decisions`` counts the
policy's decisions of the forward run (the round's included), ``forecast_start`` and
``forecast_end`` the jobs that got one, ``horizon_h`` how far ahead the latest reaches.

Usage: ``python benchmarks/forecast_speed.py [--gpus 2560] [--jobs 2000] [--repeats 3]
[--max-decisions 60 25] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy.cells_ilp import CellsIlpPolicy  # noqa: E402
from policy.forecast import forecast  # noqa: E402
from policy_scale import snapshot  # noqa: E402

TARGET_S = 2.0
DAEMON_ROUND_S = 60.0  # the daemon's default interval_s: it decides once a round


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2560)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-decisions", type=int, nargs="+", default=[60, 15])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args(argv)
    snap = snapshot(args.gpus, args.jobs, args.seed)
    runs = []
    for max_decisions in args.max_decisions:
        seconds, decisions, got = [], 0, {}
        for _ in range(args.repeats):
            policy = CellsIlpPolicy()
            first = policy.decide(snap)  # the round's own decision, which the daemon passes in
            calls = []
            decide = policy.decide
            policy.decide = lambda s, decide=decide, calls=calls: calls.append(1) or decide(s)
            t0 = time.perf_counter()
            got = forecast(snap, policy, (), max_decisions, first=first, min_step_s=DAEMON_ROUND_S)
            seconds.append(round(time.perf_counter() - t0, 3))
            decisions = len(calls) + 1
        runs.append({"gpus": args.gpus, "jobs": args.jobs,
                     "queued": sum(j.assignment is None for j in snap.jobs),
                     "running": sum(j.assignment is not None for j in snap.jobs),
                     "max_decisions": max_decisions, "seconds": seconds,
                     "median_s": statistics.median(seconds), "mean_s": round(statistics.fmean(seconds), 3),
                     "worst_s": max(seconds), "decisions": decisions,
                     "forecast_start": sum(f.start_s is not None for f in got.values()),
                     "forecast_end": sum(f.end_s is not None for f in got.values()),
                     "horizon_h": round(max([f.end_s or 0 for f in got.values()] + [f.start_s or 0 for f in got.values()])
                                        / 3600 - snap.now_s / 3600, 1)})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result = json.dumps({"command": "python benchmarks/forecast_speed.py " + " ".join(argv or sys.argv[1:]),
                         "runs": runs, "target_s": TARGET_S}, indent=1)
    print(result)
    if args.out:  # HiGHS prints its banner on stdout: the file holds the JSON alone
        Path(args.out).write_text(result + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
