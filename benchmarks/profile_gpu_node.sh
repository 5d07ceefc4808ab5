#!/usr/bin/env bash
# Profile one GPU node with the profiling job's own program, as `slurm-ext profile` runs it
# on each node, then measure a few plans on the same device, for docs/profiling.md
# ("Profiled against measured on a GPU"). Run from the repository root on the GPU machine:
#
#   OUT=/tmp/profile-gpu bash benchmarks/profile_gpu_node.sh
#
# Steps, in order of priority, each cut to what is left of TOTAL_S (default 500 s):
#  1. profile $MODEL (default gpt-760m) at tp 1-8, default XLA flags (benchmarks/profile_cost.py: seconds by
#     part and the profiler's progress lines) into $OUT/profile.sqlite;
#  2. benchmarks/plan_measure.py: the model at global batch 8, three one-GPU plans; then
#     (steps plan_13b, plan_moe1, plan_wrn1) one one-GPU plan each of gpt-1.3b, moe-690m
#     and wide_resnet-500m: the other families' optimizers (AdamW, Adafactor, SGD);
#  3. the same profile with XLA's autotuning off (--xla_gpu_autotune_level=0) into
#     $OUT/profile_autotune0.sqlite: what autotuning costs, and whether the layer times
#     it measures differ from step 1's;
#  4. the same profile with XLA's Triton GEMMs off (--xla_gpu_enable_triton_gemm=false:
#     cuBLAS matmuls, whose autotuning is a short algorithm pick) into
#     $OUT/profile_no_triton.sqlite, and step 1 again at tp 1 alone
#     ($OUT/profile_tp1.sqlite), the baseline on the same machine.
#  5. on a node of two or more GPUs, benchmarks/plan_measure.py: moe-690m at global batch 8
#     on two GPUs, with its experts replicated (dp2tp1), split over dp (dp2tp1ep) and over
#     tp (dp1tp2): the expert-parallel step and memory against their estimates; and
#     gpt-760m at global batch 16 on two GPUs, dp2tp1 with and without ZeRO-1.
#  6. the profile with autotuning at level 1 (--xla_gpu_autotune_level=1: candidates still
#     timed, without the buffer initialisation and the correctness check of the default
#     level 4) into $OUT/profile_autotune1.sqlite: whether it costs less and measures the
#     same layer times as step 1 (compare with benchmarks/profile_compare.py).
# STEPS (default: profile plan plan_13b plan_moe1 plan_wrn1 plan_moe plan_zero profile_autotune1) picks some, e.g.
# STEPS="profile_no_triton profile_tp1" (steps 3 and 4, already measured on an H100).
# Also writes summary.txt (exit code and wall seconds of each step) and steps.log (every
# step's output).
# Compare on any machine with
#   python benchmarks/profile_accuracy.py --gpu-type GPU --profile-db $OUT/profile.sqlite
set -u
OUT=${OUT:?set OUT to a directory for the results}
TOTAL_S=${TOTAL_S:-500}
MODEL=${MODEL:-gpt-760m}
deadline=$(( $(date +%s) + TOTAL_S ))
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$name" in *H200*) gpu=h200 ;; *H100*) gpu=h100 ;; *A100*) gpu=a100 ;; *) gpu=${GPU_TYPE:?unknown GPU "$name": set GPU_TYPE} ;; esac
echo "device=$name gpu_type=$gpu jax=$("$PY" -c 'import jax; print(jax.__version__)')" | tee "$OUT/summary.txt"

STEPS=${STEPS:-profile plan plan_13b plan_moe1 plan_wrn1 plan_moe plan_zero profile_autotune1}
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)

# step NAME MAX_S COMMAND...: run COMMAND under the smaller of MAX_S and the time left
step() {
    local name=$1 max_s=$2; shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local left=$(( deadline - $(date +%s) ))
    local limit=$(( max_s < left ? max_s : left ))
    if (( limit < 30 )); then echo "$name skipped: ${left} s left" | tee -a "$OUT/summary.txt"; return; fi
    local t0; t0=$(date +%s)
    echo "=== $name: $*" >> "$OUT/steps.log"
    timeout "$limit" "$@" >> "$OUT/steps.log" 2>&1
    echo "$name rc=$? wall_s=$(( $(date +%s) - t0 )) limit_s=$limit" | tee -a "$OUT/summary.txt"
}

step profile 260 "$PY" benchmarks/profile_cost.py --profile-db "$OUT/profile.sqlite" --gpu-type "$gpu" \
    --model "$MODEL" --max-tp 8 --budget-s 220 --json "$OUT/cost.json"
