"""logger=tensorboard: each run's curves and verdict as TensorBoard event files in its run directory.

    python -m sweep -m logger=tensorboard optim.lr=1e-4,1e-3,1e-2 && tensorboard --logdir <sweep dir>

Every metrics.csv column is a scalar of the same name, at the same steps (blank cells are left out).
TensorBoard scalars are float32: its default (fast, Rust) loader shows no double-precision scalar at all
(tensorboard 2.21, tensorboard-data-server 0.7.2), so each value is metrics.csv's rounded to float32 once,
which for the values computed in fp32 (loss, grad_norm, attention stats) is the same number exactly.
At the end the run writes its verdict and first bad step as text (tag `verdict`) and an HParams
session: the swept params plus `status`, `verdict` and `first_bad_step` as its hparams, so TensorBoard's
HParams tab shows the sweep's table, one row per run, with the last value of every scalar. torch's
SummaryWriter writes the files; this module is imported only when logger=tensorboard is chosen.
"""

from __future__ import annotations

from pathlib import Path

from sweep.run.results import METRIC_COLUMNS, RunResult

SCALARS = tuple(c for c in METRIC_COLUMNS if c != "step")


def hparam_value(value):
    """A param as an HParams value: numbers, strings and bools as they are, anything else (a list) as text."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class TensorBoardSink:
    """One run's event files (sweep.run.results.MetricSink)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, params: dict) -> None:
        self.log_dir, self.params = Path(log_dir), params
        self.writer = None
        self.last_step = 0

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Our batches decide when to write: no event count or timer of the writer's own.
        self.writer = SummaryWriter(str(self.log_dir), max_queue=100_000, flush_secs=10**6)

    def write(self, rows: list[dict]) -> None:
        add = self.writer.add_scalar
        for row in rows:
            step = row["step"]
            for key in SCALARS:
                value = row.get(key, "")
                if value != "" and value is not None:
                    add(key, float(value), step)  # float32: TensorBoard's own loader drops doubles
            self.last_step = step
        self.writer.flush()

    def finish(self, result: RunResult, out_dir: Path) -> None:
        from torch.utils.tensorboard.summary import hparams

        r = result
        where = (r.cause or {}).get("where")
        text = f"**{r.status}**" + (f": {r.verdict} at step {r.first_bad_step}" if r.verdict else "")
        text += f" (where: {where}, module: {(r.cause or {}).get('module')})" if where else ""
        text += f"\n\n{r.reason}" if r.reason else ""
        self.writer.add_text("verdict", text, self.last_step)
        hp = {k: hparam_value(v) for k, v in r.params.items() if v is not None}
        hp.update(status=r.status, verdict=r.verdict or "-", first_bad_step=r.first_bad_step)
        _, start_info, end_info = hparams(hp, {})
        file_writer = self.writer._get_file_writer()
        file_writer.add_summary(start_info)
        file_writer.add_summary(end_info)
        self.writer.close()
