#!/usr/bin/env bash
# Issue #48 item 5, the ladder's prediction at a real width, as one command (conf/experiment/mup_real_width.yaml):
#   bash bench/ladder_real_width.sh OUTDIR [OVERRIDE ...]
# 1. the fit: µP, widths $FIT_WIDTHS (64,128,256,512) x the experiment's 14 lrs x 2 seeds, packed, a pack per
#    width (hydra.launcher.pack=$FIT_PACK, 28);
# 2. each held-out width of $TARGETS (1024 2048) on the lrs `bench/ladder_heldout.py --window` picks from the fit
#    (the grid's values in its 90% interval there, and one on each side), packs of $TARGET_PACK (4: a 0.92B run's
#    weights and AdamW state are ~15 GB);
# 3. `bench/ladder_heldout.py` over all of them: the prediction at each target, its interval, and whether the
#    measured bracket is inside.
# Every stage ends by $LADDER_S (480) seconds from the start, the check's 30 s kept (a sweep stopped at its box
# with SIGINT records its finished runs and says which were interrupted). The sweeps go under $LADDER_DIR
# (/tmp/ladder, which must not exist yet); OUTDIR gets ladder_runs.tgz: every run's result.json, metrics.csv and
# .hydra/overrides.yaml, and the sweeps' summaries, multirun.yaml and ledger.db, from which the check reruns anywhere:
#   tar xzf ladder_runs.tgz -C /tmp/ladder && python bench/ladder_heldout.py /tmp/ladder --fit-max 512 --target 2048
# A visit that ran out of time goes on at the next from its tarball: LADDER_FROM=ladder_runs.tgz unpacks it into
# $LADDER_DIR and runs the same stages, which resume (a sweep reruns only the runs without a finished result).
# OVERRIDEs go to every sweep; they must not name model.width, optim.lr or hydra.sweep.dir (the stages set
# them). The same at a toy scale on a CPU, to check the plumbing (docs/ladder.md):
#   FIT_WIDTHS=32,64,128 FIT_MAX=128 TARGETS=256 bash bench/ladder_real_width.sh /tmp/toy model=video_dit_tiny \
#       model.base_width=32 steps=20 data.frames=4 data.height=8 data.width=8
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
[[ -n ${1:-} ]] || { echo "usage: bash bench/ladder_real_width.sh OUTDIR [OVERRIDE ...] (--help: what it runs)" >&2; exit 2; }
O=$1
shift
for a in "$@"; do
  case $a in model.width=* | optim.lr=* | hydra.sweep.dir=*)
    echo "bench/ladder_real_width.sh: $a: the stages set ${a%%=*} themselves; leave it out" >&2; exit 2 ;;
  esac
done
D=${LADDER_DIR:-/tmp/ladder}
PY=${PYTHON:-python}
FIT_MAX=${FIT_MAX:-512}
end=$((SECONDS + ${LADDER_S:-480} - 30))
[[ -e $D ]] && { echo "bench/ladder_real_width.sh: $D exists: remove it or set LADDER_DIR" >&2; exit 2; }
mkdir -p "$O" "$D" || exit 2
if [[ -n ${LADDER_FROM:-} ]]; then
  tar xzf "$LADDER_FROM" -C "$D" || { echo "bench/ladder_real_width.sh: cannot unpack $LADDER_FROM" >&2; exit 2; }
  echo "== resuming from $LADDER_FROM: $(find "$D" -name result.json | wc -l) runs recorded"
fi
stage() {  # stage NAME OVERRIDE...: one sweep into $D/NAME, stopped with SIGINT at the shared end
  local name=$1 t0=$SECONDS left=$((end - SECONDS))
  shift
  (( left > 20 )) || { echo "== $name: no time left"; return 1; }
  echo "== $name ($(date +%T), at most $left s): $*"
  timeout -s INT -k 20 "$left" "$PY" -m sweep -m +experiment=mup_real_width "$@" hydra.sweep.dir="$D/$name"
  local rc=$?
  echo "== $name: rc $rc after $((SECONDS - t0)) s"
  (( rc == 0 || rc == 124 || rc == 130 )) || exit "$rc"  # stopped at the deadline: go on; refused or failed: stop
}
stage fit "$@" "model.width=${FIT_WIDTHS:-64,128,256,512}" hydra/launcher=packed "hydra.launcher.pack=${FIT_PACK:-28}"
for t in ${TARGETS:-1024 2048}; do
  lrs=$("$PY" bench/ladder_heldout.py "$D/fit" --fit-max "$FIT_MAX" --target "$t" --window) || break
  stage "w$t" "$@" "model.width=$t" "optim.lr=$lrs" ladder.axis=null hydra/launcher=packed \
    "hydra.launcher.pack=${TARGET_PACK:-4}" || break
done
for t in ${TARGETS:-1024 2048}; do
  echo "== the check at width $t"
  "$PY" bench/ladder_heldout.py "$D" --fit-max "$FIT_MAX" --target "$t"
done
(cd "$D" && find . \( -name result.json -o -name metrics.csv -o -name overrides.yaml -o -name 'summary.*' -o -name multirun.yaml \
  -o -name ledger.db \) -print0 \
  | tar czf "$O/ladder_runs.tgz" --null -T -) && echo "== $O/ladder_runs.tgz: $(du -h "$O/ladder_runs.tgz" | cut -f1)"
