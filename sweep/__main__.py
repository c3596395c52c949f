"""Entry point: one run, or a sweep with -m.

    python -m sweep                                   # one run with the defaults
    python -m sweep -m precision=fp32,bf16_amp,fp16_amp optim.lr=1e-4,1e-3,1e-2 attention=flash,math
    python -m sweep -m +experiment=demo               # the demo grid
    python -m sweep --help                            # config groups and options

A mistake in the command line or the config (a typo'd key, a wrong type, an unknown option, a bad
value) is printed as one line naming the key, with exit status 2; set HYDRA_FULL_ERROR=1 for Hydra's
full report with a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from typing import Iterator

import hydra

from sweep import config as _schemas  # noqa: F401  (registers the schema before Hydra composes)
from sweep.config.secrets import literal_password_arg
from sweep.errors import config_error_line, exit_config_error
from sweep.job import run_job

DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
"""What a file system says when it will not take the sweep's files: full, over quota, read-only, not ours."""
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


_hydra_main = hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(run_job)
"""Hydra around the task function, sweep.job.run_job (conf/config.yaml names the job `__main__`, so each run's log
stays __main__.log)."""


def main() -> None:
    """The `dit-sweep` command: `python -m sweep` installed as a script."""
    with command_line():
        _hydra_main()


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Around Hydra's main: a secret on the command line, a full disk or a config mistake ends the command with one
    line (and exit status 1 or 2) instead of a traceback."""
    key = literal_password_arg(sys.argv[1:])
    if key is not None:
        how = (
            "export MLFLOW_TRACKING_URI (or MLFLOW_TRACKING_PASSWORD) and leave logger.mlflow.tracking_uri null"
            if key.lstrip("+~").startswith("logger")
            else "use ledger.storage='${oc.env:SWEEP_LEDGER_URL}' and export SWEEP_LEDGER_URL"
        )
        exit_config_error(
            f"{key.lstrip('+~')}: do not put a password or other secret (a token, a key) on the command line"
            f" (Hydra saves it in its output files); {how}"
        )
    user_wants_traceback = bool(os.environ.get("HYDRA_FULL_ERROR"))
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us so a user mistake can be one line
    try:
        yield
    except KeyboardInterrupt:
        # Ctrl-C outside a run, which listens for it itself (sweep/run/interrupt.py): while Hydra composes, while the
        # sweeper checks its cells, between two runs, or in the sweep's end (diagnosis, confirmation, tables).
        if user_wants_traceback:
            raise
        print(
            "\nsweep: SIGINT: stopped; every result.json written so far stands (the same command resumes a sweep's"
            " unfinished cells; python -m sweep.report SWEEP_DIR writes its tables)",
            file=sys.stderr,
        )
        sys.exit(128 + signal.SIGINT)
    except Exception as exc:
        # Hydra writes each job's .hydra/ before our code runs: a full or read-only disk stops the sweep there.
        # (Hydra's MissingConfigException is an OSError too, without an errno: a config error, below.)
        if isinstance(exc, OSError) and exc.errno in DISK_ERRORS and not user_wants_traceback:
            print(
                f"sweep: stopped: {exc.strerror}: {exc.filename}; every result.json written so far stands",
                file=sys.stderr,
            )
            sys.exit(1)
        line = None if user_wants_traceback else config_error_line(exc)
        if line is None:
            raise
        exit_config_error(line)


if __name__ == "__main__":
    from sweep.exit import exiting

    with exiting(), command_line():  # inline, not main(): the Hydra task is the next frame of ours (docs/design.md)
        _hydra_main()
