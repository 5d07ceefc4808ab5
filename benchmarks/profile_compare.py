"""Two profile stores of one GPU type, layer by layer: the ratio of each layer share's
time in ``--other`` to its time in ``--base`` (same model, layer, tp and sample count),
summarised per tp degree for the forward and the forward+backward programs.

It tells whether a cheaper way of profiling (other XLA flags, fewer sample counts, another
machine of the same kind) measures the same kernels: a ratio of 1 is the same time.
Prints JSON (``benchmarks.bench_output.emit``)::

    python benchmarks/profile_compare.py --gpu-type h100 \\
        --base benchmarks/results_profile_h100_tp1.sqlite \\
        --other benchmarks/results_profile_h100_no_triton.sqlite
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_output import emit  # noqa: E402
from estimator.profile_store import load_profile_view  # noqa: E402


def _summary(ratios: list[float]) -> dict:
    return {"shares": len(ratios), "median": round(statistics.median(ratios), 3),
            "mean": round(statistics.fmean(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def compare(base: str, other: str, gpu: str) -> dict:
    a, b = load_profile_view(base), load_profile_view(other)
    by_tp: dict[int, dict[str, list[float]]] = {}
    for (g, fp, layer, tp), timing in a.layers.items():
        theirs = b.layers.get((g, fp, layer, tp))
        if g != gpu or theirs is None:
            continue
        mine = dict(zip(timing.samples, zip(timing.forward_s, timing.forward_backward_s)))
        for samples, f, fb in zip(theirs.samples, theirs.forward_s, theirs.forward_backward_s):
            if samples in mine and min(mine[samples]) > 0:
                ratios = by_tp.setdefault(tp, {"forward": [], "forward_backward": []})
                ratios["forward"].append(f / mine[samples][0])
                ratios["forward_backward"].append(fb / mine[samples][1])
    if not by_tp:
        raise SystemExit(f"error: the stores share no {gpu} layer timings")
    return {"gpu_type": gpu, "base": base, "other": other,
            "ratio_other_over_base": {f"tp{tp}": {k: _summary(v) for k, v in r.items()}
                                      for tp, r in sorted(by_tp.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the reference profile store")
    ap.add_argument("--other", required=True, help="the store compared with it")
    ap.add_argument("--gpu-type", required=True)
    ap.add_argument("--json", metavar="OUT", help="also write the JSON here")
    args = ap.parse_args(argv)
    emit(compare(args.base, args.other, args.gpu_type), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
