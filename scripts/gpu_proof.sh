#!/usr/bin/env bash
# Issue #31's checks on a lent GPU machine, as one call (the machine starts bare and device time is short):
#   bash scripts/gpu_wheels.sh                                          (here: the wheels, into .whl/)
#   device run, carry .whl:  bash scripts/gpu_proof.sh "$OUT" [PART ...]  (there: one log per part in the folder)
# PARTS, in the order they run (default: all but suite): cuda (the `cuda` tests), graph (bash bench/gpu.sh
# graph), packing (K=32 with graphs, 128 and 512 steps), vmap (whether the packs refused on CUDA still fail),
# parity (graph=true against eager on the demo grid and every scenario, a graphed run twice: graph=auto's
# condition), compile (S, compile=true with graphs), suite (the whole suite, beside nothing). Opt-in, for a
# second call: demo (issue #48 item 4: `+experiment=demo device=cuda` packed, packed with graphs, lone, each
# timed; their summaries in the folder) and ladder (item 5: bench/ladder_real_width.sh, the µP fit on widths 64-512 and the
# check at 1024 and 2048, ladder_runs.tgz in the folder), e.g. `bash scripts/gpu_proof.sh "$OUT" demo ladder`.
# Each part is time-boxed (seconds first) so that the later ones still run, and is stopped with SIGINT, so
# pytest still prints what failed up to then; no part runs past BUDGET_S (570). The box a part got is PART_S
# in its environment. What the H100 session found: docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${1:?usage: bash scripts/gpu_proof.sh OUTDIR [cuda graph packing vmap parity compile suite demo ladder]}
shift
parts=${*:-cuda graph packing vmap parity compile}
# Into the interpreter's own site-packages (the machine is bare and ours), the project editable: the tests'
# subprocesses (`python -m sweep`, the launchers' jobs) then import what the tests do, with no PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHON=python3
part() {  # part SECONDS NAME COMMAND...: at most SECONDS, and never past BUDGET_S
  local secs=$1 name=$2 t0=$SECONDS left=$(( ${BUDGET_S:-570} - SECONDS ))
  shift 2
  [[ " $parts " == *" $name "* ]] || return 0
  (( secs > left )) && secs=$left
  (( secs > 20 )) || { echo "== $name: no time left (${left} s)"; return 0; }
  echo "== $name: $*"
  PART_S=$secs timeout -s INT -k 15 "$secs" "$@" >>"$O/$name.log" 2>&1
  echo "== $name: rc $? after $((SECONDS - t0)) s"
  grep -v -E "USDT|profiler_st|Warning|warn" "$O/$name.log" | tail -n "${TAIL:-14}"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), torch.get_num_threads())"
# What the image lacks shows here, not as `cuda` tests skipped (test_fp8.py skips its whole module without torchao)
python3 -c "import importlib.util as u; print('importable:', {m: u.find_spec(m) is not None for m in
  ('torchao', 'bitsandbytes', 'prodigyopt', 'came_pytorch', 'peft', 'diffusers', 'PIL', 'av', 'scipy')})"
echo "parts: $parts"
part 90 cuda python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider -rs --durations=8 --timeout 80
TAIL=24 part 150 graph bash bench/gpu.sh graph
pack=(bench/packing.py --precision bf16_amp --attention flash --packs 32 --packed-only graph=true monitor.sync_every=32)
# --kernels: the 128-step pack once more under torch.profiler, where its device time goes (bench/device_kernels.py)
part 110 packing bash -c "$PYTHON ${pack[*]} --steps 128 --kernels 15 && $PYTHON ${pack[*]} --steps 512"
part 30 vmap "$PYTHON" bench/vmap_check.py
# Results, not speed: sweeps side by side (six processes on the one GPU).
TAIL=30 part 200 parity "$PYTHON" bench/graph_parity.py --jobs 6 --again
part 570 compile "$PYTHON" bench/throughput.py --model video_dit_s --precisions bf16_amp --attention flash \
  --rounds 1 --graph-every 8 --compile
# The tests that start PostgreSQL, Slurm or an MLflow server install them from the network, which is not there
# (three tensorboard/packed-logging tests share the MLflow server's fixture).
TAIL=40 part 570 suite python3 -m pytest -q -n 10 -p no:cacheprovider --tb=line -rfE \
  --timeout 100 --ignore=tests/test_postgres.py --ignore=tests/test_slurm.py --ignore=tests/test_ledger_faults.py \
  -k "not mlflow and not postgres and not logger_choices and not password_in_the_tracking and not tensorboard_event \
  and not packed_runs_log and not server_killed"
# The demo a GPU user runs, with the diagnosis; `time` says what the process costs, start included (goal 30 s):
# packed (one pack per precision x attention cell), then packed with graphs in windows of 8 (what graph=auto
# would give once on), then lone, the default today; the box may cut the last.
demo() {  # demo OUTDIR
  local kind rc=0
  local -A args=([packed]="hydra/launcher=packed hydra.launcher.pack=48"
    [graphed]="hydra/launcher=packed hydra.launcher.pack=48 graph=true monitor.sync_every=8" [lone]="")
  for kind in packed graphed lone; do
    echo "== demo, $kind: ${args[$kind]}"
    # shellcheck disable=SC2086  # the overrides are words
    { time "$PYTHON" -m sweep -m +experiment=demo device=cuda ${args[$kind]} hydra.sweep.dir="/tmp/demo_$kind"; } \
      2>&1 || rc=$?
    cp "/tmp/demo_$kind/summary.md" "$1/demo_$kind.md" 2>/dev/null
  done
  return $rc
}
export -f demo
TAIL=60 part 150 demo bash -c 'demo "$0"' "$O"
# The sweeps' own deadline, inside the part's box: they stop, record and leave the check its time.
TAIL=40 part 560 ladder bash -c 'LADDER_S=$((PART_S - 15)) bash bench/ladder_real_width.sh "$0"' "$O"
