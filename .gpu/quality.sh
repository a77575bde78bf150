#!/usr/bin/env bash
# The decision set of docs/evidence.md on one lent GPU: JOBS runs at once, two gloo ranks each on GPU 0
# (--device cuda-shared, bf16 autocast), each through `python -m gpt2_bench.evidence run ...`, so that its
# curve file (command, commit, torch, machine) lands in docs/rows/evidence/ as on the CPU.
#
# Here, first:  python -m gpt2_bench.data --dataset mix --cache-dir .gpu/data   (the device has no corpus packages)
# Then, with the device tool:  bash .gpu/quality.sh   carrying [".gpu/data"], timeout_s about MAXT + 60 (MAXT: 510).
# Everything comes back in one file, $OUT/quality.tar (the tool returns at most 8 files, none deeper than 2 folders):
#   tar -xf /work/.device/N/quality.tar -C /tmp/gpu && cp -r /tmp/gpu/rows/* docs/rows/evidence/
# then `python -m gpt2_bench.evidence rebuild`. A GPU's curve files end in -gpu.json and pair only with each other
# (gpt2_bench/evidence). Nothing resumes across calls (a checkpoint does not fit the way back), so a call runs what
# finishes in it: six runs at once reached step 799 of 2,000 in 430 s at 1x; at 16x a run trains its 125 steps in
# about 20 s, and its start and evaluations take most of its time. So by default a call runs the 16x decision set:
# plain's sweep (LR) with tagc.hook() at each rate on seed 0 (RUNS, SEEDS), then THEN's runs (method:seed, in order
# of worth) at plain's best rate among this call's rows, as many as the time left fits by the first part's pace
# (a run cut short is wasted). BATCH 1x / 4x / 16x (several: one after the other, each given MAXT; THEN follows
# the last). JOBS (default 6) caps the runs at once: at 16x each rank held up to 10 GiB, and 16 runs at once ran out
# of an H200's memory. E.g. the 4x sweep: BATCH=4x LR="5e-4 1e-3 2e-3" THEN= MAXT=420 bash .gpu/quality.sh
# GPU_CHECK=1 first runs `python -m tagc.bench gpu-check --skip-tests` (its time comes off MAXT).
# DEVICE=cpu MAXT=60 OUT=/tmp/q RUNS=plain LR=1e-3 THEN= bash .gpu/quality.sh smoke-tests it here.
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
MAXT=${MAXT:-510}
BATCH=${BATCH:-16x}
LR=${LR:-"2.5e-4 5e-4 1e-3"}
SEEDS=${SEEDS:-0}
RUNS=${RUNS:-"plain tagc"}
THEN=${THEN-"topk:0 plain:1 tagc:1 topk:1 plain:2 tagc:2 topk:2 plain:3 tagc:3 topk:3 int4:0 int4:1 topk-dense:2 topk-dense:3
topk-4ranks:2 topk-4ranks:3 topk-4ranks-share:2 topk-4ranks-share:3 tagc-brief:0 tagc-brief:1 tagc-brief:2 tagc-brief:3 powersgd-r16:0 powersgd-r16:1 tagc-ratio2.25:0 tagc-ratio2.25:1"}
THEN=$(echo $THEN)  # one line: python reads it inside a string literal
JOBS=${JOBS:-6}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
python -c "import torch; print('torch', torch.__version__)"
mkdir -p "$OUT/logs" "$OUT/rows"

snapshot() { tar -cf "$OUT/quality.part" -C "$OUT" rows logs 2>/dev/null && mv "$OUT/quality.part" "$OUT/quality.tar"; }
(while sleep 20; do snapshot; done) & snapper=$!; disown  # a call cut at its limit still brings back what finished

launch() {  # launch METHOD SEED BATCH LR MAX_TIME: one run in the background, once fewer than JOBS run
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  python -m gpt2_bench.evidence run "$1" --seed "$2" --batch "$3" --lr "$4" --work "$OUT/work" --rows "$OUT/rows" \
    -- --device "${DEVICE:-cuda-shared}" --dataset .gpu/data/mix --max-time "$5" > "$OUT/logs/$1-$3-s$2-lr$4.txt" 2>&1 &
}

if [ -n "$GPU_CHECK" ]; then
  began=$SECONDS
  timeout 150 python -m tagc.bench gpu-check --skip-tests --json "$OUT/logs/gpu-check.json" > "$OUT/logs/gpu-check.txt" 2>&1
  echo "gpu-check rc=$?" >> "$OUT/logs/gpu-check.txt"; grep -v "^\s\|Warning\|check_internals" "$OUT/logs/gpu-check.txt"
  MAXT=$((MAXT - (SECONDS - began)))
fi
for batch in $BATCH; do
  began=$SECONDS
  for lr in $LR; do for s in $SEEDS; do for r in $RUNS; do launch "$r" "$s" "$batch" "$lr" "$MAXT"; done; done; done
  wait
  echo "$batch: $((SECONDS - began)) s"
done
if [ -n "$THEN" ]; then
  took=$((SECONDS - began)); first=$(( $(echo $RUNS | wc -w) * $(echo $LR | wc -w) * $(echo $SEEDS | wc -w) ))
  waves=$(( (first + JOBS - 1) / JOBS ))
  lr=$(python -c "from pathlib import Path; from gpt2_bench.evidence import best_lr, load
print(best_lr(load(Path('$OUT/rows')), '$batch') or '')")
  left=$((MAXT - took - 15))
  fits=$((left * waves * JOBS * 10 / (took * 12 + 1)))  # a wave of JOBS runs as long as the first part's, 20% spare
  todo=$(python -c "from pathlib import Path; from gpt2_bench.evidence import finished
items = [i.split(':') for i in '$THEN'.split()]
print(' '.join(f'{m}:{s}' for m, s in items if not finished(m, int(s), '$batch', '$lr', Path('$OUT/rows'), 'gpu')))")
  [ "$fits" -gt 0 ] && [ -n "$lr" ] && todo=$(echo $todo | tr ' ' '\n' | head -n "$fits" | tr '\n' ' ') || todo=""
  echo "then: plain's best lr $lr; $took s for $first runs; $left s left fit $fits: $todo"
  began=$SECONDS
  for item in $todo; do launch "${item%:*}" "${item#*:}" "$batch" "$lr" "$((left - SECONDS + began))"; done
  wait
  echo "then: $((SECONDS - began)) s"
fi
for f in "$OUT"/logs/*-s*.txt; do grep -q "Error\|Traceback" "$f" && { echo "== $f"; grep -m3 "Error" "$f"; }; done
find "$OUT/rows" -name "*.json" -exec python -c "import json, sys; r = json.load(open(sys.argv[1]))
print(sys.argv[1], r['steps_done'], 'of', r['steps'], r['val_loss'][-1:] )" {} \;
rm -rf "$OUT/work"
kill "$snapper"; snapshot && rm -rf "$OUT/rows" "$OUT/logs"
