"""Compile the runner's program (``job_scripts.pipeline.Pipeline``) for an XLA GPU target on
a CPU-only machine and record its ``memory_analysis()``: what the runner holds on a GPU,
without one. Needs the ``gpu-target`` extra and an XLA target spec (e.g.
``h100_sxm.txtpb``; ``tests/test_compiled.py`` has the fields a compile needs).

One plan per process (the CUDA plugin's compile-only topology must come before the CPU
backend)::

    JAX_PLATFORMS=cpu PATH=<venv>/site-packages/nvidia/cuda_nvcc/bin:$PATH \\
    python benchmarks/memory_gpu_target.py --spec h100_sxm.txtpb --model gpt-760m \\
        --global-batch 8 --plan 'cell=h100x1:s1 plan=[dp1tp1] mb=1 remat=1' >> rows.jsonl

prints one JSON row; ``--collect rows.jsonl`` writes ``results_memory_gpu_target.json``.
Each row names the runner's ``PROGRAM_REVISION`` it compiled; ``--compare OLD.json`` prints
each plan's peak in OLD beside the current file's (or ``--with NEW``'s), with the ratio's
median, mean and worst (largest): ``results_memory_gpu_target_rev1.json`` is the program
before the in-place optimizer update, ``_rev2`` the one before the loss ran inside the
last layer's checkpoint, ``_rev3`` the one before pipelines split alike updated outside
their stage switch, ``_rev4`` the one before a pipeline's zero rows were made inside its
step (revision 5 changed only pipelines), ``_rev5`` the one before AdamW's flat update
stepped in pieces (revision 6, every plan compiled again), ``_rev6`` the one before a
single stage's update stepped in pieces too (revision 7, the single stages compiled
again), ``_rev7`` the one before a pipeline's backward packed its gradients layer by
layer (revision 8, the pipelines compiled again), ``_rev8`` the one before a single stage
summed its micro-batches' gradients array by array (revision 9, its 20 single stages over
several micro-batches compiled again with XLA's H100 target spec)::

    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev1.json \
        --with benchmarks/results_memory_gpu_target_rev2.json
    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev2.json \
        --with benchmarks/results_memory_gpu_target_rev3.json
    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev3.json \
        --with benchmarks/results_memory_gpu_target_rev4.json
    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev4.json \
        --with benchmarks/results_memory_gpu_target_rev5.json
    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev5.json \
        --with benchmarks/results_memory_gpu_target_rev6.json
    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev6.json \
        --with benchmarks/results_memory_gpu_target_rev7.json
    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev7.json \
        --with benchmarks/results_memory_gpu_target_rev8.json
    python benchmarks/memory_gpu_target.py --compare benchmarks/results_memory_gpu_target_rev8.json
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent / "results_memory_gpu_target.json"


def compile_plan(spec_path: str, model: str, global_batch: int, plan_text: str) -> dict:
    import jax
    from jax.experimental import topologies

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.pipeline import PROGRAM_REVISION, Pipeline
    from job_scripts.plan import plan_from_string
    from job_scripts.precision import training_arch

    n = parse_plan(plan_text).num_gpus
    topo = topologies.get_topology_desc(platform="cuda", target_config=Path(spec_path).read_text(),
                                        topology=f"1x1x{n}")
    jax.config.update("jax_platforms", "cpu")
    arch = training_arch(jm.builtin_arch(model), parse_plan(plan_text).gpu_type)  # the runner's dtype there
    plan, _, _ = plan_from_string(plan_text, load_model(model), arch, global_batch, n)
    pipe = Pipeline(arch, plan, list(topo.devices), global_batch, optimizer_for(arch.optimizer))
    m = pipe.compile().memory_analysis()
    gb = {k: round(getattr(m, k) / 1e9, 4) for k in
          ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
           "peak_memory_in_bytes")}
    return {"model": model, "global_batch": global_batch, "plan": plan_text, "target": Path(spec_path).stem,
            "gpu_type": parse_plan(plan_text).gpu_type,
            "jax_version": jax.__version__, "compiled_gb": gb, "compiled_peak_gb": gb["peak_memory_in_bytes"],
            "program_revision": PROGRAM_REVISION}


def compare(old_path: str, new_path: Path = OUT) -> dict:
    """Per plan compiled in both files, the peak before (``old_path``) and now
    (``new_path``), and now ÷ before."""
    def by_plan(path):
        rows = json.loads(Path(path).read_text())["rows"]
        return {(r["target"], r["model"], r["global_batch"], r["plan"]): r for r in rows}
    before, now = by_plan(old_path), by_plan(new_path)
    rows = [{"model": k[1], "global_batch": k[2], "plan": k[3], "target": k[0],
             "before_gb": before[k]["compiled_peak_gb"], "now_gb": now[k]["compiled_peak_gb"],
             "ratio": round(now[k]["compiled_peak_gb"] / before[k]["compiled_peak_gb"], 4)}
            for k in before if k in now]
    def summary(ratios):
        return {"rows": len(ratios), "median": statistics.median(ratios), "mean": round(statistics.fmean(ratios), 4),
                "worst": max(ratios), "best": min(ratios)}
    # The plans the in-place update applies to: AdamW (gpt) and SGD (wide_resnet) at ZeRO-0
    # (Adafactor's MoE steps layer by layer; ZeRO-1 was flat from the start).
    flat = [r["ratio"] for r in rows if not r["model"].startswith("moe") and "zero=" not in r["plan"]]
    return {"before": Path(old_path).name, "now": Path(new_path).name, "rows": rows,
            "ratio": summary([r["ratio"] for r in rows]), "ratio_adamw_sgd_zero0": summary(flat)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec")
    ap.add_argument("--model")
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--plan")
    ap.add_argument("--collect", help="a file of rows printed by earlier runs")
    ap.add_argument("--compare", metavar="OLD", help="an earlier results file to compare the current one with")
    ap.add_argument("--with", dest="new", metavar="NEW", type=Path, default=OUT,
                    help="with --compare: the later results file (default: the current one)")
    args = ap.parse_args(argv)
    if args.compare:
        print(json.dumps(compare(args.compare, args.new), indent=1))
        return 0
    if args.collect:
        rows = [json.loads(line) for line in Path(args.collect).read_text().splitlines() if line.strip()]
        OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        print(f"{len(rows)} rows -> {OUT}")
        return 0
    print(json.dumps(compile_plan(args.spec, args.model, args.global_batch, args.plan)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
