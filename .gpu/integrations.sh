#!/usr/bin/env bash
# Issue 61's GPU checks in one call: what the CPU suite cannot show, on the lent GPU's own torch.
#   1. `python -m tagc.bench gpu-check` (kernel tests on the device, round trips, kernel times against a device
#      copy at 1M and 2.25M elements: GPT-2 124M's MLP weight parts on 2 ranks);
#   2. SimpleFSDP and FSDP2, eager and compiled, world 1, GPT-2 124M (`--preset gpt2`): plain against the one line
#      (`tagc.hook()`), STEPS steps each, alone on the GPU: they must run, and their medians are the step times;
#   3. DDP on two gloo ranks sharing the GPU (`--device cuda-shared`): plain against the one line, where the codec
#      really runs (one rank sends nothing). Gloo moves CUDA tensors for DDP's collectives only, so FSDP's
#      reduce-scatter cannot run two ranks on one GPU.
# Here first: python -m gpt2_bench.data --dataset mix --cache-dir .gpu/data
# Then, with the device tool: bash .gpu/integrations.sh  carrying [".gpu/data"], timeout_s 540. The logs come back
# in one file, $OUT/integrations.tar (the tool returns at most 8 files).
# DEVICE=cpu PRESET=tiny STEPS=3 OUT=/tmp/i61 bash .gpu/integrations.sh smoke-tests it here (skips gpu-check).
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-gpt2}
STEPS=${STEPS:-30}
OUT=${OUT:-/tmp/i61}
mkdir -p "$OUT/logs"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
if [ "$DEVICE" = cuda ]; then
  timeout 200 python -m tagc.bench gpu-check --sizes 1M,2304K,16M --json "$OUT/logs/gpu-check.json" \
    > "$OUT/logs/gpu-check.txt" 2>&1
  echo "gpu-check rc=$?"; grep -v "^\s\|Warning\|check_internals" "$OUT/logs/gpu-check.txt" | tail -20
fi
common=(--preset "$PRESET" --steps "$STEPS" --block-size 1024 --batch-size 8 --eval-interval "$STEPS"
        --eval-tokens 8192 --dataset .gpu/data/mix --out-dir "$OUT/runs" --max-time 60)
[ "$DEVICE" = cpu ] && common=(--preset "$PRESET" --steps "$STEPS" --block-size 64 --batch-size 2
                               --eval-interval "$STEPS" --eval-tokens 1024 --out-dir "$OUT/runs" --max-time 300)
for integration in simple fsdp2; do
  for compiled in "" --compile; do
    for compression in none non-attn; do
      name=$integration${compiled:+-compiled}-$compression
      timeout 150 python -m gpt2_bench.train "${common[@]}" --integration "$integration" $compiled --world 1 \
        --device "$DEVICE" --compression "$compression" --name "$name" > "$OUT/logs/$name.txt" 2>&1
      echo "$name rc=$?"
    done
  done
done
shared=cuda-shared; [ "$DEVICE" = cpu ] && shared=cpu
for compression in none non-attn; do
  extra=(); [ "$compression" = none ] && extra=(--transport gloo)
  name=ddp-shared-$compression
  timeout 150 python -m gpt2_bench.train "${common[@]}" --integration ddp --world 2 --device "$shared" \
    --compression "$compression" "${extra[@]}" --name "$name" > "$OUT/logs/$name.txt" 2>&1
  echo "$name rc=$?"
done
python - "$OUT/runs" <<'EOF'
import json, pathlib, statistics, sys
print(f"{'run':<32} {'steps':>5} {'median ms':>10} {'compress ms':>11} {'wire MB':>8}")
for log in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")):
    rows = [r for r in map(json.loads, log.read_text().splitlines()) if "iter_ms" in r]
    steps = rows[13:] or rows[3:]  # past compiling and tagc.hook()'s 10 dense steps (a smoke test: past compiling)
    if steps:
        print(f"{log.stem:<32} {len(steps):>5} {statistics.median(r['iter_ms'] for r in steps):>10.1f} "
              f"{statistics.median(r.get('compress_ms', 0) for r in steps):>11.1f} "
              f"{statistics.median(r.get('wire_bytes', 0) for r in steps) / 1e6:>8.2f}")
EOF
for f in "$OUT"/logs/*.txt; do grep -q "Traceback" "$f" && { echo "== $f"; grep -B2 -m2 "Error" "$f" | tail -6; }; done
rm -rf "$OUT/runs"/checkpoints
tar -cf "$OUT/integrations.tar" -C "$OUT" logs && rm -rf "$OUT/logs"
