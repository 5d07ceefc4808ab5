"""Today's analytic estimate against the runner's step times measured on GPUs nobody fitted.

``benchmarks/results_plan_measure_*.json`` keep what ``plan_measure.py`` measured on an
H100 and an H200 (types with no row in the fitted table): each plan's median step time.
This scores the same plans again with the estimator as it is now (``plan_measure``'s own
``estimate_plan``), no GPU needed, so a change of the shared physics is checked against
measurements it was not fitted on. Prints JSON: per plan the measured and estimated
seconds and the accuracy (1 − |est − meas| / meas), then median, mean and worst, beside
those of the estimate recorded when the plan was measured.

    python benchmarks/gpu_step_accuracy.py [--out FILE]
"""

import argparse
import glob
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_output import emit  # noqa: E402
from plan_measure import accuracy, estimate_plan, runner_plan, summarize  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    rows = []
    for path in sorted(glob.glob(str(HERE / "results_plan_measure_*.json"))):
        doc = json.loads(Path(path).read_text())
        for p in doc["plans"]:
            if not p.get("ok"):
                continue
            measured_s = p["measured"]["step_s"]["median"]
            est = estimate_plan(doc["model"], doc["global_batch"], doc["gpu_type"],
                                runner_plan(doc["model"], doc["global_batch"], p["plan"]))
            rows.append({"file": Path(path).name, "gpu_type": doc["gpu_type"], "model": doc["model"],
                         "plan": p["plan"], "measured_s": measured_s,
                         "estimate_s": est.get("iteration_time_s"),
                         "accuracy": accuracy(est.get("iteration_time_s"), measured_s),
                         "estimate_then_s": p["estimate"].get("iteration_time_s"),
                         "accuracy_then": accuracy(p["estimate"].get("iteration_time_s"), measured_s)})
    emit({"plans": rows,
          "now": summarize([r["accuracy"] for r in rows]),
          "when_measured": summarize([r["accuracy_then"] for r in rows]),
          "command": "python benchmarks/gpu_step_accuracy.py"}, args.out)


if __name__ == "__main__":
    main()
