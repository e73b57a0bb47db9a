#!/bin/bash
# MoE ablation on CPU: the tiny MoE GPT of tiny_moe_cpu.sh at EP=1, EP=2 and EP=2 x TP=2, then
# one plot of their curves (runs/ablate-moe-cpu/ablation.png). Same model, data and seed, no
# dropout, dropless routing: the curves should coincide up to reduction order.
#   bash examples/mixtral/ablate_moe_cpu.sh            # mock data
#   DATA_PATH=runs/data/corpus_text_document bash examples/mixtral/ablate_moe_cpu.sh
# Overridable: OUT LAYOUTS and tiny_moe_cpu.sh's variables.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-runs/ablate-moe-cpu}
LAYOUTS=${LAYOUTS:-ep1 ep2 ep2tp2}
PYTHON=${PYTHON:-python}
export PYTHON
ran=()
for layout in $LAYOUTS; do
    echo "=== $layout: training (log: $OUT/$layout.log)"
    start=$SECONDS
    if LAYOUT=$layout RUN_ROOT=$OUT bash examples/mixtral/tiny_moe_cpu.sh; then
        ran+=("$layout")
        echo "    took $((SECONDS - start)) s"
    else
        echo "error: layout $layout failed; last lines of $OUT/$layout.log:" >&2
        tail -20 "$OUT/$layout.log" >&2
        exit 1
    fi
done
logs=()
for layout in "${ran[@]}"; do logs+=("$OUT/$layout.log"); done
"$PYTHON" tools/plot_logs.py "${logs[@]}" --labels "${ran[@]}" --output "$OUT/ablation.png" \
    --title "tiny MoE GPT on CPU (4 experts, top-2): ${ran[*]}"
