"""Compile time and compiled-vs-analytic FLOPs of gpt-1.3b stage variants; prints JSON.

The variants are Crius's: the two stages of the Cell a100x8:s2 (layers from the
estimator's partition), each data-parallel-only (dp4) and tensor-parallel-only (tp4),
micro-batch 16 samples (global batch 256, 16 micro-batches), with and without layer
rematerialization. For each: the stage compile (lower + XLA compile on 4 CPU devices,
wall and CPU seconds), the one-off compile of the repeated block (shared by every stage
that repeats it, cached), per-device FLOPs against the analytic estimator's
(forward FLOPs × samples per device / tp × 3, or × 4 with remat), and collective bytes.

CPU seconds count every thread of this process; wall seconds depend on what else runs on
the machine (the load average is reported alongside).

Usage: ``python benchmarks/compile_time.py [--model gpt-1.3b] [--repeat 2]``
"""

import argparse
import json
import os
import sys
import time

from estimator.compiled import child_xla_flags

# This script is an entry point: the fake device count must be set before JAX starts.
os.environ["XLA_FLAGS"] = child_xla_flags(8, os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _variant(arch, spec, start: int, end: int, dp: int, tp: int, micro: int, remat: bool,
             repeat: int) -> dict:
    import jax

    from estimator import compiled as cp
    from estimator import hlo
    from estimator import jax_models as jm
    stage = jm.Stage(arch, start, end, micro, remat)
    mesh = cp.stage_mesh(jax.devices(), dp, tp)
    walls, cpus = [], []
    for _ in range(repeat):  # every round traces, lowers and compiles from scratch
        c0, w0 = time.process_time(), time.perf_counter()
        jitted, args, runs = cp.build_stage_step(stage, mesh)
        compiled = jitted.lower(*args).compile()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    cp._UNIT_COSTS.clear()
    c0, w0 = time.process_time(), time.perf_counter()
    units = [cp._unit_costs(stage, r, mesh, dp, tp) for r in runs if r[2] > 1]
    unit_wall, unit_cpu = time.perf_counter() - w0, time.process_time() - c0
    flops = float(compiled.cost_analysis()["flops"])
    flops += sum((r[2] - 1) * u[0] for r, u in zip([r for r in runs if r[2] > 1], units))
    samples = micro / dp
    passes = 4.0 if remat else 3.0
    analytic = passes * samples / tp * sum(layer.flops_fwd for layer in spec.layers[start:end])
    colls = hlo.parse_collectives(compiled.as_text(), dp * tp)
    by_axis: dict[str, dict[str, int]] = {}
    for c in colls:
        axis = hlo.classify_axis(c.groups, dp, tp)
        by_axis.setdefault(axis, {}).setdefault(c.kind, 0)
        by_axis[axis][c.kind] += c.bytes * c.repeats
    return {
        "layers": [start, end], "dp": dp, "tp": tp, "micro_batch": micro, "remat": remat,
        "runs": [list(r) for r in runs],
        "stage_compile_wall_s": [round(w, 2) for w in walls],
        "stage_compile_cpu_s": [round(c, 2) for c in cpus],
        "unit_compile_wall_s": round(unit_wall, 2), "unit_compile_cpu_s": round(unit_cpu, 2),
        "flops_per_device": flops, "analytic_flops_per_device": analytic,
        "flops_ratio": round(flops / analytic, 4),
        "collective_bytes": by_axis,
    }


def run(model: str, repeat: int) -> dict:
    import jax

    from estimator.cells import Cell
    from estimator.estimate import partition_stages
    from estimator.jax_models import arch_from_model
    from estimator.models import load_model
    spec = load_model(model)
    arch = arch_from_model(spec)
    cell = Cell("a100", 8, 4, 2)
    ranges = partition_stages(spec, cell)
    rows = []
    for remat in (True, False):
        for start, end in ranges:
            for dp, tp in ((4, 1), (1, 4)):
                rows.append(_variant(arch, spec, start, end, dp, tp, 16, remat, repeat))
    best_cpu = [min(r["stage_compile_cpu_s"]) for r in rows]
    best_wall = [min(r["stage_compile_wall_s"]) for r in rows]
    return {
        "model": model, "cell": cell.label(), "jax": jax.__version__,
        "cpu_count": os.cpu_count(), "load_average": [round(v, 2) for v in os.getloadavg()],
        "variants": rows,
        "summary": {
            "stage_compile_cpu_s_max": max(best_cpu), "stage_compile_cpu_s_median": sorted(best_cpu)[len(best_cpu) // 2],
            "stage_compile_wall_s_max": max(best_wall),
            "flops_ratio_min": min(r["flops_ratio"] for r in rows),
            "flops_ratio_max": max(r["flops_ratio"] for r in rows),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    json.dump(run(args.model, args.repeat), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
