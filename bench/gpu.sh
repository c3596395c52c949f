#!/usr/bin/env bash
# The GPU figures in docs/packing.md and the README: trial packing and throughput per precision and
# attention kernel, on whatever CUDA device torch sees.
#   bash bench/gpu.sh [packing|throughput|graph]   (default: all; PYTHON=python3 to pick the interpreter)
# Each line is the command one table came from; run it alone to redo that table.
set -uo pipefail  # one failing table does not stop the others
PY=${PYTHON:-python}
cd "$(dirname "$0")/.."
part=${1:-all}
if [[ $part == all || $part == packing ]]; then
  "$PY" bench/packing.py --precision bf16_amp --attention flash --steps 20 --packs 1,2,4,8,16,32,64
  "$PY" bench/packing.py --precision fp16_amp --attention flash --steps 20 --packs 1,8,64
  "$PY" bench/packing.py --precision fp32 --attention math --steps 20 --packs 1,2,4,8,16,32
  "$PY" bench/packing.py --precision tf32 --attention math --steps 20 --packs 1,8,32
fi
if [[ $part == all || $part == throughput ]]; then
  "$PY" bench/throughput.py --precisions fp32,tf32,bf16_amp,fp16_amp,bf16_pure --attention math
  "$PY" bench/throughput.py --precisions bf16_amp,fp16_amp --attention flash
  "$PY" bench/throughput.py --model video_dit_s --precisions fp32,bf16_amp,fp16_amp --attention math
fi
if [[ $part == all || $part == graph ]]; then  # issue #15: graph=true against the bare step as one CUDA graph
  # --sync-every 8: the eager columns' monitored loop runs windows of 8 (one sync per window), the loop that
  # graph=auto and sync_every's CUDA default are to become; the H100's figure at sync_every=1 is in docs/gpu.md
  "$PY" bench/throughput.py --precisions bf16_amp --attention flash --rounds 3 --sync-every 8 --graph-every 8,10,20
  "$PY" bench/throughput.py --precisions fp32 --attention math --rounds 3 --sync-every 8 --graph-every 8,10,20
  "$PY" bench/throughput.py --model video_dit_s --precisions bf16_amp --attention flash --rounds 3 --sync-every 8 \
    --graph-every 8,10,20
  "$PY" bench/step_ops.py precision=bf16_amp attention=flash  # the kernels a graphed step holds, by part
  "$PY" bench/snapshot.py --reps 50 precision=bf16_amp attention=flash  # a window's snapshot: host, device time
  "$PY" bench/snapshot.py --reps 50 --model video_dit_s precision=bf16_amp attention=flash
fi
