#!/usr/bin/env bash
# Quality runs of 2-rank DDP on one lent GPU (--device cuda-shared: both ranks on GPU 0 over gloo, bf16 autocast).
#
# Here, first:  python -m gpt2_bench.data --dataset mix --cache-dir .gpu/data   (the device has no corpus packages)
# Then, with the device tool:  MAXT=420 bash .gpu/quality.sh   carrying [".gpu/data"], timeout_s about MAXT + 60.
# DEVICE=cpu STEPS=3 OUT=/tmp/q bash .gpu/quality.sh smoke-tests it here. RUNS picks the runs (default: every one below); GPU_CHECK=1 or full also runs `python -m tagc.bench gpu-check` (below).
# The screens: RUNS="ddp tagc-d1 tagc-d0.97 tagc-dlr tagc-localv ddp-b16 tagc-d0.97-b16" (names below; tagc-m0.9 diverged without fading on the CPU).
# Report: python -m gpt2_bench.quality DIR --plain ddp --methods tagc45-int4-ef21d0.9,int4,... --steps 2000
# Plain DDP repeats to the bit across loans and cards (fifth loan), so a screen need not run it again: e.g.
# RUNS="tagc-dlr tagc-d0.97" (four runs, about 10 minutes), then
# python -m gpt2_bench.quality DIR --rows docs/rows/gpu-quality-2026-11-27.json --plain ddp --steps 2000 --tolerance 0.5
# Everything comes back as one file, $OUT/quality.tgz (the tool returns at most 8 files).
# Plain DDP ran 2,000 steps in 4 minutes this way, three runs at once on one H100 (torch 2.11).
# Fourth loan: eight runs at once plus GPU_CHECK filled the 80 GB: the compressed runs' processes held 13-14 GiB each
# (torch allocated 1.6 GB at peak; the decode callbacks ran on torch's pool streams, each caching its own blocks; they
# now run on one stream of the hook's). The summaries now give peak_gpu_reserved_mb beside peak_gpu_mb.
# Fifth loan: confirmed; six runs plus GPU_CHECK used 34 GB, each compressed run 2.5 GB reserved. Four runs at once
# on an H200 ran 2,000 steps in 3.5 minutes; six at once on an H100 reached steps 890-1,300 of the compressed runs in 5.
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
MAXT=${MAXT:-420}
STEPS=${STEPS:-2000}
RUNS=${RUNS:-"ddp tagc int4 topk-f8"}  # the 4x-batch point in a call of its own: RUNS="ddp-b16 tagc-b16 int4-b16 topk-f8-b16"
SEEDS=${SEEDS:-"0 1"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
mkdir -p "$OUT/q/logs" "$OUT/q/runs"
python -c "import gpt2_bench.train" || exit 1
# GPU_CHECK=1: gpu-check without its kernel tests (they passed on the second to fourth loans), in the foreground
# before the runs, so that they cannot crowd it out; the runs get what is left of MAXT. GPU_CHECK=full: with the
# kernel tests, beside the runs.
if [ "$GPU_CHECK" = full ]; then
  (timeout 400 python -m tagc.bench gpu-check > "$OUT/q/logs/gpu-check.txt" 2>&1; echo "gpu-check rc=$?" >> "$OUT/q/logs/gpu-check.txt") &
elif [ -n "$GPU_CHECK" ]; then
  began=$SECONDS
  timeout 150 python -m tagc.bench gpu-check --skip-tests --json "$OUT/q/logs/gpu-check.json" > "$OUT/q/logs/gpu-check.txt" 2>&1
  echo "gpu-check rc=$?" >> "$OUT/q/logs/gpu-check.txt"; grep -v "^\s\|Warning\|check_internals" "$OUT/q/logs/gpu-check.txt"
  MAXT=$((MAXT - (SECONDS - began)))
fi
COMMON="--preset small --integration ddp --block-size 128 --lr 1e-3 --eval-interval 100 --eval-batches 16 --world 2
 --dataset .gpu/data/mix --device ${DEVICE:-cuda-shared} --threads 1 --steps $STEPS --max-time $MAXT"
TAGC="--compression non-attn --codec tagc"
INT4="--compression all --codec int4"
TOPK="--compression non-attn --codec topk --ratio 4.5 --plain int4 --codec-option positions=coded
 --codec-option value_dtype=bfloat16 --feedback ef21 --feedback-decay 0.9"
# topk at the defaults' bytes (the compare's topk-f8): float8 values, ratio 1.2
TOPKF8="--compression non-attn --codec topk --ratio 1.2 --plain int4 --codec-option positions=coded
 --codec-option value_dtype=float8 --feedback ef21 --feedback-decay 0.9"
go() { # seed batch name flags...
  local seed=$1 batch=$2 name=$3; shift 3
  # shellcheck disable=SC2086
  python -m gpt2_bench.train $COMMON --seed "$seed" --batch-size "$batch" --out-dir "$OUT/q/runs/seed-$seed" \
    --name "$name" "$@" > "$OUT/q/logs/$name-s$seed.txt" 2>&1 &
}
for s in $SEEDS; do
  for r in $RUNS; do
    case $r in
      ddp) go "$s" 4 ddp --compression none --transport gloo ;;
      tagc) go "$s" 4 tagc45-int4-ef21d0.9 $TAGC ;;
      int4) go "$s" 4 int4 $INT4 ;;
      topk) go "$s" 4 topk45-int4-ef21d0.9 $TOPK ;;
      topk-f8) go "$s" 4 topk-f8 $TOPKF8 ;;
      ddp-b16) go "$s" 16 ddp-b16 --compression none --transport gloo ;;
      tagc-b16) go "$s" 16 tagc45-int4-ef21d0.9-b16 $TAGC ;;
      int4-b16) go "$s" 16 int4-b16 $INT4 ;;
      topk-f8-b16) go "$s" 16 topk-f8-b16 $TOPKF8 ;;
      # the peers of the README's "who wins" table (the CPU queue's names)
      ddp-bf16) go "$s" 4 ddp-bf16 --compression all --codec bf16 --torch-hook ;;
      powersgd-r16) go "$s" 4 powersgd-r16 --compression all --codec powersgd --codec-option rank=16 ;;
      powersgd) go "$s" 4 powersgd --compression all --codec powersgd ;;  # rank 4: the compare's, for the flat-FSDP table
      # screens for the 0.5% target (each against ddp of the same seed): no fading, slower fading,
      # fading that follows the learning rate (0.9 at the peak, 0.99 at the floor), EF21-SGDM, and AdamW's second moment fed each rank's own gradient (tagc.optim.AdamW)
      tagc-d1) go "$s" 4 tagc45-int4-ef21d1.0 $TAGC --feedback-decay 1.0 ;;
      tagc-d0.97) go "$s" 4 tagc45-int4-ef21d0.97 $TAGC --feedback-decay 0.97 ;;
      tagc-m0.9) go "$s" 4 tagc45-int4-ef21d0.9m0.9 $TAGC --feedback-momentum 0.9 ;;
      tagc-dlr) go "$s" 4 tagc45-int4-ef21d0.9-lr $TAGC --feedback-decay-follows-lr ;;
      tagc-localv) go "$s" 4 tagc45-int4-ef21d0.9-localv $TAGC --second-moment local ;;
      # the 4x-batch point's screen: slower fading at batch 16 (against ddp-b16)
      tagc-d0.97-b16) go "$s" 16 tagc45-int4-ef21d0.97-b16 $TAGC --feedback-decay 0.97 ;;
      *) echo "quality.sh: no run named $r (see the names above); skipped" >&2 ;;
    esac
  done
done
sleep ${WATCH_S:-90}; uptime; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
for f in "$OUT"/q/logs/*.txt; do echo "$(basename "$f"): $(tail -c 200 "$f" | tr '\r' '\n' | tail -1)"; done
wait
for f in "$OUT"/q/logs/*.txt; do grep -q "Error\|Traceback" "$f" && { echo "== $f"; grep -m3 "Error" "$f"; }; done
for f in "$OUT"/q/runs/*/*.jsonl; do echo "$f $(grep -c val_loss "$f") $(grep val_loss "$f" | tail -1 | cut -c1-120) $(tail -1 "$f" | grep -o '"peak_gpu[a-z_]*": [0-9.]*\|"nonfinite_parts": [-0-9]*\|"peel_success": [-0-9.e]*' | tr '\n' ' ')"; done
# nonfinite_parts must be 0 and peel_success at most 1: the fifth loan's summaries read garbage there (device counters
# summed on another stream than they were made on; tagc.hooks.stats now records the reading stream)
tar czf "$OUT/quality.tgz" -C "$OUT/q" . && rm -rf "$OUT/q"
