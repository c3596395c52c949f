"""Progress of one run: a bar on a terminal, periodic log lines on request, quiet in CI and pipes."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from sweep.config import Progress

log = logging.getLogger("sweep")


def resolve_mode(mode: Progress) -> Progress:
    """auto: a bar only for a person at a terminal; CI and redirected output get no per-step output."""
    if mode is not Progress.auto:
        return mode
    if os.environ.get("CI") or not sys.stderr.isatty():
        return Progress.none
    return Progress.bar


class RunProgress:
    """Reports the steps of one run."""

    def __init__(self, total: int, mode: Progress, log_every: int, label: str = ""):
        self.mode = resolve_mode(mode)
        self.log_every = log_every
        self.total = total
        self.label = label
        self._bar = (
            tqdm(total=total, desc=label or "train", leave=False, dynamic_ncols=True, file=sys.stderr)
            if self.mode is Progress.bar
            else None
        )

    def update(self, step: int, loss: float, scale: float | None = None) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4g}", **({"scale": f"{scale:g}"} if scale else {}), refresh=False)
        elif self.mode is Progress.log and (step + 1) % self.log_every == 0:
            log.info(
                "%sstep %d/%d loss %.4g%s",
                f"{self.label} " if self.label else "",
                step + 1,
                self.total,
                loss,
                f" scale {scale:g}" if scale else "",
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
