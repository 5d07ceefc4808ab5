"""What profiling costs: `python -m job_scripts.profile` on this machine's devices, timed
by part (collectives, calibration kernels, each model's layer shares).

One process; on a machine without a GPU, ``--devices`` CPU devices stand in (their
numbers are CPU numbers: what this measures there is the path's own cost). On a GPU node
it is the cost of profiling that node. Prints JSON (``benchmarks.bench_output.emit``).

    python benchmarks/profile_cost.py --gpu-type a10 --devices 2 --model gpt-760m
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_output import emit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu-type", required=True)
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--devices", type=int, default=2, help="CPU stand-ins per process (no GPU)")
    p.add_argument("--samples", type=int, nargs="+")
    p.add_argument("--max-tp", type=int, help="largest tp degree of a layer share (default: every device)")
    p.add_argument("--budget-s", type=float, help="the profiler's time budget")
    p.add_argument("--compile-workers", type=int, help="threads compiling at once (default: the CPUs)")
    p.add_argument("--skip-collectives", action="store_true")
    p.add_argument("--profile-db", help="keep the store here (default: a temporary one, discarded)")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(args.profile_db) if args.profile_db else Path(tmp) / "profile.sqlite"
        argv = [sys.executable, "-m", "job_scripts.profile", "--profile-db", str(db.resolve()), "--gpu-type",
                args.gpu_type, "--devices-per-node", str(args.devices)]
        for m in args.model:
            argv += ["--model", m]
        for flag, value in (("--samples", args.samples), ("--max-tp", args.max_tp), ("--budget-s", args.budget_s),
                            ("--compile-workers", args.compile_workers)):
            if value is not None:
                argv += [flag, *map(str, value if isinstance(value, list) else [value])]
        if args.skip_collectives:
            argv.append("--skip-collectives")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        t0 = time.monotonic()
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        wall_s = time.monotonic() - t0
    lines = [line[len("profile: "):].replace("\x00", "") for line in out.stdout.splitlines()
             if line.startswith("profile: ")]
    summary = json.loads(lines[-1][len("done "):])
    emit({"gpu_type": args.gpu_type, "platform": summary["platform"],
          "devices": args.devices if summary["platform"] == "cpu" else summary["gpus_per_node"],
          "models": args.model, "wall_s": round(wall_s, 1), "profile_s": summary["seconds"],
          "seconds_by_part": summary["seconds_by_part"], "collectives": summary["collectives"],
          "kernels": summary["kernels"], "layers": summary["layers"],
          "layer_shares_untimed": summary.get("layer_shares_untimed", 0), "progress": lines[:-1],
          "command": " ".join(["python", "benchmarks/profile_cost.py", *sys.argv[1:]])}, args.json)


if __name__ == "__main__":
    main()
