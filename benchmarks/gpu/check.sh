#!/usr/bin/env bash
# Every GPU check in one command, on one GPU, in under 8 minutes:
#
#   bash benchmarks/gpu/check.sh            # on a GPU machine (PyTorch with CUDA, NCCL)
#   bash benchmarks/gpu/check.sh --cpu      # the same steps, tiny, on CPU (CHECK_MODE=cpu too)
#
#   a  environment; bf16 8192^3 matrix-product rate (the ceiling MFU is measured against)
#   b  2-layer GPT, fp32, --use-cpu-initialization, 10 iterations: GPU losses = CPU losses (1e-5)
#   c  GPT, BERT, T5 and MoE in bf16, 10 iterations each: loss finite and falling
#   d  an exception injected at iteration 3 ends the job within 30 s, with its traceback
#   e  GPT-2 large, 10 iterations, micro-batch 32 = global batch, bf16: ms/iteration, TFLOP/s,
#      MFU against a, peak memory
#   f  the same model in transformers (SDPA, bf16 autocast, fused AdamW): ours/transformers
#
# Each step has its own time limit (90 s or less); the script stops at the first step that fails
# and prints a table of every step last (also in <log dir>/summary.txt). Logs go to $OUT when OUT
# is set, else runs/gpu-check; each step's figures are in results.json there. It runs
# from the checkout (PYTHONPATH is set here); no network is used. Exit status 0 if every step
# passed. PYTHON picks the interpreter; GPU_CHECK_MBS the micro-batch of steps e and f.
set -uo pipefail

MODE=${CHECK_MODE:-gpu}
for arg in "$@"; do
    case "$arg" in
        --cpu) MODE=cpu ;;
        --gpu) MODE=gpu ;;
        *) echo "error: unknown argument '$arg' (use --cpu or --gpu)" >&2; exit 2 ;;
    esac
done
if [[ "$MODE" != gpu && "$MODE" != cpu ]]; then
    echo "error: CHECK_MODE must be gpu or cpu (got '$MODE')" >&2
    exit 2
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # transformers builds from a config: nothing to fetch
PY=${PYTHON:-$(command -v python || command -v python3)}
LOG_DIR=${OUT:-$REPO/runs/gpu-check}
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR/results.json" "$LOG_DIR/summary.txt"

# id, time limit (s), what it checks. The limits add up to 7.9 minutes at most.
STEPS=(a b c d e f)
declare -A LIMIT=([a]=45 [b]=80 [c]=90 [d]=75 [e]=90 [f]=90)
declare -A TITLE=(
    [a]="environment, bf16 matmul rate"
    [b]="2-layer GPT fp32: GPU = CPU losses"
    [c]="GPT, BERT, T5, MoE bf16: loss falls"
    [d]="exception at iteration 3: job ends"
    [e]="GPT-2 large, ours"
    [f]="GPT-2 large, transformers"
)
declare -A STATUS ELAPSED FIGURES
START=$(date +%s)

print_table() {
    {
        echo
        echo "GPU check ($MODE mode): $(($(date +%s) - START)) s in all; logs in $LOG_DIR"
        printf '%-4s %-36s %-8s %7s  %s\n' step check result seconds figures
        for id in "${STEPS[@]}"; do
            printf '%-4s %-36s %-8s %7s  %s\n' "$id" "${TITLE[$id]}" "${STATUS[$id]:-not run}" \
                "${ELAPSED[$id]:--}" "${FIGURES[$id]:-}"
        done
    } | tee "$LOG_DIR/summary.txt"
}
trap print_table EXIT

# run_step <id>: the step's helper under its time limit, its output in <log dir>/<id>.log.
run_step() {
    local id=$1 limit=${LIMIT[$1]} begin end rc figures
    echo "[$id] ${TITLE[$id]} (limit ${limit} s) ..."
    begin=$(date +%s.%N)
    timeout -k 5 "$limit" "$PY" "$REPO/benchmarks/gpu/steps.py" "$id" --mode "$MODE" \
        --log-dir "$LOG_DIR" --limit "$limit" >"$LOG_DIR/$id.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    ELAPSED[$id]=$(awk -v b="$begin" -v e="$end" 'BEGIN { printf "%.1f", e - b }')
    figures=$(grep '^RESULT: ' "$LOG_DIR/$id.log" | tail -n 1 | cut -c 9-)
    case $rc in
        0) STATUS[$id]=PASS ;;
        124 | 137) STATUS[$id]=TIMEOUT; figures=${figures:-killed at the ${limit} s limit} ;;
        *) STATUS[$id]=FAIL ;;
    esac
    if [[ -z "$figures" ]]; then  # no RESULT line: the helper itself broke; its last words
        figures=$(grep -v '^\s*$' "$LOG_DIR/$id.log" | tail -n 1 | cut -c 1-160)
    fi
    FIGURES[$id]=$figures
    echo "[$id] ${STATUS[$id]} in ${ELAPSED[$id]} s: $figures"
    [[ $rc -eq 0 ]]
}

for id in "${STEPS[@]}"; do
    if ! run_step "$id"; then
        echo "stopping at step $id; its log: $LOG_DIR/$id.log" >&2
        exit 1
    fi
done
exit 0
