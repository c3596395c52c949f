"""GEMM speed on this CPU: fp32, native bf16/fp16, and emulated bf16/fp16 (sweep/run/gemm.py), one thread.

    python bench/gemm.py [--sizes 512,2048]

What precision.cpu_gemm=auto decides from, and the figure docs/cpu_gemm.md quotes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sweep.run.gemm import EmulatedGemm, cpu_flags, has_native_gemm


def gflops(a: torch.Tensor, b: torch.Tensor, seconds: float = 1.0) -> float:
    """GFLOP/s of a @ b, repeated for about `seconds` after one warm-up."""
    a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,2048")
    args = ap.parse_args()
    torch.set_num_threads(1)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "avx512_fp16", "amx", "avx2")))
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, flags {' '.join(flags)}")
    print(f"{'n':>6}{'dtype':>10}{'native GFLOP/s':>16}{'emulated GFLOP/s':>18}  auto")
    for n in map(int, args.sizes.split(",")):
        a, b = torch.randn(n, n), torch.randn(n, n)
        print(f"{n:>6}{'float32':>10}{gflops(a, b):>16.1f}{'-':>18}  native")
        for dtype in (torch.bfloat16, torch.float16):
            lo_a, lo_b = a.to(dtype), b.to(dtype)
            with EmulatedGemm(dtype):
                emulated = gflops(lo_a, lo_b)
            auto = "native" if has_native_gemm(dtype) else "emulated"
            print(f"{n:>6}{str(dtype).removeprefix('torch.'):>10}{gflops(lo_a, lo_b):>16.1f}{emulated:>18.1f}  {auto}")


if __name__ == "__main__":
    main()
