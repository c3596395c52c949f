#!/usr/bin/env bash
# Run a command with the CPU kernels another x86 CPU kind gets, on this one: a test whose expectation holds only
# on the kernels it was measured with (a chaotic trajectory, a threshold crossed by luck) fails here, not on CI.
#   bash scripts/kernels.sh avx2 .venv/bin/python -m pytest -q -n 2 tests/test_trend.py
#   bash scripts/kernels.sh default make test
# avx2:    ATen's AVX2 kernels, oneDNN capped at AVX2 (so bf16/fp16 GEMMs leave oneDNN and precision.cpu_gemm=auto
#          emulates them, as on an AVX2-only EPYC) and MKL's AVX2 code path;
# default: ATen's unvectorized kernels, with oneDNN and MKL capped as for avx2.
# What it cannot give: another CPU's speed, or the exact summation order of its BLAS (MKL picks its own kernels
# by CPU vendor). Inductor's cache goes to a directory of the kernel set's own: with ATEN_CPU_CAPABILITY=avx2 and
# the cache of this CPU's own compiles, test_compile's compiled runs gave wrong values (torch 2.13.0+cpu).
set -euo pipefail
case "${1:-}" in avx2 | default) ;; *) set -- ;; esac
if [ $# -lt 2 ]; then echo "usage: bash scripts/kernels.sh avx2|default COMMAND [ARGS...]" >&2; exit 2; fi
export ATEN_CPU_CAPABILITY=$1
shift
export ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor_${USER:-$(id -u)}_kernels_${ATEN_CPU_CAPABILITY}"
exec "$@"
