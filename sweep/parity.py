"""Kernel parity check: a modulate or attention implementation against the reference, every dtype.

    python -m sweep.parity                                  # our modulate and attention kernels
    python -m sweep.parity --modulate fused_buggy           # fails: OpenDiT's row-index bug at batch >= 2
    python -m sweep.parity --modulate mypkg.kernels:modulate --attention mypkg.attn:attend

A candidate is one of ours by name or any function by import path `module:function`, with the
signature of models.modulate.modulate(x (B,N,D), shift (B,D), scale (B,D)) or
models.attention.attend(q, k, v (B,H,N,Dh)). Forward and backward are compared with the reference
computed in fp32 (eager modulate, SDPA math attention), for batch sizes 1..4 (a per-row indexing
bug only shows at batch >= 2) in fp32, bf16 and fp16, with per-dtype tolerances. Prints a table;
exit status 1 on any mismatch, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from typing import Callable

import torch

from models import ATTENTION_BACKENDS, MODULATE_IMPLS, attend, backend_unavailable_reason, modulate
from sweep.run.precision import DTYPES

SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The dtypes the check runs in, by the names --dtypes and TOLERANCE use, and the config's name of each (the
key of its torch dtype in sweep.run.precision.DTYPES)."""
# max |candidate - reference| <= atol + rtol * |reference|, per dtype (about a few ulps of the dtype)
TOLERANCE = {
    "modulate": {"fp32": 1e-5, "bf16": 2e-2, "fp16": 3e-3},
    "attention": {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2},
}


def resolve(kind: str, spec: str) -> Callable:
    """Our implementation by name, or a function by import path."""
    if ":" in spec:
        module, name = spec.split(":", 1)
        return getattr(importlib.import_module(module), name)
    if kind == "modulate":
        if spec not in MODULATE_IMPLS:
            raise ValueError(f"unknown modulate impl {spec!r}; ours are {', '.join(MODULATE_IMPLS)}")
        return lambda x, shift, scale: modulate(x, shift, scale, impl=spec)
    if spec not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {spec!r}; ours are {', '.join(ATTENTION_BACKENDS)}")
    return lambda q, k, v: attend(q, k, v, spec)


def _inputs(kind: str, batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    if kind == "modulate":
        return [
            torch.randn(batch, 16, 32, generator=gen),
            0.5 * torch.randn(batch, 32, generator=gen),
            0.5 * torch.randn(batch, 32, generator=gen),
        ]
    return [torch.randn(batch, 2, 16, 8, generator=gen) for _ in range(3)]


def _reference(kind: str) -> Callable:
    return resolve(kind, "eager" if kind == "modulate" else "math")


def _max_violation(got: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """max |got - ref| / (tol * (1 + |ref|)): <= 1 passes."""
    return float(((got.float() - ref).abs() / (tol * (1 + ref.abs()))).max())


def check(kind: str, fn: Callable, dtype_name: str, batch: int, seed: int = 0) -> tuple[float, float]:
    """(forward, backward) worst violation ratios of `fn` against the fp32 reference."""
    gen = torch.Generator().manual_seed(seed + batch)
    base = _inputs(kind, batch, gen)
    grad_out = None
    results = []
    for impl, dtype in ((_reference(kind), torch.float32), (fn, DTYPES[SHORT_NAMES[dtype_name]])):
        xs = [t.detach().to(dtype).clone().requires_grad_() for t in base]
        out = impl(*xs)
        grad_out = torch.randn(out.shape, generator=gen) if grad_out is None else grad_out
        out.backward(grad_out.to(out.dtype))
        results.append((out.detach(), [x.grad for x in xs]))
    (ref, ref_grads), (got, got_grads) = results
    tol = TOLERANCE[kind][dtype_name]
    fwd = _max_violation(got, ref, tol)
    bwd = max(_max_violation(g, r, tol * 4) for g, r in zip(got_grads, ref_grads))  # grads reduce: looser
    return fwd, bwd


@functools.cache
def fails(kind: str, spec: str) -> bool:
    """Whether one of our kernels (`modulate` or `attention`, by its config name) disagrees with its reference in
    fp32 at batch 2, the check that catches a per-row bug. Unknown names, and a backend this machine cannot run
    (cudnn on a CPU), do not fail: there is nothing to compare."""
    try:
        return max(check(kind, resolve(kind, spec), "fp32", 2)) > 1
    except (RuntimeError, ValueError, ImportError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sweep.parity",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    ap.add_argument("--modulate", nargs="*", default=None, help="modulate impls or module:function (default: ours)")
    ap.add_argument(
        "--attention", nargs="*", default=None, help="attention backends or module:function (default: ours)"
    )
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--batches", default="1,2,3,4")
    args = ap.parse_args(argv)
    if args.modulate is None and args.attention is None:
        args.modulate, args.attention = ["fused"], ["flash", "eager"]
    candidates = [("modulate", s) for s in args.modulate or []] + [("attention", s) for s in args.attention or []]
    dtypes = args.dtypes.split(",")
    try:
        fns = {(k, s): resolve(k, s) for k, s in candidates}
        bad = [d for d in dtypes if d not in SHORT_NAMES]
        if bad:
            raise ValueError(f"unknown dtype {bad[0]!r}; choose from {', '.join(SHORT_NAMES)}")
        batches = [int(b) for b in args.batches.split(",")]
    except (ValueError, ImportError, AttributeError) as e:
        print(f"sweep.parity: {e}", file=sys.stderr)
        return 2
    failed = 0
    print(f"{'kind':<10}{'candidate':<24}{'dtype':<6}{'batch':>6}{'fwd err/tol':>13}{'bwd err/tol':>13}  result")
    for (kind, spec), fn in fns.items():
        for dtype in dtypes:
            if (
                kind == "attention"
                and ":" not in spec
                and backend_unavailable_reason(spec, torch.device("cpu"), DTYPES[SHORT_NAMES[dtype]])
            ):
                print(f"{kind:<10}{spec:<24}{dtype:<6}{'':>6}{'':>13}{'':>13}  skipped (not available on CPU)")
                continue
            for batch in batches:
                fwd, bwd = check(kind, fn, dtype, batch)
                ok = fwd <= 1 and bwd <= 1
                failed += not ok
                print(f"{kind:<10}{spec:<24}{dtype:<6}{batch:>6}{fwd:>13.3g}{bwd:>13.3g}  {'ok' if ok else 'MISMATCH'}")
    print(f"\n{failed} mismatches" if failed else "\nall within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
