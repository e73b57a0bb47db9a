#!/usr/bin/env bash
# GPT-2 large performance on one GPU in one command, in under 7 minutes:
#
#   bash benchmarks/gpu/perf.sh            # on a GPU machine: ours with Megatron's defaults
#   bash benchmarks/gpu/perf.sh --plain    # our run with the fusions off (the plain path)
#   bash benchmarks/gpu/perf.sh --cpu      # the same steps, tiny, on CPU (PERF_MODE=cpu too)
#
#   a  environment; bf16 8192^3 matrix-product rate (the ceiling MFU is measured against)
#   o  ours, GPT-2 large (check.sh's step e) with the switches of benchmarks/gpu/perf.py
#      (OPTIMISED_FLAGS, or PLAIN_FLAGS with --plain): ms/iteration, TFLOP/s, MFU, peak memory,
#      and GPU kernel time by family from torch.profiler over two more iterations
#   h  transformers' GPT-2 large, eager (SDPA, bf16 autocast, fused AdamW)
#   c  the same under torch.compile
#   o.NAME  (opt-in) step o once more per variant of GPU_PERF_VARIANTS, after the steps above:
#      GPU_PERF_VARIANTS='compiled=--compile-transformer-layers;ce=--cross-entropy-loss-fusion'
#      (NAME=switches, ';' between variants; NAME is letters, digits, - and _). Each variant has
#      its own limit (GPU_PERF_VARIANT_LIMIT, default 150 s) and its row in both tables; a
#      failing variant does not stop the next one (the exit status says it failed)
#
# Each step has its own time limit; the script stops at the first step that fails and prints,
# last, the table of steps and the comparison table (also <log dir>/summary.txt and perf.txt).
# Logs go to $OUT when set, else runs/gpu-perf; figures in results.json there. Exit status 0 if
# every step passed. PYTHON picks the interpreter; GPU_CHECK_MBS the micro-batch (default 32, or
# 16 on a card under 100 GiB); GPU_PERF_OURS_FLAGS replaces our switches (a shell-quoted list);
# GPU_PERF_STEPS runs a subset of a, o, h, c (MFU needs a; h and c take o's micro-batch).
# The steps a-c take about 3 minutes on an H200 (limits 6.7); each variant 35-60 s more
# (model start-up and 12 iterations; a compiled variant its compile as well).
set -uo pipefail

MODE=${PERF_MODE:-gpu}
OURS=optimised
for arg in "$@"; do
    case "$arg" in
        --cpu) MODE=cpu ;;
        --gpu) MODE=gpu ;;
        --plain) OURS=plain ;;
        --optimised) OURS=optimised ;;
        *) echo "error: unknown argument '$arg' (use --cpu, --gpu, --plain or --optimised)" >&2
           exit 2 ;;
    esac
done
if [[ "$MODE" != gpu && "$MODE" != cpu ]]; then
    echo "error: PERF_MODE must be gpu or cpu (got '$MODE')" >&2
    exit 2
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
PY=${PYTHON:-$(command -v python || command -v python3)}
LOG_DIR=${OUT:-$REPO/runs/gpu-perf}
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR/results.json" "$LOG_DIR/summary.txt" "$LOG_DIR/perf.txt"

# id, time limit (s). The limits add up to 6.7 minutes at most (about 4 expected on an H200:
# model start-up ~30 s per run, the compile of step c 1-2 minutes). The CPU smoke run gets more
# for its start-ups on a shared 2-core machine (its tiny models train in seconds).
STEPS=(a o h c)
if [[ -n "${GPU_PERF_STEPS:-}" ]]; then  # a subset, e.g. 'a o' when the peers are known already
    read -r -a STEPS <<<"$GPU_PERF_STEPS"
    for id in "${STEPS[@]}"; do
        if [[ ! " a o h c " == *" $id "* ]]; then
            echo "error: GPU_PERF_STEPS: unknown step '$id' (steps: a o h c)" >&2
            exit 2
        fi
    done
