#!/usr/bin/env bash
# The decision set of docs/evidence.md on one lent GPU: every run at once, two gloo ranks each on GPU 0
# (--device cuda-shared, bf16 autocast), each through `python -m gpt2_bench.evidence run ...`, so that its
# curve file (command, commit, torch, machine) lands in docs/rows/evidence/ as on the CPU.
#
# Here, first:  python -m gpt2_bench.data --dataset mix --cache-dir .gpu/data   (the device has no corpus packages)
# Then, with the device tool:  MAXT=480 bash .gpu/quality.sh   carrying [".gpu/data"], timeout_s about MAXT + 60;
# copy $OUT/rows/ into docs/rows/evidence/ and run `python -m gpt2_bench.evidence rebuild`. A GPU's curve files end
# in -gpu.json and pair only with each other (gpt2_bench/evidence.py). Nothing resumes across calls (a checkpoint does
# not fit the way back), so a call runs what finishes in it: six runs at once reached step 799 of 2,000 in 430 s, so
# the default is one pair, plain and tagc.hook(), on the first seed whose GPU pair is not yet kept here.
# RUNS picks the methods, SEEDS the seeds, BATCH 1x / 4x / 16x (several: one after the other, each given MAXT), LR
# the learning rates (every run at each; default plain's best at the batch in the kept rows, else 1e-3).
# At 4x and 16x a run has 500 and 125 steps, so one call can sweep plain's lr and pair tagc at each lr at both, e.g.
#   BATCH="4x 16x" LR="5e-4 1e-3 2e-3" SEEDS=0 RUNS="plain tagc" MAXT=300 bash .gpu/quality.sh   (six runs twice)
# GPU_CHECK=1 first runs `python -m tagc.bench gpu-check --skip-tests` (its time comes off MAXT).
# DEVICE=cpu MAXT=60 OUT=/tmp/q RUNS=plain SEEDS=0 bash .gpu/quality.sh smoke-tests it here.
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
MAXT=${MAXT:-480}
RUNS=${RUNS:-"plain tagc"}
BATCH=${BATCH:-1x}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
python -c "import torch; print('torch', torch.__version__)"
mkdir -p "$OUT/logs" "$OUT/rows"
if [ -n "$GPU_CHECK" ]; then
  began=$SECONDS
  timeout 150 python -m tagc.bench gpu-check --skip-tests --json "$OUT/logs/gpu-check.json" > "$OUT/logs/gpu-check.txt" 2>&1
  echo "gpu-check rc=$?" >> "$OUT/logs/gpu-check.txt"; grep -v "^\s\|Warning\|check_internals" "$OUT/logs/gpu-check.txt"
  MAXT=$((MAXT - (SECONDS - began)))
fi
for batch in $BATCH; do
  lrs=${LR:-$(python -c "from gpt2_bench.evidence import best_lr, load
print(best_lr(load(), '$batch') or '1e-3')")}
  seeds=${SEEDS:-$(python -c "from gpt2_bench.evidence import finished
print(next(s for s in range(100) if not finished('tagc', s, '$batch', '${lrs%% *}', platform='gpu')))")}
  began=$SECONDS
  for lr in $lrs; do
    for s in $seeds; do
      for r in $RUNS; do
        python -m gpt2_bench.evidence run "$r" --seed "$s" --batch "$batch" --lr "$lr" --work "$OUT/work" \
          --rows "$OUT/rows" -- --device "${DEVICE:-cuda-shared}" --dataset .gpu/data/mix --max-time "$MAXT" \
          > "$OUT/logs/$r-$batch-s$s-lr$lr.txt" 2>&1 &
      done
    done
  done
  wait
  echo "$batch: $((SECONDS - began)) s"
done
for f in "$OUT"/logs/*-s*.txt; do grep -q "Error\|Traceback" "$f" && { echo "== $f"; grep -m3 "Error" "$f"; }; done
find "$OUT/rows" -name "*.json" -exec python -c "import json, sys; r = json.load(open(sys.argv[1]))
print(sys.argv[1], r['steps_done'], 'of', r['steps'], r['val_loss'][-1:] )" {} \;
rm -rf "$OUT/work"