step plan 170 "$PY" benchmarks/plan_measure.py --model "$MODEL" --global-batch 8 --gpu-type "$gpu" \
    --plans "cell=${gpu}x1:s1 plan=[dp1tp1] mb=1 remat=1" "cell=${gpu}x1:s1 plan=[dp1tp1] mb=1 remat=0" \
            "cell=${gpu}x1:s1 plan=[dp1tp1] mb=2 remat=1" \
    --init zeros --steps 10 --plan-timeout-s 80 --json "$OUT/plan.json"
# One-GPU plans of the other families (their optimizers differ: AdamW, Adafactor, SGD),
# each one that benchmarks/results_memory_gpu_target.json compiled for a GPU target.
step plan_13b 110 "$PY" benchmarks/plan_measure.py --model gpt-1.3b --global-batch 8 --gpu-type "$gpu" \
    --plans "cell=${gpu}x1:s1 plan=[dp1tp1] mb=2 remat=1" --init zeros --steps 10 --plan-timeout-s 100 \
    --json "$OUT/plan_13b.json"
step plan_moe1 110 "$PY" benchmarks/plan_measure.py --model moe-690m --global-batch 8 --gpu-type "$gpu" \
    --plans "cell=${gpu}x1:s1 plan=[dp1tp1] mb=2 remat=1" --init zeros --steps 10 --plan-timeout-s 100 \
    --json "$OUT/plan_moe1.json"
step plan_wrn1 110 "$PY" benchmarks/plan_measure.py --model wide_resnet-500m --global-batch 32 --gpu-type "$gpu" \
    --plans "cell=${gpu}x1:s1 plan=[dp1tp1] mb=2 remat=1" --init zeros --steps 10 --plan-timeout-s 100 \
    --json "$OUT/plan_wrn1.json"
step profile_autotune0 150 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" "$PY" benchmarks/profile_cost.py --profile-db "$OUT/profile_autotune0.sqlite" \
    --gpu-type "$gpu" --model "$MODEL" --max-tp 8 --budget-s 120 --skip-collectives --json "$OUT/cost_autotune0.json"
step profile_no_triton 150 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" "$PY" benchmarks/profile_cost.py \
    --profile-db "$OUT/profile_no_triton.sqlite" --gpu-type "$gpu" --model "$MODEL" --max-tp 8 --budget-s 120 \
    --skip-collectives --json "$OUT/cost_no_triton.json"
step profile_tp1 120 "$PY" benchmarks/profile_cost.py --profile-db "$OUT/profile_tp1.sqlite" --gpu-type "$gpu" \
    --model "$MODEL" --max-tp 1 --skip-collectives --json "$OUT/cost_tp1.json"
if (( gpus >= 2 )); then
    step plan_moe 200 "$PY" benchmarks/plan_measure.py --model moe-690m --global-batch 8 --gpu-type "$gpu" \
        --plans "cell=${gpu}x2:s1 plan=[dp2tp1] mb=1 remat=1" "cell=${gpu}x2:s1 plan=[dp2tp1ep] mb=1 remat=1" \
                "cell=${gpu}x2:s1 plan=[dp1tp2] mb=1 remat=1" \
        --init zeros --steps 10 --plan-timeout-s 120 --json "$OUT/plan_moe.json"
    step plan_zero 280 "$PY" benchmarks/plan_measure.py --model "$MODEL" --global-batch 16 --gpu-type "$gpu" \
        --plans "cell=${gpu}x2:s1 plan=[dp2tp1] mb=2 remat=1" "cell=${gpu}x2:s1 plan=[dp2tp1] mb=2 remat=1 zero=1" \
                "cell=${gpu}x2:s1 plan=[dp2tp1] mb=2 remat=1 zero=2" "cell=${gpu}x2:s1 plan=[dp2tp1] mb=2 remat=1 zero=3" \
        --init zeros --steps 10 --plan-timeout-s 70 --json "$OUT/plan_zero.json"
else
    echo "plan_moe, plan_zero skipped: $gpus GPU(s), they need two" | tee -a "$OUT/summary.txt"
fi
step profile_autotune1 200 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=1" "$PY" benchmarks/profile_cost.py \
    --profile-db "$OUT/profile_autotune1.sqlite" --gpu-type "$gpu" --model "$MODEL" --max-tp 8 --budget-s 180 \
    --skip-collectives --json "$OUT/cost_autotune1.json"
