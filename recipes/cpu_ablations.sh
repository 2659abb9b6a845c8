#!/usr/bin/env bash
# The small-size ablations of docs/quality.md (2 CPU cores): one flag each over configs/default.yaml on the rows
# of runs/demo400/data (make pipeline into that data dir with the default config of then: prepare.num_samples 400),
# then one 05 over all. The figures were measured in float32, before bf16 became the default on a CPU with AMX:
# add --dtype float32 to 03 and 04 to reproduce them.
set -u
cd "$(dirname "$0")/.."
export EAGLE3_CACHE=$PWD/.cache/eagle3 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CACHE_ROOT=$PWD/.cache/vllm
PY=.venv/bin/python; D=runs/demo400/data; C=configs/default.yaml; O=runs/abl
$PY 02_build_vocab_mapping.py --config $C --data-dir $D --draft-vocab-size 16384 --output-dir $O/v16k_map
t() { n=$1; shift; s=$(date +%s); $PY 04_train.py --config $C --data-dir $D --output-dir $O/$n "$@" > $O/$n.log 2>&1; echo "$(date +%T) $n rc $? $(( $(date +%s) - s ))s: $(tail -1 $O/$n.log | cut -c1-200)"; }
t ttt5 --ttt-steps 5
t lk --loss lk_hybrid
t l2 --draft-layers 2
t v16k --vocab-mapping-dir $O/v16k_map
$PY 05_evaluate.py --config $C --data-dir $D --draft-path runs/demo400/out/checkpoints/best \
  --compare $O/ttt5/checkpoints/best $O/lk/checkpoints/best $O/l2/checkpoints/best $O/v16k/checkpoints/best \
  --output-dir $O/eval --num-prompts 24 > $O/eval.log 2>&1
echo "$(date +%T) eval rc $?: $(tail -1 $O/eval.log | cut -c1-300)"
# second part (2026-12-04, later): noise and the schedule, float32 as the runs above
O2=runs/abl2; mkdir -p $O2
t2() { n=$1; shift; $PY 04_train.py --config $C --data-dir $D --output-dir $O2/$n --dtype float32 "$@" > $O2/$n.log 2>&1; echo "$(date +%T) $n rc $?"; }
t2 noise05 --noise-std 0.05
t2 noise2 --noise-std 0.2
t2 linear --scheduler linear
$PY 05_evaluate.py --config $C --data-dir $D --draft-path runs/demo400/out/checkpoints/best \
  --compare $O2/noise05/checkpoints/best $O2/noise2/checkpoints/best $O2/linear/checkpoints/best \
  --output-dir $O2/eval --num-prompts 24 --max-new-tokens 96 > $O2/eval.log 2>&1
echo "$(date +%T) eval rc $?: $(tail -1 $O2/eval.log | cut -c1-300)"
