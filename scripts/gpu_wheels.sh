#!/usr/bin/env bash
# Wheels for a GPU machine that has torch (and numpy, pandas, pyarrow, peft, safetensors) but no
# network: download them here, carry .whl/ there, install them next to its torch.
#   here:   bash scripts/gpu_wheels.sh                  (PYVER=3.12 by default: the GPU image's Python)
#   there:  bash scripts/gpu_proof.sh "$OUT"   (installs them into the image's Python, then the checks)
# Pinned to constraints.txt where it pins, so the GPU runs the versions CI tests, except huggingface-hub: the
# image's own is kept (1.33 on 2026-11-26), since the image's transformers, which diffusers' peft loader
# imports there, refuses hub 2.x (and CI's 2.4 needs httpx2); diffusers takes >=1.32. The lowprec extra's
# torchao (precision=fp8_*: test_fp8.py's `cuda` tests skip the whole module without it), prodigyopt and
# came-pytorch come by default (3.4 MB), and pillow (data=image_folder) and optuna-dashboard for the suite part
# (11.4 MB); av (video folders), scipy (Optuna's QMC sampler, the ladder's Student-t) and bitsandbytes
# (optim=adamw_8bit, 43 MB: no `cuda` test uses it) are left out by default: with them .whl/ is over the device
# tool's 64 MiB carry (the tree is 3 MB, .whl/ 41 MB without them, 2026-12-02); EXTRA=1 adds them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
pkgs=(hydra-core omegaconf optuna alembic sqlalchemy Mako colorlog diffusers filelock
      regex plotly narwhals hydra-joblib-launcher joblib hydra-submitit-launcher submitit cloudpickle
      cmaes tqdm PyYAML typing_extensions greenlet MarkupSafe importlib_metadata zipp pytest pytest-timeout
      pytest-xdist execnet hypothesis sortedcontainers attrs iniconfig pluggy packaging
      torchao prodigyopt came-pytorch pillow optuna-dashboard bottle websockets)
[[ ${EXTRA:-0} == 1 ]] && pkgs+=(av scipy bitsandbytes)
specs=()
for p in "${pkgs[@]}"; do
  pin=$(grep -i -E "^${p//[-_]/[-_]}==" constraints.txt | sed "s/ *#.*//" || true)
  specs+=("${pin:-$p}")
done
# The image's platform tags (glibc 2.28 or newer), for the download and for the check at the end
plats=(manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64
       manylinux_2_27_x86_64 manylinux_2_28_x86_64 any)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" "${plats[@]/#/--platform=}" \
  -d .whl "${specs[@]}"
# antlr4-python3-runtime (omegaconf's parser) ships no wheel: build one.
"$PY" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
# Every wheel installs under the image's Python (its tags, no index): what gpu_proof.sh's install will do there.
"$PY" -m pip install -q --dry-run --no-index --no-deps --only-binary=:all: --python-version "$PYVER" \
  "${plats[@]/#/--platform=}" --target "$(mktemp -d)" .whl/*.whl
ls .whl | wc -l | xargs echo "wheels in .whl/:"
du -sh .whl | cut -f1 | xargs echo "size (the device tool carries 64 MiB with the tree):"
