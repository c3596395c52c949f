"""Where a loop's device time goes, for the GPU benches (issue #48 item 3): torch.profiler's own kernel times.

bench/host_parts.py says whether a loop waits for the device (`sync wait`); this says what the device spent that
time on. On CUDA the rows are the kernels the GPU ran (each kernel's own time); on the CPU, where the ops run on
the host, they are the aten ops' self times, so the same bench reads the same way on both. The kinds are by
kernel name (KINDS, first match), which is a reading aid: the table below them names every kernel it counts.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch
from torch.autograd import DeviceType

KINDS = (
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("matmul", r"gemm|matmul|cublas|cutlass|xmma|aten::(mm|bmm|addmm|baddbmm|linear)$|sm\d\d_"),
    ("optimizer", r"multi_tensor|foreach|adam"),
    ("copy", r"memcpy|memset|copy|cat|index|gather|scatter|clone|contiguous"),
    ("reduction", r"reduce|sum|mean|norm|var"),
    ("elementwise", r"."),
)
"""A kernel's kind: the first whose pattern its lowercased name matches."""


def kind(name: str) -> str:
    low = name.lower()
    return next(k for k, pattern in KINDS if re.search(pattern, low))


@contextlib.contextmanager
def device_time(device: torch.device) -> Iterator[list[tuple[str, int, float]]]:
    """Profile the block; after it, the list holds (name, calls, own microseconds) per kernel, longest first: the
    GPU's kernels on CUDA, the aten ops' self CPU time on the CPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rows: list[tuple[str, int, float]] = []
    with torch.profiler.profile(activities=activities) as prof:
        yield rows
    if device.type == "cuda":
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if device.type == "cuda" and e.device_type == DeviceType.CUDA:
            rows.append((e.key, e.count, e.self_device_time_total))
        elif device.type != "cuda" and e.device_type == DeviceType.CPU and e.key.startswith("aten::"):
            rows.append((e.key, e.count, e.self_cpu_time_total))
    rows.sort(key=lambda r: -r[2])


def report(rows: list[tuple[str, int, float]], steps: int, top: int, unit: str = "step") -> str:
    """The kinds' ms per step and shares, then the `top` longest kernels: ms per step, calls per step, share."""
    total = sum(us for _, _, us in rows) or 1.0
    by_kind: dict[str, float] = {}
    for name, _, us in rows:
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + us
    ordered = sorted(by_kind.items(), key=lambda x: -x[1])
    kinds = ", ".join(f"{k} {us / steps / 1e3:.2f} ({us / total:.0%})" for k, us in ordered)
    lines = [f"device ms/{unit}: {kinds}; {len(rows)} kernels, total {total / steps / 1e3:.2f}"]
    lines.append(f"  {'ms/' + unit:>14}{'calls/' + unit:>17}{'share':>7}  kernel")
    for name, calls, us in rows[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"  {us / steps / 1e3:>14.3f}{calls / steps:>17.1f}{us / total:>7.1%}  {short}")
    return "\n".join(lines)
