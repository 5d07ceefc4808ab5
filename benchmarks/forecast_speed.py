"""How long one forecast takes: cells-ilp run forward from a busy cluster's snapshot.

The snapshot is ``benchmarks/policy_scale.py``'s: synthetic estimates, jobs arriving over
a day, those whose request fits running and the rest queued. The daemon runs the forecast
every ``forecast_every_s`` (60 s by default), so its cost is paid about once a minute, and
it starts from the round's own decision: the time here is what the forecast adds.

Each run is one setting: ``max_decisions`` policy decisions at most and a wall-time budget
(``budget_s``, None: none) after which the rest is the list schedule in the policy's
order (``policy.forecast``). The first setting is the reference: pass one large enough to
decide all the way (``--settings 1000:none``, the default's first). Every other run says
how far its forecasts are from the reference's, in hours (``start_diff_h``,
``end_diff_h``: p50 and p90 of the absolute difference over jobs waiting now): what the
cheaper forecast gives up. That is agreement between two forecasts, not accuracy; the
accuracy against what happened is ``slurm-ext simulate --forecast-every``'s.

Prints one JSON object: ``{"command", "runs": [{"gpus", "jobs", "queued", "running",
"max_decisions", "budget_s", "seconds": [...], "median_s", "mean_s", "worst_s",
"decisions", "forecast_start", "forecast_end", "extrapolated", "horizon_h",
"start_diff_h", "end_diff_h"}], "target_s"}``. ``decisions`` counts the policy's decisions
(the round's included), ``forecast_start`` and ``forecast_end`` the jobs that got one,
``extrapolated`` those whose forecast came from the list schedule, ``horizon_h`` how far
ahead the latest reaches.

Usage: ``python benchmarks/forecast_speed.py [--gpus 2560] [--jobs 2000] [--repeats 3]
[--settings 1000:none 60:1.5 8:none] [--out FILE]``.
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
from bench_output import emit  # noqa: E402
from policy_scale import snapshot  # noqa: E402

TARGET_S = 2.0
DAEMON_ROUND_S = 60.0  # the daemon's default interval_s: it decides once a round


def _setting(text: str) -> tuple[int, float | None]:
    decisions, _, budget = text.partition(":")
    return int(decisions), (None if budget in ("", "none") else float(budget))


def _diff_h(got: dict, ref: dict, attr: str, now_s: float) -> dict | None:
    diffs = sorted(abs(getattr(got[k], attr) - getattr(ref[k], attr)) / 3600 for k in ref
                   if ref[k].start_s is not None and ref[k].start_s > now_s
                   and getattr(ref[k], attr) is not None and getattr(got[k], attr) is not None)
    if not diffs:
        return None
    return {"p50": round(statistics.median(diffs), 2), "p90": round(diffs[int(0.9 * (len(diffs) - 1))], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2560)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settings", nargs="+", default=["1000:none", "60:1.5", "8:none"],
                   help="MAX_DECISIONS:BUDGET_S (none: no budget); the first is the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args(argv)
    snap = snapshot(args.gpus, args.jobs, args.seed)
    runs, ref = [], None
    for max_decisions, budget_s in map(_setting, args.settings):
        seconds, decisions, got = [], 0, {}
        for _ in range(args.repeats):
            policy = CellsIlpPolicy()
            first = policy.decide(snap)  # the round's own decision, which the daemon passes in
            calls = []
            decide = policy.decide
            policy.decide = lambda s, decide=decide, calls=calls: calls.append(1) or decide(s)
            t0 = time.perf_counter()
            got = forecast(snap, policy, (), max_decisions, first=first, min_step_s=DAEMON_ROUND_S,
                           time_budget_s=budget_s)
            seconds.append(round(time.perf_counter() - t0, 3))
            decisions = len(calls) + 1
        ref = ref or got
        runs.append({"gpus": args.gpus, "jobs": args.jobs,
                     "queued": sum(j.assignment is None for j in snap.jobs),
                     "running": sum(j.assignment is not None for j in snap.jobs),
                     "max_decisions": max_decisions, "budget_s": budget_s, "seconds": seconds,
                     "median_s": statistics.median(seconds), "mean_s": round(statistics.fmean(seconds), 3),
                     "worst_s": max(seconds), "decisions": decisions,
                     "forecast_start": sum(f.start_s is not None for f in got.values()),
                     "forecast_end": sum(f.end_s is not None for f in got.values()),
                     "extrapolated": sum(f.extrapolated for f in got.values()),
                     "horizon_h": round(max([f.end_s or 0 for f in got.values()] + [f.start_s or 0 for f in got.values()])
                                        / 3600 - snap.now_s / 3600, 1),
                     "start_diff_h": _diff_h(got, ref, "start_s", snap.now_s),
                     "end_diff_h": _diff_h(got, ref, "end_s", snap.now_s)})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    emit({"command": "python benchmarks/forecast_speed.py " + " ".join(argv or sys.argv[1:]),
          "runs": runs, "target_s": TARGET_S}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
