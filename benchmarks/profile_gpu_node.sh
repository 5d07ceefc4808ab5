#!/usr/bin/env bash
# Profile one GPU node with the profiling job's own program, as `slurm-ext profile` runs it
# on each node, then re-measure one plan on the same device, for docs/profiling.md
# ("Profiled against measured on a GPU"). Run from the repository root on the GPU machine:
#
#   OUT=/tmp/profile-gpu bash benchmarks/profile_gpu_node.sh
#
# Writes into $OUT: profile.sqlite (the store), one log per model, summary.txt (exit code
# and wall seconds of each part), cost_<model>.json (benchmarks/profile_cost.py: seconds by
# part and the profiler's progress lines; the one-by-one baseline adds --compile-workers 1)
# and plan_gpt-760m.json. Compare on any machine with
#   python benchmarks/profile_accuracy.py --profile-db $OUT/profile.sqlite
set -u
OUT=${OUT:?set OUT to a directory for the results}
BUDGET_S=${BUDGET_S:-300}   # measuring seconds per model run (kernels included)
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
PY=${PYTHON:-python3}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in *H200*) gpu=h200 ;; *H100*) gpu=h100 ;; *A100*) gpu=a100 ;; *) gpu=${GPU_TYPE:?unknown GPU $name: set GPU_TYPE} ;; esac
echo "device=$name gpu_type=$gpu" | tee "$OUT/summary.txt"
skip=()
for model in gpt-760m gpt-1.3b; do
    t0=$(date +%s)
    timeout $((BUDGET_S + 90)) "$PY" benchmarks/profile_cost.py --profile-db "$OUT/profile.sqlite" --gpu-type "$gpu" \
        --model "$model" --max-tp 8 --budget-s "$BUDGET_S" "${skip[@]}" --json "$OUT/cost_$model.json" \
        > "$OUT/profile_$model.log" 2>&1
    echo "profile $model rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
    skip=(--skip-collectives)   # one device: no collectives; the kernels are re-timed each run
done
t0=$(date +%s)
timeout 150 "$PY" benchmarks/plan_measure.py --model gpt-760m --global-batch 8 --gpu-type "$gpu" \
    --plans "cell=${gpu}x1:s1 plan=[dp1tp1] mb=1 remat=1" --init zeros --steps 10 \
    --json "$OUT/plan_gpt-760m.json" > "$OUT/plan_gpt-760m.log" 2>&1
echo "plan_measure gpt-760m rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/plan_gpt-760m.log"
