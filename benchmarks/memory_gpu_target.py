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
"""

import argparse
import json
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
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    n = parse_plan(plan_text).num_gpus
    topo = topologies.get_topology_desc(platform="cuda", target_config=Path(spec_path).read_text(),
                                        topology=f"1x1x{n}")
    jax.config.update("jax_platforms", "cpu")
    arch = jm.builtin_arch(model)
    plan, _, _ = plan_from_string(plan_text, load_model(model), arch, global_batch, n)
    pipe = Pipeline(arch, plan, list(topo.devices), global_batch, optimizer_for(arch.optimizer))
    m = pipe.compile().memory_analysis()
    gb = {k: round(getattr(m, k) / 1e9, 4) for k in
          ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
           "peak_memory_in_bytes")}
    return {"model": model, "global_batch": global_batch, "plan": plan_text, "target": Path(spec_path).stem,
            "jax_version": jax.__version__, "compiled_gb": gb, "compiled_peak_gb": gb["peak_memory_in_bytes"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec")
    ap.add_argument("--model")
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--plan")
    ap.add_argument("--collect", help="a file of rows printed by earlier runs")
    args = ap.parse_args(argv)
    if args.collect:
        rows = [json.loads(line) for line in Path(args.collect).read_text().splitlines() if line.strip()]
        OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        print(f"{len(rows)} rows -> {OUT}")
        return 0
    print(json.dumps(compile_plan(args.spec, args.model, args.global_batch, args.plan)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
