#!/bin/bash
# The six layouts of examples/gpt2/train_gpt2_large.sh (baseline, dp2, tp2, sp2, cp2, pp2) on a
# tiny GPT on CPU processes, one after the other, then one plot of all their curves:
#   runs/ablate-cpu/<layout>.log   the training logs, side by side
#   runs/ablate-cpu/ablation.png   loss, learning rate, grad norm, time per iteration
# Same model, data, global batch and seed in every layout, no dropout: the loss curves should
# coincide up to floating-point reduction order. A layout that fails stops the script with the
# end of its log.
#
#   bash examples/gpt2/ablate_cpu.sh                  # mock data
#   DATA_PATH=runs/data/corpus_text_document bash examples/gpt2/ablate_cpu.sh
# Overridable: OUT ITERS NUM_LAYERS HIDDEN HEADS SEQ MBS GBS LR LAYOUTS PYTHON
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-runs/ablate-cpu}
LAYOUTS=${LAYOUTS:-baseline dp2 tp2 sp2 cp2 pp2}
PYTHON=${PYTHON:-python}
export PYTHON
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export NUM_LAYERS=${NUM_LAYERS:-4} HIDDEN=${HIDDEN:-128} HEADS=${HEADS:-4} SEQ=${SEQ:-128}
export MBS=${MBS:-4} GBS=${GBS:-16} ITERS=${ITERS:-40} LR=${LR:-1e-3}
export PRECISION=fp32 NUM_WORKERS=0 LOG_INTERVAL=1 EVAL_ITERS=0 LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-4}
mkdir -p "$OUT"

ran=()
for layout in $LAYOUTS; do
    rm -rf "${OUT:?}/$layout" "$OUT/$layout.log"
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    echo "=== $layout: training (log: $OUT/$layout.log)"
    start=$SECONDS
    if LAYOUT=$layout RUN_ROOT=$OUT MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            bash examples/gpt2/train_gpt2_large.sh > /dev/null 2>&1; then
        ran+=("$layout")
        grep -E " iteration +$ITERS/" "$OUT/$layout.log" | sed -E 's/.*(lm loss: [^|]*).*/    final \1/' || true
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
    --title "tiny GPT on CPU ($NUM_LAYERS layers, hidden $HIDDEN, seq $SEQ, global batch $GBS): ${ran[*]}"
