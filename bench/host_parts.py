"""Where a loop's host time goes, for the GPU benches (issue #31): wall seconds spent inside named functions.

On a GPU the host only queues kernels; the window's one sync (sweep.run.window.judge_window) is where it waits
for the device. So a loop whose time sits in `sync wait` is bound by the GPU, one whose time sits in the other
parts by the host (launches, snapshots, the rows each step writes).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


@contextlib.contextmanager
def host_parts(parts: dict[str, tuple[object, str]]) -> Iterator[dict[str, float]]:
    """Time each `owner.attr` called inside the block (a class's method or a module's function): {name: seconds}.
    A call made inside another timed one counts in both (a capture's snapshot is in `replay` and `snapshot`)."""
    spent = {name: 0.0 for name in parts}
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in parts.values()]
    for name, (owner, attr, f) in zip(parts, saved):

        def timed(*args, _f=f, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(owner, attr, timed)
    try:
        yield spent
    finally:
        for owner, attr, f in saved:
            setattr(owner, attr, f)


def line(spent: dict[str, float], total: float, steps: int, unit: str = "step") -> str:
    """One line: each part's host ms per step, the rest as `other`, and the total."""
    ms = {name: s / steps * 1e3 for name, s in spent.items()}
    other = total / steps * 1e3 - sum(ms.values())
    parts = ", ".join(f"{name} {v:.2f}" for name, v in [*ms.items(), ("other", other)])
    return f"host ms/{unit}: {parts} (total {total / steps * 1e3:.2f})"