fi
declare -A LIMIT=([a]=40 [o]=110 [h]=80 [c]=170)
if [[ "$MODE" == cpu ]]; then
    LIMIT=([a]=60 [o]=150 [h]=120 [c]=170)
fi
declare -A TITLE=(
    [a]="environment, bf16 matmul rate"
    [o]="GPT-2 large, ours ($OURS)"
    [h]="GPT-2 large, transformers eager"
    [c]="GPT-2 large, transformers compiled"
)
declare -A SWITCHES
VARIANTS=()
IFS=';' read -r -a SPECS <<<"${GPU_PERF_VARIANTS:-}"
for spec in "${SPECS[@]}"; do
    [[ -z "${spec// /}" ]] && continue
    name=${spec%%=*}
    name=${name// /}
    if [[ "$spec" != *=* || ! "$name" =~ ^[A-Za-z0-9_-]+$ || -n "${SWITCHES[o.$name]+x}" ]]; then
        echo "error: GPU_PERF_VARIANTS: '$spec' is not NAME=switches with a new NAME of letters," \
            "digits, - and _ (variants are separated by ';')" >&2
        exit 2
    fi
    VARIANTS+=("o.$name")
    SWITCHES[o.$name]=${spec#*=}
    TITLE[o.$name]="GPT-2 large, ours + $name"
    LIMIT[o.$name]=${GPU_PERF_VARIANT_LIMIT:-150}
done
declare -A STATUS ELAPSED FIGURES
START=$(date +%s)

run_helper() {  # run_helper <id> <limit>: perf.py's step under its limit, output in <id>.log
    local variant=()
    if [[ "$1" == o.* ]]; then
        variant=(--variant "${1#o.}" --switches "${SWITCHES[$1]}")
    fi
    timeout -k 5 "$2" "$PY" "$REPO/benchmarks/gpu/perf.py" "${1%%.*}" --mode "$MODE" \
        --ours "$OURS" --log-dir "$LOG_DIR" --limit "$2" "${variant[@]}" >"$LOG_DIR/$1.log" 2>&1
}

print_tables() {
    run_helper report 30
    {
        echo
        echo "GPU perf ($MODE mode, ours $OURS): $(($(date +%s) - START)) s in all; logs in $LOG_DIR"
        printf '%-4s %-36s %-8s %7s  %s\n' step check result seconds figures
        for id in "${STEPS[@]}" "${VARIANTS[@]}"; do  # a variant's row: o+ and its name
            printf '%-4s %-36s %-8s %7s  %s\n' "$([[ $id == o.* ]] && echo o+ || echo "$id")" \
                "${TITLE[$id]}" "${STATUS[$id]:-not run}" "${ELAPSED[$id]:--}" "${FIGURES[$id]:-}"
        done
        echo
        cat "$LOG_DIR/perf.txt" 2>/dev/null || echo "(no comparison table: see $LOG_DIR/report.log)"
    } | tee "$LOG_DIR/summary.txt"
}
trap print_tables EXIT

run_step() {
    local id=$1 limit=${LIMIT[$1]} begin end rc figures
    echo "[$id] ${TITLE[$id]} (limit ${limit} s) ..."
    begin=$(date +%s.%N)
    run_helper "$id" "$limit"
    rc=$?
    end=$(date +%s.%N)
    ELAPSED[$id]=$(awk -v b="$begin" -v e="$end" 'BEGIN { printf "%.1f", e - b }')
    figures=$(grep '^RESULT: ' "$LOG_DIR/$id.log" | tail -n 1 | cut -c 9-)
    case $rc in
        0) STATUS[$id]=PASS ;;
        124 | 137) STATUS[$id]=TIMEOUT; figures=${figures:-killed at the ${limit} s limit} ;;
        *) STATUS[$id]=FAIL ;;
    esac
    if [[ -z "$figures" ]]; then
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
FAILED=0
for id in "${VARIANTS[@]}"; do
    run_step "$id" || FAILED=1
done
exit $FAILED
