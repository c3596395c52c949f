"""The adversarial pass of issue 21, as a script: every finding, and its variants, run as a user would.

    PYTHONPATH=. python bench/adversarial.py            # every case (~15 min on 2 cores)
    PYTHONPATH=. python bench/adversarial.py --quick    # one of each kind (~3 min)
    PYTHONPATH=. python bench/adversarial.py -k report  # the cases whose name holds "report"

Each case is real processes (`python -m sweep`, `sweep.report`, `sweep.replay`, `sweep.doctor`) run in a
fresh temporary directory, with any files it needs made here (no network). Its outcome is classified:
- clean: exit 0 with a verdict in result.json, or exit 1/2 with one clear line on stderr and no
  traceback, and the case's own check of what must (not) happen passes;
- traceback: a Python traceback, or a process killed by a signal it did not ask for (rc < 0, 139);
- wrong: the case's check failed (a result lost, a trial left RUNNING, a password written down, ...);
- unclear: exit 1/2 with no line, or many, saying why;
- skipped: the machine cannot stage it (a file mode root ignores, a tmpfs it may not mount).
Prints a table and the totals; exit status 1 when anything is not clean or skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
FAST = ["data.frames=4", "data.height=8", "data.width=8", "data.num_samples=32", "progress=none", "threads=1"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": ""}
ENV.pop("HYDRA_FULL_ERROR")
ENV.pop("SWEEP_LEDGER_URL", None)


@dataclass
class Outcome:
    rc: Optional[int]
    out: str
    err: str
    dir: Path
    extra: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.out + self.err


Check = Callable[[Outcome], Optional[str]]
"""A case's own check: None when what must (not) happen holds, else what went wrong."""


@dataclass
class Case:
    name: str
    args: list  # argv after the interpreter; "{d}" is the case's temporary directory
    check: Optional[Check] = None
    setup: Optional[Callable[[Path], None]] = None
    verdict_rc: tuple = (0,)
    """Exit statuses that are a verdict, not an error (the doctor's 1: bad samples found)."""
    driver: Optional[Callable[["Case", Path], Outcome]] = None  # for kills, signals and reruns
    quick: bool = False
    skip: Optional[str] = None
    timeout: int = 300


# -- helpers --------------------------------------------------------------------------------------------


def run(args: list, d: Path, timeout: int = 300, env: Optional[dict] = None) -> Outcome:
    argv = [PY, *[str(a).replace("{d}", str(d)) for a in args]]
    try:
        p = subprocess.run(argv, cwd=d, env=env or ENV, capture_output=True, text=True, timeout=timeout)
        return Outcome(p.returncode, p.stdout, p.stderr, d)
    except subprocess.TimeoutExpired as e:
        return Outcome(None, _s(e.stdout), _s(e.stderr), d)


def _s(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def sweep(*overrides: str) -> list:
    multirun = ["-m"] if "-m" in overrides else []
    return ["-m", "sweep", *multirun, *FAST, *[o for o in overrides if o != "-m"]]


def result(o: Outcome, rel: str = "run") -> Optional[dict]:
    p = o.dir / rel / "result.json"
    return json.loads(p.read_text()) if p.exists() else None


def exit2_naming(key: str) -> Check:
    def check(o: Outcome) -> Optional[str]:
        if o.rc != 2:
            return f"exit {o.rc}, not 2"
        if key not in o.err:
            return f"the line does not name {key}"
        if list(o.dir.rglob("result.json")):
            return "a run started"
        return None

    return check


def verdict(expected: str) -> Check:
    def check(o: Outcome) -> Optional[str]:
        r = result(o)
        if r is None:
            return f"exit {o.rc}, no result.json"
        got = r.get("verdict") or r.get("status")
        return None if got == expected else f"result says {got!r} ({r.get('reason')}), not {expected!r}"

    return check


def no_secret(o: Outcome) -> Optional[str]:
    if o.rc != 2:
        return f"exit {o.rc}, not 2"
    for p in o.dir.rglob("*"):
        if p.is_file() and b"cr3t" in p.read_bytes():
            return f"the password is written in {p.relative_to(o.dir)}"
    return None


def with_env(extra: dict) -> Callable[["Case", Path], Outcome]:
    def driver(case: "Case", d: Path) -> Outcome:
        return run(case.args, d, timeout=case.timeout, env={**ENV, **extra})

    return driver


def secret_nowhere(o: Outcome, rc: int = 0, but: tuple = ()) -> Optional[str]:
    """The secret `cr3t` is neither printed nor in any file of the case (but those under a folder named in `but`)."""
    if o.rc != rc:
        return f"exit {o.rc}, not {rc}"
    if "cr3t" in o.text:
        return "the secret is printed"
    for p in o.dir.rglob("*"):
        if p.is_file() and not set(but) & set(p.relative_to(o.dir).parts) and b"cr3t" in p.read_bytes():
            return f"the secret is written in {p.relative_to(o.dir)}"
    return None


def base_run(d: Path, name: str = "base", *extra: str) -> Path:
    """A real 2-step run (with checkpoints) to copy from: made once per bench, copied per case."""
    cache = BASE / name
    if not (cache / "result.json").exists():
        o = run(sweep("steps=2", "checkpoint.every=1", f"hydra.run.dir={cache}", *extra), BASE)
        assert (cache / "result.json").exists(), o.text[-2000:]
    return cache


def copy_run(d: Path, rel: str = "sweepdir/0", name: str = "base") -> Path:
    dst = d / rel
    shutil.copytree(base_run(d, name), dst)
    return dst


def report_names_skip(o: Outcome) -> Optional[str]:
    if o.rc != 0:
        return f"exit {o.rc}"
    if "1/result.json" not in o.text and "/1" not in o.text:
        return "the damaged result.json is not named"
    return None


def damaged_report(content) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        copy_run(d, "sweepdir/0")
        bad = copy_run(d, "sweepdir/1")
        r = json.loads((bad / "result.json").read_text())
        text = content(r) if callable(content) else content
        (bad / "result.json").write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


def report_ok(o: Outcome) -> Optional[str]:
    return None if o.rc == 0 else f"exit {o.rc}"


def ledger_trials(db: Path) -> list:
    con = sqlite3.connect(db)
    try:
        return con.execute("select number, state from trials order by number").fetchall()
    finally:
        con.close()


# -- drivers: kills, signals, reruns --------------------------------------------------------------------


def kill9_rerun(case: Case, d: Path) -> Outcome:
    """Start the sweep, kill -9 it once a first result.json is written, run the same command again."""
    argv = [PY, *[str(a).replace("{d}", str(d)) for a in case.args]]
    p = subprocess.Popen(argv, cwd=d, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None and not list((d / "s").glob("*/result.json")):
        time.sleep(0.2)
    time.sleep(1.0)  # into the next run
    p.kill()
    p.wait()
    o = run(case.args, d, timeout=case.timeout)
    o.extra["killed_rc"] = p.returncode
    return o


def signal_at_step(sig: int, group: bool = False, needle: str = "step 3/") -> Callable[[Case, Path], Outcome]:
    def driver(case: Case, d: Path) -> Outcome:
        argv = [PY, *[str(a).replace("{d}", str(d)) for a in case.args]]
        p = subprocess.Popen(
            argv, cwd=d, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        lines: list = []
        import threading

        threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
        deadline = time.time() + 240

        def started() -> bool:
            if any(needle in ln for ln in lines):
                return True
            for f in [*d.rglob("*.log"), *d.rglob("*_log.out"), *d.rglob("*_log.err"), *d.rglob("metrics.csv")]:
                if f.name == "metrics.csv":
                    if f.read_text(errors="replace").count("\n") > 4:
                        return True
                    continue
                try:
                    if needle in f.read_text(errors="replace"):
                        return True
                except OSError:
                    pass
            return False

        while time.time() < deadline and p.poll() is None and not started():
            time.sleep(0.2)
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        for _ in range(100):
            left = subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True, text=True).stdout.split()
            if not left:
                break
            time.sleep(0.1)
        for pid in left:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.5)
        o = Outcome(p.returncode, "".join(lines), "", d, {"left": left})
        o.extra["statuses"] = [json.loads(f.read_text())["status"] for f in (d / "s").glob("*/result.json")]
        db = d / "s" / "ledger.db"
        o.extra["trials"] = ledger_trials(db) if db.exists() else []
        if case.check is not None:  # the resume: the same command again
            again = run(case.args, d, timeout=case.timeout)
            o.extra["rerun"] = again
        return o

    return driver


def interrupted_and_resumed(sig: int) -> Check:
    def check(o: Outcome) -> Optional[str]:
        if o.rc != 128 + sig:
            return f"exit {o.rc}, not {128 + sig}"
        if o.extra.get("left"):
            return f"processes left running: {o.extra['left']}"
        statuses = o.extra["statuses"]
        if not statuses or any(s != "interrupted" for s in statuses):
            return f"statuses after the signal: {statuses}"
        if any(state == "RUNNING" for _, state in o.extra["trials"]):
            return "a trial is left RUNNING"
        again = o.extra["rerun"]
        if again.rc != 0:
            return f"the rerun exits {again.rc}"
        final = sorted(json.loads(p.read_text())["status"] for p in (o.dir / "s").glob("*/result.json"))
        if final.count("stable") < 3:
            return f"after the rerun: {final}"
        return None

    return check


def every_cell_once(cells: int, optuna: bool = False) -> Check:
    def check(o: Outcome) -> Optional[str]:
        if o.rc != 0:
            return f"the rerun exits {o.rc}: {o.err.strip().splitlines()[-1:]}"
        results = [json.loads(p.read_text()) for p in (o.dir / "s").glob("*/result.json")]
        lrs = sorted(r["params"].get("optim.lr") for r in results if r["status"] in ("stable", "diverged"))
        if len(set(lrs)) != cells or len(lrs) != cells:
            return f"finished cells after the rerun: {lrs}"
        summary = (o.dir / "s" / "summary.md").read_text() if (o.dir / "s" / "summary.md").exists() else ""
        counted = re.search(r"[^\n]*\b\d+ running\b[^\n]*", summary)
        if counted:
            return f"summary.md still counts a run as running: {counted[0][:80]}"
        if optuna and any(state == "RUNNING" for _, state in ledger_trials(o.dir / "s" / "ledger.db")):
            return "a trial is left RUNNING"
        return None

    return check


_AT_ONCE = """
import os, sys, time
from pathlib import Path
barrier = Path(sys.argv[1])
sys.argv = [sys.argv[2], *sys.argv[3:]]
from sweep.__main__ import main  # the imports first: every process then reaches the claim at once
(barrier / f"ready.{os.getpid()}").touch()
while not (barrier / "go").exists():
    time.sleep(0.01)
time.sleep(max(0.0, float((barrier / "go").read_text()) - time.time()))
main()
"""


def at_once(n: int) -> Callable[[Case, Path], Outcome]:
    """Start n copies of the case's command (the last with seed=1: another sweep) held at a barrier until
    all are ready, then released at the same moment."""

    def driver(case: Case, d: Path) -> Outcome:
        barrier = d / "barrier"
        barrier.mkdir()
        args = [str(a).replace("{d}", str(d)) for a in case.args[2:]]  # after "-m sweep"
        commands = [args] * (n - 1) + [[*args, "seed=1"]]
        procs = [
            subprocess.Popen(
                [PY, "-c", _AT_ONCE, str(barrier), "sweep", *c],
                cwd=d,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in commands
        ]
        deadline = time.time() + 120
        while len(list(barrier.glob("ready.*"))) < n and time.time() < deadline:
            time.sleep(0.05)
        (barrier / "go").write_text(str(time.time() + 0.3))
        outs = [p.communicate(timeout=case.timeout) for p in procs]
        ran = [i for i, p in enumerate(procs) if p.returncode == 0]
        main = ran[0] if ran else 0
        o = Outcome(procs[main].returncode, outs[main][0], outs[main][1], d)
        o.extra["codes"] = [p.returncode for p in procs]
        o.extra["refused"] = [outs[i][1] for i, p in enumerate(procs) if p.returncode == 2]
        return o

    return driver


def one_of_many_ran(o: Outcome) -> Optional[str]:
    codes = sorted(o.extra["codes"])
    if codes != [0] + [2] * (len(codes) - 1):
        return f"exit statuses {o.extra['codes']}: not one run and the others refused"
    for err in o.extra["refused"]:
        if len([ln for ln in err.splitlines() if ln.strip()]) != 1:
            return f"a refusal is not one line: {err.strip()[:120]}"
    db = o.dir / "s" / "ledger.db"
    dirs = [t for t in ledger_run_dirs(db)] if db.exists() else []
    if len(dirs) != len(set(dirs)) or len(dirs) != 2:
        return f"ledger trials per job dir: {dirs}"
    return None


def ledger_run_dirs(db: Path) -> list:
    con = sqlite3.connect(db)
    try:
        rows = con.execute("select value_json from trial_user_attributes where key='run_dir'").fetchall()
        return [json.loads(v) for (v,) in rows]
    finally:
        con.close()


# -- the cases ------------------------------------------------------------------------------------------

FLOAT_KEYS = [
    "optim.lr",
    "optim.weight_decay",
    "optim.eps",
    "optim.grad_clip",
    "monitor.spike_factor",
    "monitor.ema_beta",
    "precision.scaler.init_scale",
    "data.range_limit",
    "model.qk_gain",
    "objective.flow_shift",
    "objective.loss_weight",
    "ledger.pruner.upper",
    "+tag",
]

LONG = "a" * 300


def cases() -> list[Case]:
    root = os.geteuid() == 0
    cs: list[Case] = []
    # Finding: inf/nan on the command line; variant: every float key, both values, and a grid cell.
    for key in FLOAT_KEYS:
        for value in ("inf", "nan"):
            cs.append(
                Case(
                    f"float {key}={value}",
                    sweep(f"{key}={value}", "hydra.run.dir={d}/run"),
                    exit2_naming(key.lstrip("+")),
                    quick=key == "optim.lr",
                )
            )
    cs.append(
        Case(
            "grid cell optim.lr=inf",
            sweep("-m", "optim.lr=1e-3,inf", "hydra.sweep.dir={d}/s"),
            exit2_naming("optim.lr"),
            quick=True,
        )
    )
    cs.append(
        Case("betas [0.9,nan]", sweep("optim.betas=[0.9,nan]", "hydra.run.dir={d}/run"), exit2_naming("optim.betas"))
    )
    # Other values a user types.
    for over, key in [
        ("threads=100000", "threads"),
        ("seed=100000000000000000000000000", "seed"),
        ("seed=-1", "seed"),
        ("steps=0", "steps"),
        ("optim.lrr=1e-3", "optim.lrr"),
        ("optim.lr=fast", "optim.lr"),
        ("optim.lr=", "optim.lr"),
        ("precision=fp8", "precision"),
        ("precision=null", "precision"),
        ("replicates=0", "replicates"),
        ("data=video_folder", "data.path"),
        ("data.channels=2147483648", "data.channels"),
        ("data.batch_size=100000000", "data.batch_size"),
        ("data.num_samples=100000000", "data.num_samples"),
        ("model.width=1048576", "model.width"),
        ("model.depth=1000000000", "model.depth"),
        ("+ünïcödé=1", "nïcödé"),
    ]:
        cs.append(
            Case(
                f"value {over}",
                sweep(over, "hydra.run.dir={d}/run"),
                exit2_naming(key),
                quick=over.startswith(("threads", "data.channels")),
            )
        )
    # Finding (issue 33): one size on a ladder was ignored (the ladder's sizes ran).
    for ladder, single in (("width", "model.width=32"), ("depth", "model.depth=2")):
        cs.append(
            Case(
                f"+ladder={ladder} {single}",
                sweep("-m", f"+ladder={ladder}", single, "hydra.sweep.dir={d}/s", "steps=2"),
                exit2_naming(single.split("=")[0]),
            )
        )
    # Finding (issue 33): a repeated value in a sweep axis is not a replicate.
    for axis in ("optim.lr=1e-3,1e-3,3e-2", "optim.lr=1e-3,0.001", "precision=fp32,bf16_amp,fp32"):
        cs.append(
            Case(
                f"repeated grid value {axis}",
                sweep("-m", axis, "hydra.sweep.dir={d}/s"),
                exit2_naming(axis.split("=")[0]),
            )
        )
    cs.append(
        Case(
            "repeated Optuna choice",
            sweep(
                "-m",
                "hydra/sweeper=optuna_sweep",
                "hydra.sweeper.sampler.name=grid",
                "optim.lr=choice(1e-3,0.001)",
                "hydra.sweep.dir={d}/s",
            ),
            exit2_naming("optim.lr"),
        )
    )
    cs.append(
        Case(
            "huge seed in a grid",
            sweep("-m", "seed=0,100000000000000000000000000", "hydra.sweep.dir={d}/s"),
            exit2_naming("seed"),
        )
    )
    cs.append(Case("300-char run dir", sweep(f"hydra.run.dir={{d}}/{LONG}"), exit2_naming("hydra.run.dir"), quick=True))
    cs.append(
        Case(
            "300-char sweep subdir",
            sweep("-m", "optim.lr=1e-3,2e-3", "hydra.sweep.dir={d}/s", f"hydra.sweep.subdir={LONG}"),
            exit2_naming("hydra.sweep.subdir"),
        )
    )

    # Finding: model.init_from missing / text / empty or bad weights files.
    cs.append(
        Case(
            "init_from missing",
            sweep("model.init_from={d}/nope.safetensors", "hydra.run.dir={d}/run"),
            exit2_naming("model.init_from"),
            quick=True,
        )
    )
    cs.append(
        Case(
            "init_from text file",
            sweep("model.init_from={d}/notes.txt", "hydra.run.dir={d}/run"),
            exit2_naming("model.init_from"),
            setup=lambda d: (d / "notes.txt").write_text("hi"),
        )
    )
    for name, data in [
        ("empty.safetensors", b""),
        ("junk.safetensors", os.urandom(4096)),
        ("junk.pt", os.urandom(4096)),
        ("empty.pt", b""),
    ]:
        cs.append(
            Case(
                f"init_from {name}",
                sweep(f"model.init_from={{d}}/{name}", "hydra.run.dir={d}/run", "steps=2"),
                verdict("corrupt_checkpoint"),
                setup=lambda d, name=name, data=data: (d / name).write_bytes(data),
                quick=name == "empty.safetensors",
            )
        )
    cs.append(
        Case(
            "init_from a pickle bomb .pt",
            sweep("model.init_from={d}/bomb.pt", "hydra.run.dir={d}/run", "steps=2"),
            lambda o: verdict("corrupt_checkpoint")(o) or ("the pickle ran" if (o.dir / "PWNED").exists() else None),
            setup=lambda d: __import__("pickle").dump(_Bomb(str(d / "PWNED")), open(d / "bomb.pt", "wb")),
        )
    )

    # Finding (issue 33): model.target names something that cannot be a model factory; it must not be called.
    for target, kw in [
        ("os:system", "model.kwargs={command:'touch {d}/PWNED'}"),
        ("builtins:eval", "model.kwargs={}"),
        ("collections:OrderedDict", "model.kwargs={}"),
    ]:
        cs.append(
            Case(
                f"model.target={target}",
                sweep("model=custom", f"model.target={target}", kw, "hydra.run.dir={d}/run"),
                lambda o: (
                    exit2_naming("model.target")(o) or ("the factory ran" if (o.dir / "PWNED").exists() else None)
                ),
                quick=target == "os:system",
            )
        )

    cs += held_out_red_team_cases()  # issue 45, items 1, 3-7 and 10
    cs += lowprec_cases()  # issue 46: fp8 matmuls, fp8 base storage, the optimizer axis

    # Finding (issue 33): config mistakes that surfaced as crashed runs, and a custom model with no size limit.
    import torch

    no_cuda = None if not torch.cuda.is_available() else "this machine has CUDA: device=cuda is no mistake here"
    cs.append(
        Case(
            "device=cuda without CUDA",
            sweep("device=cuda", "hydra.run.dir={d}/run"),
            exit2_naming("device"),
            skip=no_cuda,
        )
    )
    cs.append(
        Case(
            "device=cuda:1 in a grid cell without CUDA",
            sweep("-m", "device=cpu,cuda:1", "hydra.sweep.dir={d}/s", "steps=2"),
            exit2_naming("device"),
            skip=no_cuda,
        )
    )
    for target in ("wrong_shape", "returns_a_tuple", "forward_raises", "huge"):
        cs.append(
            Case(
                f"custom model {target}",
                sweep(
                    "model=custom", f"model.target=tests.custom_factories:{target}", "hydra.run.dir={d}/run", "steps=2"
                ),
                exit2_naming("model."),
                timeout=60 if target == "huge" else 300,
            )
        )

    # Finding (issue 33): a released config with num_layers=100000 and no shrink took 182 s to refuse.
    def deep_config(d: Path) -> None:
        config = json.loads((REPO / "tests" / "data" / "diffusers_configs" / "cogvideox_2b.json").read_text())
        (d / "deep.json").write_text(json.dumps({**config, "num_layers": 100_000}))

    def refused_fast(o: Outcome) -> Optional[str]:
        return exit2_naming("model.shrink")(o) or (None if o.extra.get("s", 0) < 30 else f"took {o.extra['s']:.0f} s")

    def timed(case: Case, d: Path) -> Outcome:
        t0 = time.time()
        o = run(case.args, d, timeout=case.timeout)
        o.extra["s"] = time.time() - t0
        return o

    cs.append(
        Case(
            "diffusers_config num_layers=100000, no shrink",
            sweep("model=diffusers_config", "model.config={d}/deep.json", "hydra.run.dir={d}/run"),
            refused_fast,
            setup=deep_config,
            driver=timed,
            timeout=120,
        )
    )

    # Finding (issue 33): checkpoint.every silently turned windows off.
    cs.append(
        Case(
            "checkpoint.every with monitor.sync_every=4",
            sweep("checkpoint.every=1", "monitor.sync_every=4", "steps=2", "hydra.run.dir={d}/run"),
            lambda o: (
                verdict("stable")(o) or (None if "windows are off" in o.text else "windows turned off in silence")
            ),
        )
    )

    # Finding (issue 33): a directory or a symlink loop as model.config said "no such file".
    def loop(d: Path) -> None:
        os.symlink(d / "b.json", d / "a.json")
        os.symlink(d / "a.json", d / "b.json")

    for name, arg, setup, words in [
        ("a directory", "model.config={d}/cfgdir", lambda d: (d / "cfgdir").mkdir(), "a directory"),
        ("a symlink loop", "model.config={d}/a.json", loop, "a symlink loop"),
    ]:
        cs.append(
            Case(
                f"model.config is {name}",
                sweep("model=diffusers_config", arg, "hydra.run.dir={d}/run"),
                lambda o, words=words: (
                    exit2_naming("model.config")(o) or (None if words in o.err else f"does not say {words!r}")
                ),
                setup=setup,
            )
        )

    # Finding: resume from a checkpoint of another size or precision; variants: a manifest without bytes.
    ck = "{d}/sweepdir/0/checkpoints/step_000002"
    cs.append(
        Case(
            "resume_from another width",
            sweep(f"checkpoint.resume_from={ck}", "model.width=64", "hydra.run.dir={d}/run", "steps=4"),
            lambda o: (
                None
                if o.rc == 2 and "model.width" in o.err
                else (verdict("corrupt_checkpoint")(o) if "width" in o.text else "the keys that differ are not named")
            ),
            setup=lambda d: copy_run(d),
            quick=True,
        )
    )
    cs.append(
        Case(
            "resume_from another precision",
            sweep(f"checkpoint.resume_from={ck}", "precision=fp16_pure", "hydra.run.dir={d}/run", "steps=4"),
            lambda o: (
                None
                if o.rc == 2 and "precision" in o.err
                else ("the precision mismatch is not named" if "precision" not in o.text else None)
            ),
            setup=lambda d: copy_run(d),
        )
    )
    cs.append(
        Case(
            "resume fp32 checkpoint with fp16_amp",
            sweep(f"checkpoint.resume_from={ck}", "precision=fp16_amp", "hydra.run.dir={d}/run", "steps=4"),
            lambda o: None if o.rc == 2 or "scale" in o.text.lower() else "trains at loss scale 1.0 without a word",
            setup=lambda d: copy_run(d),
        )
    )

    def drop_bytes(d: Path) -> None:
        run_dir = copy_run(d)
        m = run_dir / "checkpoints" / "step_000002" / "manifest.json"
        j = json.loads(m.read_text())
        files = j.get("files", j)
        for entry in files.values() if isinstance(files, dict) else files:
            if isinstance(entry, dict):
                entry.pop("bytes", None)
        m.write_text(json.dumps(j))

    cs.append(
        Case(
            "manifest entry without bytes",
            sweep(f"checkpoint.resume_from={ck}", "hydra.run.dir={d}/run", "steps=4"),
            lambda o: None if o.rc == 2 else verdict("corrupt_checkpoint")(o),
            setup=drop_bytes,
        )
    )

    def flip_weights(d: Path) -> None:
        f = copy_run(d) / "checkpoints" / "step_000002" / "model.safetensors"
        b = bytearray(f.read_bytes())
        b[-5] ^= 0xFF
        f.write_bytes(bytes(b))

    cs.append(
        Case(
            "resume a bit-flipped checkpoint",
            sweep(f"checkpoint.resume_from={ck}", "hydra.run.dir={d}/run", "steps=4"),
            verdict("corrupt_checkpoint"),
            setup=flip_weights,
        )
    )

    # Finding: command-line passwords (every bypass).
    for name, over in [
        ("user:pw@", "ledger.storage=postgresql://me:s3cr3t@db/x"),
        ("?password=", "ledger.storage=postgresql://me@db/x?password=s3cr3t"),
        ("ledger={storage:...}", "ledger={storage:'postgresql://me:s3cr3t@db/x'}"),
        ("/ in password", "ledger.storage=postgresql://me:s3/cr3t@db/x"),
        ("sweep of URLs", "ledger.storage=sqlite:///a.db,postgresql://me:s3cr3t@db/x"),
        ("mlflow URI", "logger.mlflow.tracking_uri=http://me:s3cr3t@mlflow:5000"),
        # issue 33: every secret-bearing query key, libpq's and a tracking server's
        ("?sslpassword= (libpq)", "ledger.storage=postgresql://me@db/x?sslpassword=s3cr3t"),
        ("?SSLPassword= quoted", "ledger.storage='postgresql://me@db/x?sslmode=require&SSLPassword=s3cr3t'"),
        ("mlflow ?token=", "logger.mlflow.tracking_uri=http://mlflow:5000?token=s3cr3t"),
        ("mlflow ?api_key=", "logger.mlflow.tracking_uri='https://mlflow/api?x=1&api_key=s3cr3t'"),
    ]:
        cs.append(Case(f"password {name}", sweep(over, "hydra.run.dir={d}/run"), no_secret, quick=name == "?password="))
    # issue 33: a secret in the query of a URL from the environment is masked everywhere it is written.
    for name, over, env in [
        (
            "ledger",
            "ledger.storage=${oc.env:SWEEP_LEDGER_URL}",
            {"SWEEP_LEDGER_URL": "postgresql://me@127.0.0.1:9/x?sslpassword=s3cr3t"},
        ),
        ("mlflow", "logger.mlflow.tracking_uri=${oc.env:MY_URI}", {"MY_URI": "http://127.0.0.1:9/?token=s3cr3t"}),
    ]:
        extra = ["logger=mlflow", "logger.mlflow.retries=0"] if name == "mlflow" else ["ledger.lock_timeout_s=2"]
        cs.append(
            Case(
                f"secret query key from the environment ({name})",
                sweep(over, *extra, "hydra.run.dir={d}/run", "steps=2"),
                secret_nowhere,
                driver=with_env(env),
            )
        )
    cs.append(
        Case(
            "plain postgresql:// URL, server down",
            sweep(
                "ledger.storage=postgresql://me@127.0.0.1:9/x",
                "hydra.run.dir={d}/run",
                "steps=2",
                "ledger.lock_timeout_s=5",
            ),
            lambda o: "asks for a driver" if "No module named" in o.text else None,
        )
    )

    # Finding: the report on damaged result.json files (every variant).
    for name, content in [
        ("a list", "[1, 2]"),
        ("truncated", lambda r: json.dumps(r)[:40]),
        ("empty", ""),
        ("not UTF-8", b"\xff\xfe\x00garbage"),
        ("cause as a string", lambda r: json.dumps({**r, "cause": "boom"})),
        ("params as a list", lambda r: json.dumps({**r, "params": [1, 2]})),
        ("an integer of 10^30", lambda r: json.dumps({**r, "steps_run": 10**30, "final_loss": 10**30})),
        ("status unknown", lambda r: json.dumps({**r, "status": "weird"})),
        ("NaN literal", lambda r: json.dumps(r).replace(str(r["final_loss"]), "NaN")),
    ]:
        check = (
            report_ok
            if name in ("cause as a string", "params as a list", "an integer of 10^30", "NaN literal")
            else report_names_skip
        )
        cs.append(
            Case(
                f"report: result.json {name}",
                ["-m", "sweep.report", "{d}/sweepdir", "--no-html"],
                check,
                setup=damaged_report(content),
                quick=name == "a list",
            )
        )
    # Finding (issue 33): a ladder target with no logarithm.
    for target in ("0", "-3", "inf"):
        cs.append(
            Case(
                f"report --ladder-target {target}",
                ["-m", "sweep.report", "{d}/sweepdir", "--no-html", "--ladder-target", target],
                lambda o: None if o.rc == 2 and "--ladder-target" in o.err else f"exit {o.rc}",
                setup=lambda d: copy_run(d),
            )
        )
    cs.append(
        Case(
            "report: no such dir",
            ["-m", "sweep.report", "{d}/nothing"],
            lambda o: None if o.rc in (1, 2) else f"exit {o.rc}",
        )
    )

    def xss(o: Outcome) -> Optional[str]:
        if o.rc != 0:
            return f"exit {o.rc}"
        for f in [o.dir / "s" / "summary.md", *o.dir.rglob("report.html")]:
            if f.exists() and "<script>alert" in f.read_text():
                return f"raw <script> in {f.name}"
        return None

    cs.append(
        Case(
            "<script> in summary.md",
            sweep("-m", "optim.lr=1e-3,2e-3", "+tag='<script>alert(1)</script>'", "hydra.sweep.dir={d}/s", "steps=2"),
            xss,
            timeout=400,
        )
    )

    # Finding: replay out of range, and on a stable run.
    cs.append(
        Case(
            "replay --step -3",
            ["-m", "sweep.replay", "{d}/sweepdir/0", "--step", "-3"],
            lambda o: None if o.rc == 2 else f"exit {o.rc}",
            setup=lambda d: copy_run(d),
            quick=True,
        )
    )
    cs.append(
        Case(
            "replay --step 999",
            ["-m", "sweep.replay", "{d}/sweepdir/0", "--step", "999"],
            lambda o: None if o.rc == 2 else f"exit {o.rc}",
            setup=lambda d: copy_run(d),
        )
    )
    cs.append(
        Case(
            "replay a stable run",
            ["-m", "sweep.replay", "{d}/sweepdir/0"],
            lambda o: (
                "claims the loss went non-finite"
                if "went non-finite" in o.out.replace("nothing went non-finite", "")
                else None
            ),
            setup=lambda d: copy_run(d),
        )
    )
    cs.append(
        Case(
            "replay a dir with no run",
            ["-m", "sweep.replay", "{d}"],
            lambda o: None if o.rc in (1, 2) else f"exit {o.rc}",
        )
    )

    # Finding: the doctor writes through a planted symlink; chmod 000 files.
    def plant(d: Path) -> None:
        (d / "data").mkdir()
        import torch

        torch.save(torch.zeros(3, 4, 8, 8), d / "data" / "a.pt")
        (d / "victim.txt").write_text("keep me")
        os.symlink(d / "victim.txt", d / "data" / "doctor_report.json")

    cs.append(
        Case(
            "doctor: symlink planted for its report",
            ["-m", "sweep.doctor", "{d}/data"],
            lambda o: "wrote through the symlink" if (o.dir / "victim.txt").read_text() != "keep me" else None,
            setup=plant,
            quick=True,
            verdict_rc=(0, 1),  # 1: the zero clip is `constant`, a bad sample found
        )
    )

    def unreadable(d: Path) -> None:
        (d / "data" / "sub").mkdir(parents=True)
        import torch

        torch.save(torch.zeros(3, 4, 8, 8), d / "data" / "a.pt")
        torch.save(torch.zeros(3, 4, 8, 8), d / "data" / "sub" / "b.pt")
        os.chmod(d / "data" / "sub", 0)

    skip_root = "root reads a chmod 000 file anyway" if root else None
    cs.append(
        Case(
            "doctor: unreadable subfolder",
            ["-m", "sweep.doctor", "{d}/data"],
            lambda o: "says all clean" if o.rc == 0 else None,
            setup=unreadable,
            skip=skip_root,
            verdict_rc=(1,),
        )
    )
    cs.append(
        Case(
            "init_from chmod 000",
            sweep("model.init_from={d}/w.safetensors", "hydra.run.dir={d}/run"),
            lambda o: "reported as missing" if "No such file" in o.text else None,
            setup=lambda d: ((d / "w.safetensors").write_bytes(b"x"), os.chmod(d / "w.safetensors", 0)),
            skip=skip_root,
        )
    )

    # Finding: two sweeps in one sweep dir.
    def two_sweeps(case: Case, d: Path) -> Outcome:
        first = run(sweep("-m", "optim.lr=1e-3,2e-3", "hydra.sweep.dir={d}/s", "steps=2"), d, timeout=400)
        second = run(case.args, d, timeout=400)
        second.extra["first"] = first.rc
        return second

    cs.append(
        Case(
            "two sweeps in one sweep dir",
            sweep("-m", "optim.lr=3e-3,4e-3", "hydra.sweep.dir={d}/s", "steps=2"),
            lambda o: (
                None
                if o.rc == 2 and len(list((o.dir / "s").glob("*/result.json"))) == 2
                else f"exit {o.rc}, {len(list((o.dir / 's').glob('*/result.json')))} results"
            ),
            driver=two_sweeps,
            timeout=400,
        )
    )

    # Finding (issue 33): sweeps started at the same moment into one new sweep dir.
    cs.append(
        Case(
            "three sweeps at once into one new sweep dir",
            sweep("-m", "optim.lr=1e-3,2e-3", "hydra.sweep.dir={d}/s", "steps=2"),
            one_of_many_ran,
            driver=at_once(3),
            timeout=400,
        )
    )

    # Finding (issue 33): a single run into a sweep's root, or into a run dir of another config.
    def sweep_root(d: Path) -> None:
        (d / "s" / "0" / ".hydra").mkdir(parents=True)
        (d / "s" / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [optim.lr=1e-3]\n")
        (d / "s" / "0" / ".hydra" / "overrides.yaml").write_text("- optim.lr=1e-3\n")

    cs.append(
        Case(
            "single run into a sweep's root",
            sweep("steps=2", "hydra.run.dir={d}/s"),
            lambda o: (
                exit2_naming("hydra.run.dir")(o)
                or ("wrote into the sweep" if (o.dir / "s" / "result.json").exists() else None)
            ),
            setup=sweep_root,
        )
    )

    def then(first: list) -> Callable[[Case, Path], Outcome]:
        def driver(case: Case, d: Path) -> Outcome:
            before = run(first, d, timeout=case.timeout)
            o = run(case.args, d, timeout=case.timeout)
            o.extra["first_rc"] = before.rc
            o.extra["first_result"] = (d / "run" / "result.json").read_text() if before.rc == 0 else None
            return o

        return driver

    def unchanged_and(rc: int) -> Check:
        def check(o: Outcome) -> Optional[str]:
            if o.extra["first_rc"] != 0:
                return f"the first run exits {o.extra['first_rc']}"
            if o.rc != rc:
                return f"exit {o.rc}, not {rc}"
            if rc == 2 and (o.dir / "run" / "result.json").read_text() != o.extra["first_result"]:
                return "the first run's result.json was overwritten"
            return None

        return check

    first = sweep("steps=2", "optim.lr=1e-3", "ledger.enabled=false", "hydra.run.dir={d}/run")
    cs.append(
        Case(
            "single run into a run dir of another config",
            sweep("steps=2", "optim.lr=3e-2", "ledger.enabled=false", "hydra.run.dir={d}/run"),
            unchanged_and(2),
            driver=then(first),
        )
    )
    cs.append(
        Case(
            "single run again into its run dir (same config)",
            sweep("steps=2", "optim.lr=0.001", "ledger.enabled=false", "hydra.run.dir={d}/run"),
            unchanged_and(0),
            driver=then(first),
        )
    )

    # Finding (issue 33): a cell re-run after its result.json was deleted left two live trials for it.
    def delete_and_rerun(case: Case, d: Path) -> Outcome:
        first = run(case.args, d, timeout=case.timeout)
        (d / "s" / "0" / "result.json").unlink(missing_ok=True)
        o = run(case.args, d, timeout=case.timeout)
        o.extra["first_rc"] = first.rc
        return o

    def old_trial_superseded(o: Outcome) -> Optional[str]:
        if o.extra["first_rc"] != 0 or o.rc != 0:
            return f"exits {o.extra['first_rc']}, {o.rc}"
        con = sqlite3.connect(o.dir / "s" / "ledger.db")
        try:
            marked = con.execute("select count(*) from trial_user_attributes where key='superseded_by'").fetchone()[0]
            trials = con.execute("select count(*) from trials").fetchone()[0]
        finally:
            con.close()
        return None if (trials, marked) == (3, 1) else f"{trials} trials, {marked} marked superseded"

    cs.append(
        Case(
            "re-run a cell whose result.json was deleted",
            sweep("-m", "optim.lr=1e-3,2e-3", "hydra.sweep.dir={d}/s", "steps=2"),
            old_trial_superseded,
            driver=delete_and_rerun,
            timeout=400,
        )
    )

    # Finding: kill -9 and the same command again (grid and Optuna grid).
    grid = sweep("-m", "optim.lr=1e-3,2e-3,3e-3,4e-3", "hydra.sweep.dir={d}/s", "steps=6")
    cs.append(Case("kill -9 a grid, rerun", grid, every_cell_once(4), driver=kill9_rerun, quick=True, timeout=600))
    ogrid = sweep(
        "-m",
        "hydra/sweeper=optuna_sweep",
        "hydra.sweeper.sampler.name=grid",
        "optim.lr=choice(1e-3,2e-3,3e-3,4e-3)",
        "hydra.sweep.dir={d}/s",
        "steps=6",
    )
    cs.append(
        Case(
            "kill -9 an Optuna grid, rerun at once",
            ogrid,
            every_cell_once(4, optuna=True),
            driver=kill9_rerun,
            timeout=600,
        )
    )

    # Finding: signals, per launcher.
    long = ["steps=200", "log_every=1", "progress=log", "hydra.sweep.dir={d}/s", "optim.lr=1e-3,2e-3,3e-3"]
    for launcher in ("basic", "joblib", "submitit_local"):
        extra = [f"hydra/launcher={launcher}"] if launcher != "basic" else []
        extra += ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else []
        for sig, group in ((signal.SIGTERM, False), (signal.SIGINT, True)):
            argv = ["-m", "sweep", "-m", *[f for f in FAST if f != "progress=none"], *long, *extra]
            cs.append(
                Case(
                    f"{signal.Signals(sig).name} to a {launcher} sweep{' (group)' if group else ''}",
                    argv,
                    interrupted_and_resumed(sig),
                    driver=signal_at_step(sig, group),
                    quick=launcher == "basic" and sig == signal.SIGTERM,
                    timeout=600,
                )
            )
    oargv = [
        "-m",
        "sweep",
        "-m",
        *[f for f in FAST if f != "progress=none"],
        "hydra/sweeper=optuna_sweep",
        "hydra.sweeper.sampler.name=grid",
    ]
    oargv += ["optim.lr=choice(1e-3,2e-3,3e-3)", "steps=200", "log_every=1", "progress=log", "hydra.sweep.dir={d}/s"]
    cs.append(
        Case(
            "SIGTERM to an Optuna sweep",
            oargv,
            interrupted_and_resumed(signal.SIGTERM),
            driver=signal_at_step(signal.SIGTERM),
            timeout=600,
        )
    )
    cs += tracebacks_45() + steps_45()
    return cs


# -- issue 45 (held-out red team), findings 8 and 9: the cases' names start with "45/8" and "45/9" --------------


def spiked_run(d: Path, rel: str = "run", steps: int = 12) -> Path:
    """A real run that spikes at step 4 (lr 3e-2), made in the case's dir (ledger off)."""
    o = run(sweep(f"steps={steps}", "optim.lr=3e-2", "ledger.enabled=false", f"hydra.run.dir={d}/{rel}"), d)
    assert (d / rel / "result.json").exists(), o.text[-2000:]
    return d / rel


def flipped_resume(d: Path) -> str:
    """A copy of the base run whose step-2 checkpoint has one byte of its weights flipped: its directory."""
    f = copy_run(d, "ckpt") / "checkpoints" / "step_000002" / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[-5] ^= 0xFF
    f.write_bytes(bytes(b))
    return str(f.parent)


def corrupt_run(d: Path, how: str) -> None:
    """A run in {d}/run refused at the load of its weights (verdict corrupt_checkpoint)."""
    if how == "resume":
        over = [f"checkpoint.resume_from={flipped_resume(d)}", "steps=4"]
    else:
        (d / "junk.safetensors").write_bytes(os.urandom(4096))
        over = [f"model.init_from={d}/junk.safetensors", "steps=2"]
    run(sweep(*over, "ledger.enabled=false", f"hydra.run.dir={d}/run"), d)
    assert verdict("corrupt_checkpoint")(Outcome(0, "", "", d)) is None


def diagnosed(mechanism: str, rel: str = "run") -> Check:
    def check(o: Outcome) -> Optional[str]:
        if o.rc != 0:
            return f"exit {o.rc}"
        path = o.dir / rel / "diagnosis.json"
        got = json.loads(path.read_text()).get("mechanism") if path.exists() else None
        return None if got == mechanism else f"diagnosis.json mechanism {got!r}, not {mechanism!r}"

    return check


def exit_with(rc: int, *words: str) -> Check:
    """Exit status `rc`, the text holding `words`, and, for a refusal (rc 1 or 2), one line on stderr."""

    def check(o: Outcome) -> Optional[str]:
        if o.rc != rc:
            return f"exit {o.rc}, not {rc}"
        missing = [w for w in words if w not in o.text]
        if missing:
            return f"does not say {missing[0]!r}"
        lines = [ln for ln in o.err.splitlines() if ln.strip() and not ln.startswith("[")]
        return None if rc == 0 or len(lines) == 1 else f"{len(lines)} lines on stderr"

    return check


def signal_on(needle: str, sig: int) -> Callable[[Case, Path], Outcome]:
    """Start the case's command, send `sig` once `needle` is in its stdout, wait for it (no rerun)."""

    def driver(case: Case, d: Path) -> Outcome:
        import threading

        argv = [PY, *[str(a).replace("{d}", str(d)) for a in case.args]]
        p = subprocess.Popen(
            argv,
            cwd=d,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,  # a bench started in the background (`&`) ignores SIGINT: its children too
        )
        out: list = []
        threading.Thread(target=lambda: out.extend(p.stdout), daemon=True).start()
        deadline = time.time() + case.timeout
        while p.poll() is None and not any(needle in ln for ln in out) and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(sig)
        err = p.stderr.read()
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        time.sleep(0.3)
        return Outcome(p.returncode, "".join(out), err, d)

    return driver


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stopped_diagnosis(sig: int, run_dir: str) -> Check:
    def check(o: Outcome) -> Optional[str]:
        if o.rc != 128 + sig:
            return f"exit {o.rc}, not {128 + sig}"
        d = o.dir / run_dir
        if (d / "diagnosis.json").exists():
            return "a partial diagnosis.json was written"
        records = [json.loads(p.read_text())["status"] for p in (d / "diagnosis").rglob("trial.json")]
        if "error" in records:
            return "a run of the diagnosis is recorded as error"
        if "interrupted" not in records:
            return f"no run of the diagnosis recorded as interrupted: {records}"
        lines = [ln for ln in o.err.splitlines() if "stopped" in ln]
        return None if len(lines) == 1 else f"{len(lines)} lines say it stopped"

    return check


def read_only(case: Case, d: Path) -> Outcome:
    """Run the case with {d}/ro a read-only bind mount of {d}/src (as root; the mode bits otherwise), from {d}/cwd."""
    src, ro, cwd = d / "src", d / "ro", d / "cwd"
    ro.mkdir()
    cwd.mkdir()
    if os.geteuid() == 0:
        for args in (["mount", "--bind", str(src), str(ro)], ["mount", "-o", "remount,bind,ro", str(ro)]):
            if subprocess.run(args, capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(ro)], capture_output=True)
                return Outcome(0, "", "", d, {"skip": "cannot mount a read-only bind here"})
    else:
        ro.rmdir()
        shutil.copytree(src, ro)
        for p in [ro, *ro.rglob("*")]:
            if p.is_dir():
                p.chmod(0o555)
    try:
        argv = [PY, *[str(a).replace("{d}", str(d)) for a in case.args]]
        p = subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=case.timeout)
        return Outcome(p.returncode, p.stdout, p.stderr, d)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        else:
            for p in [ro, *ro.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o755)


def ladder_sweep(d: Path) -> None:
    """{d}/sweepdir: a width ladder's run dirs whose max stable lr falls as width^-0.5 (tests/test_ladder.py), so
    the report fits a line and extrapolates it to the target."""
    sys.path.insert(0, str(REPO))
    from tests.test_ladder import power_law_sweep

    power_law_sweep(d / "sweepdir", widths=(32, 64, 128))


def tracebacks_45() -> list[Case]:
    """Finding 8: what ended in a traceback, each now one clear line or a correct result."""
    cs: list[Case] = []
    # sweep.diagnose on every corrupt_checkpoint run, and the sweep's own auto-diagnosis
    for how in ("resume", "init_from"):
        cs.append(
            Case(
                f"45/8 diagnose a corrupt_checkpoint run ({how})",
                ["-m", "sweep.diagnose", "{d}/run"],
                diagnosed("corrupt_checkpoint"),
                setup=lambda d, how=how: corrupt_run(d, how),
            )
        )

    cs.append(
        Case(
            "45/8 monitor.diagnose=auto, every run a corrupt checkpoint",
            sweep(
                "-m",
                "optim.lr=1e-3,2e-3",
                "checkpoint.resume_from={d}/ckpt/checkpoints/step_000002",
                "steps=4",
                "monitor.diagnose=auto",
                "hydra.sweep.dir={d}/s",
            ),
            diagnosed("corrupt_checkpoint", "s/0"),
            setup=flipped_resume,
        )
    )
    cs.append(
        Case(
            "45/8 hallo_corrupt_checkpoint scenario, monitor.diagnose=auto",
            [
                "-m",
                "sweep",
                "+scenario=hallo_corrupt_checkpoint",
                "progress=none",
                "threads=1",
                "monitor.diagnose=auto",
                "monitor.diagnose_budget=100",
                "hydra.sweep.dir={d}/s",
            ],
            diagnosed("corrupt_checkpoint", "s/3"),
            timeout=600,
        )
    )
    # Ctrl-C / SIGTERM during a diagnosis: stops after the step of its run, one line, no misleading record
    for sig in (signal.SIGINT, signal.SIGTERM):
        name = signal.Signals(sig).name
        cs.append(
            Case(
                f"45/8 {name} during python -m sweep.diagnose",
                ["-m", "sweep.diagnose", "{d}/run"],
                stopped_diagnosis(sig, "run"),
                setup=lambda d: spiked_run(d, steps=3000),
                driver=signal_on("fix 1/", sig),
                timeout=600,
            )
        )
        cs.append(
            Case(
                f"45/8 {name} during a sweep's monitor.diagnose=auto",
                sweep(
                    "-m",
                    "steps=3000",
                    "optim.lr=3e-2",
                    "monitor.diagnose=auto",
                    "hydra.sweep.dir={d}/s",
                    "ledger.enabled=false",
                ),
                stopped_diagnosis(sig, "s/0"),
                driver=signal_on("fix 1/", sig),
                timeout=600,
            )
        )
    # read-only run dirs: diagnose, replay, report
    for name, args, check in [
        ("diagnose", ["-m", "sweep.diagnose", "{d}/ro/run"], exit_with(2, "is not writable", "--out DIR")),
        ("diagnose --out", ["-m", "sweep.diagnose", "{d}/ro/run", "--no-fix", "--out", "{d}/out"], exit_with(0)),
        ("replay", ["-m", "sweep.replay", "{d}/ro/run"], exit_with(0, "wrote", "forensics.json instead")),
        (
            "replay --json into it",
            ["-m", "sweep.replay", "{d}/ro/run", "--json", "{d}/ro/f.json"],
            exit_with(1, "could not write the findings"),
        ),
        ("report", ["-m", "sweep.report", "{d}/ro"], exit_with(0, "into the current directory instead")),
        (
            "report --html into it",
            ["-m", "sweep.report", "{d}/ro", "--html", "{d}/ro/r.html"],
            exit_with(1, "could not write r.html"),
        ),
    ]:
        cs.append(
            Case(
                f"45/8 read-only run dir: {name}",
                args,
                check,
                setup=lambda d: spiked_run(d, "src/run"),
                driver=read_only,
            )
        )
    # the Optuna sweeper with a ledger URL it cannot open
    for url in (
        "notaurl",
        "postgresql://me@127.0.0.1:9/x",
        "mysql://me@127.0.0.1:9/x",
        "sqlite:////proc/nowhere/x.db",
        "postgresql://me@nosuchhost.invalid/x",
    ):
        cs.append(
            Case(
                f"45/8 optuna sweeper, ledger.storage={url}",
                sweep(
                    "-m",
                    "hydra/sweeper=optuna_sweep",
                    "hydra.sweeper.sampler.name=grid",
                    "optim.lr=choice(1e-3,2e-3)",
                    f"ledger.storage={url}",
                    "hydra.sweep.dir={d}/s",
                    "steps=2",
                ),
                exit2_naming("ledger.storage"),
            )
        )
    # custom models that pass a batch-2 no-grad forward but cannot train
    for target in (
        "batch_of_two_only",
        "reshapes_to_two",
        "no_parameters",
        "frozen",
        "no_grad_forward",
        "detached_output",
    ):
        cs.append(
            Case(
                f"45/8 custom model {target}",
                sweep(
                    "model=custom", f"model.target=tests.custom_factories:{target}", "hydra.run.dir={d}/run", "steps=2"
                ),
                exit2_naming("model.target"),
            )
        )

    def one_line_error(words: str) -> Check:
        def check(o: Outcome) -> Optional[str]:
            r = result(o)
            if r is None or r.get("status") != "error":
                return f"exit {o.rc}, result {r and r.get('status')}"
            return None if words in (r.get("reason") or "") and "\n" not in r["reason"] else f"reason {r['reason']!r}"

        return check

    cs.append(
        Case(
            "45/8 custom model right at batch 2 only, eval batch 16",
            sweep(
                "model=custom",
                "model.target=tests.custom_factories:batch_of_two_only",
                "data.batch_size=2",
                "steps=1",
                "hydra.run.dir={d}/run",
            ),
            one_line_error("x's shape (16,"),
        )
    )
    # a resume with steps at or below the checkpoint's step
    for steps in (1, 2):
        cs.append(
            Case(
                f"45/8 resume at step 2 with steps={steps}",
                sweep(
                    "checkpoint.resume_from={d}/sweepdir/0/checkpoints/step_000002",
                    f"steps={steps}",
                    "hydra.run.dir={d}/run",
                ),
                lambda o: exit_with(2, "steps: ")(o) or ("a run started" if result(o) is not None else None),
                setup=lambda d: copy_run(d),
            )
        )
    # valid JSON of the wrong shape: the report names and skips it, diagnose says it in one line
    for name, change in [
        ("mechanism a string", {"mechanism": "boom"}),
        ("mechanism a list", {"mechanism": [1]}),
        ("headroom a string", {"headroom": "x"}),
        ("seconds a string", {"seconds": "fast"}),
    ]:
        cs.append(
            Case(
                f"45/8 report: result.json {name}",
                ["-m", "sweep.report", "{d}/sweepdir", "--no-html"],
                report_names_skip,
                setup=damaged_report(lambda r, change=change: json.dumps({**r, **change})),
            )
        )
    for name, content in [("null", "null"), ("a list", "[1]"), ("fix a string", '{"mechanism": "x", "fix": "x"}')]:

        def bad_diagnosis(d: Path, content=content) -> None:
            copy_run(d, "sweepdir/0")
            bad = copy_run(d, "sweepdir/1")
            r = json.loads((bad / "result.json").read_text())
            (bad / "result.json").write_text(
                json.dumps({**r, "status": "diverged", "verdict": "loss_spike", "first_bad_step": 1})
            )
            (bad / "diagnosis.json").write_text(content)

        cs.append(
            Case(
                f"45/8 report: diagnosis.json {name}",
                ["-m", "sweep.report", "{d}/sweepdir", "--no-html"],
                exit_with(0, "1/diagnosis.json", "the run is kept"),
                setup=bad_diagnosis,
            )
        )
    for name, change in [
        ("cause a list", {"cause": [1]}),
        ("first_bad_step a string", {"first_bad_step": "four"}),
        ("first_bad_step past the run", {"first_bad_step": 999}),
        ("seconds a string", {"seconds": "fast"}),
        ("headroom a string", {"headroom": "x"}),
        ("status a number", {"status": 3}),
    ]:

        def damaged_spike(d: Path, change=change) -> None:
            path = spiked_run(d) / "result.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **change}))

        cs.append(
            Case(
                f"45/8 diagnose: result.json {name}",
                ["-m", "sweep.diagnose", "{d}/run", "--no-fix"],
                exit_with(2, "sweep.diagnose: "),
                setup=damaged_spike,
            )
        )
    # ladder targets with no float, or far past any model
    huge = "1" + "0" * 320  # 10**320
    for target in ("1e308", "1e-300", huge, "0.5"):
        cs.append(
            Case(
                f"45/8 report --ladder-target {'10**320' if target == huge else target}",
                ["-m", "sweep.report", "{d}/sweepdir", "--no-html", "--ladder-target", target],
                exit_with(2, "--ladder-target: must be a width or depth from 1 to 1,000,000"),
                setup=ladder_sweep,
            )
        )
    for target in ("1e308", "1e-300", huge):
        cs.append(
            Case(
                f"45/8 ladder.target={'10**320' if target == huge else target} at composition",
                sweep("-m", "+ladder=width", f"ladder.target={target}", "hydra.sweep.dir={d}/s"),
                exit2_naming("ladder.target"),
            )
        )
    return cs


def steps_45() -> list[Case]:
    """Finding 9: `steps` without a bound, its tables built before step 0, SIGTERM ignored there, and a diagnosis
    of a long run training its fix for the run's whole length."""
    cs = [
        Case(f"45/9 steps={v}", sweep(f"steps={v}", "hydra.run.dir={d}/run"), exit2_naming("steps"))
        for v in ("100000000000", "1e11", "7158279")
    ]
    cs.append(
        Case(
            "45/9 steps=5000000 on a model too big to run them in 30 days",
            sweep(
                "model.size=B",
                "data.frames=16",
                "data.height=256",
                "data.width=256",
                "data.batch_size=8",
                "data.num_samples=8",
                "steps=5000000",
                "hydra.run.dir={d}/run",
            ),
            exit2_naming("steps"),
        )
    )

    def soon(sig: int, after_s: float) -> Callable[[Case, Path], Outcome]:
        def driver(case: Case, d: Path) -> Outcome:
            argv = [PY, *[str(a).replace("{d}", str(d)) for a in case.args]]
            t0 = time.time()
            p = subprocess.Popen(argv, cwd=d, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = p.communicate(timeout=after_s)
            except subprocess.TimeoutExpired:
                p.send_signal(sig)
                out, err = p.communicate(timeout=120)
            return Outcome(p.returncode, out, err, d, {"s": time.time() - t0})

        return driver

    def stopped_soon(o: Outcome) -> Optional[str]:
        r = result(o)
        if o.rc != 143 or r is None or r.get("status") != "interrupted":
            return f"exit {o.rc}, result {r and r.get('status')}"
        return None if o.extra["s"] < 90 else f"took {o.extra['s']:.0f} s to stop"

    cs.append(
        Case(
            "45/9 SIGTERM 8 s into a run of steps=7000000 (windows)",
            sweep("steps=7000000", "monitor.sync_every=4", "optim.schedule=cosine", "hydra.run.dir={d}/run"),
            stopped_soon,
            driver=soon(signal.SIGTERM, 8.0),
        )
    )

    def horizon(o: Outcome) -> Optional[str]:
        if o.rc != 0:
            return f"exit {o.rc}"
        d = json.loads((o.dir / "run" / "diagnosis.json").read_text())
        fix = d["fix"]
        runs = [json.loads(p.read_text()) for p in (o.dir / "run" / "diagnosis").glob("fix_*/trial.json")]
        longest = max((r.get("steps_run") or 0 for r in runs), default=0)
        return None if fix.get("through_step") == 999 and longest <= 1000 else f"fix {fix}, longest {longest}"

    cs.append(
        Case(
            "45/9 diagnose a 100000-step run that spiked at step 4",
            ["-m", "sweep.diagnose", "{d}/run"],
            horizon,
            setup=lambda d: spiked_run(d, steps=100_000),
            timeout=900,
        )
    )
    return cs


def lowprec_cases() -> list[Case]:
    """Issue 46's surfaces: the values a user types for the fp8 and optimizer keys are one line each, and each new
    axis trains to a verdict, alone, in a grid, from a checkpoint and under the diagnosis."""
    cs: list[Case] = []
    for over, key in [
        ("precision=fp8_tensorwise compile=true", "precision.fp8"),
        ("precision=fp16_amp precision.fp8=tensorwise", "precision.fp8"),
        ("precision.fp8=fp4", "precision.fp8"),
        ("precision=fp8_rowwise precision.fp8_keep=['']", "precision.fp8_keep"),
        ("finetune.base_dtype=fp8_e4m3", "finetune.base_dtype"),
        ("finetune=lora finetune.base_dtype=fp8_e4m3 precision=fp8_rowwise", "finetune.base_dtype"),
        ("finetune=lora finetune.train_base=true finetune.base_dtype=bf16", "finetune.base_dtype"),
        ("optim.name=came", "optim.betas"),
        ("optim=came optim.betas=[0.9,0.999,1.5]", "optim.betas"),
        ("optim=adafactor optim.eps=1e-8", "optim.eps"),
        ("optim=adamw_8bit optim.min_8bit_size=0", "optim.min_8bit_size"),
        ("optim=adamw_8bit monitor.sync_every=4", "monitor.sync_every"),
        ("optim=prodigy optim.update_clip=1", "optim.update_clip"),
        ("optim=prodigy optim.d_coef=inf", "optim.d_coef"),
        ("optim=prodigy finetune=lora optim.lora_lr=0.5", "optim.lora_lr"),
        ("optim=adafactor model.param=mup model.base_width=64", "optim.name"),
        ("optim.name=sgd", "optim.name"),
    ]:
        cs.append(Case(f"46/{over}", sweep(*over.split(), "hydra.run.dir={d}/run"), exit2_naming(key)))
    trains = ["precision=fp8_rowwise_gw_hp", "optim=adamw_8bit precision=bf16_pure", "optim=came precision=fp16_amp"]
    for over in trains:
        run = sweep(*over.split(), "steps=3", "hydra.run.dir={d}/run")
        cs.append(Case(f"46/{over} trains", run, verdict("stable")))
    cs.append(
        Case(
            "46/grid of fp8 x optimizers, packed launcher",
            sweep(
                "-m",
                "hydra/launcher=packed",
                "precision=bf16_amp,fp8_tensorwise",
                "optim=adamw,adamw_8bit,prodigy",
                "steps=2",
                "hydra.sweep.dir={d}/s",
            ),
            lambda o: None if len(list((o.dir / "s").glob("*/result.json"))) == 6 else "not 6 results",
            quick=True,
        )
    )
    return cs


def held_out_red_team_cases() -> list[Case]:
    """Issue 45's held-out red team, findings 1, 3, 4, 5, 6, 7 and 10, and their variants."""
    cs: list[Case] = []

    # Finding 1: cells that share a job dir overwrote each other ("2 runs" of 4).
    def no_result_and_names(key: str, *words: str) -> Check:
        def check(o: Outcome) -> Optional[str]:
            problem = exit2_naming(key)(o)
            missing = [w for w in words if w not in o.err]
            return problem or (f"the line does not say {missing}" if missing else None)

        return check

    grid = ["-m", "optim.lr=1e-3,2e-3", "hydra.sweep.dir={d}/s", "steps=1"]
    for name, extra, words in [
        ("subdir lr${optim.lr} with replicates=2", ["replicates=2", "hydra.sweep.subdir=lr${optim.lr}"], ["seed=1"]),
        ("a constant subdir", ["hydra.sweep.subdir=same"], ["optim.lr=0.002"]),
        ("a collision across batches", ["hydra.sweeper.max_batch_size=1", "hydra.sweep.subdir=one"], []),
        ("subdir ../out${hydra.job.num}", ["hydra.sweep.subdir=../out${hydra.job.num}"], ["outside"]),
        ("an absolute subdir", ["hydra.sweep.subdir={d}/abs${hydra.job.num}"], ["outside"]),
    ]:
        cs.append(
            Case(
                f"job dirs: {name}",
                sweep(*grid, *extra),
                no_result_and_names("hydra.sweep.subdir", *words),
                quick=name.startswith("subdir lr"),
            )
        )
    cs.append(
        Case(
            "job dirs: Optuna subdir lr${optim.lr}",
            sweep(
                "-m",
                "hydra/sweeper=optuna_sweep",
                "hydra.sweeper.sampler.name=grid",
                "optim.lr=choice(1e-3,2e-3)",
                "replicates=2",
                "hydra.sweep.dir={d}/s",
                "hydra.sweep.subdir=lr${optim.lr}",
                "steps=1",
            ),
            no_result_and_names("hydra.sweep.subdir", "${hydra.job.num}"),
        )
    )

    def both_cells(o: Outcome) -> Optional[str]:
        found = sorted(p.parent.name for p in (o.dir / "s").glob("*/result.json"))
        return None if o.rc == 0 and found == ["lr0.001", "lr0.002"] else f"exit {o.rc}, results in {found}"

    cs.append(
        Case(
            "job dirs: subdir lr${optim.lr} that tells cells apart",
            sweep(*grid, "hydra.sweep.subdir=lr${optim.lr}"),
            both_cells,
        )
    )

    # Finding 3a: a tracking server's ?token= reached stdout and __main__.log through urllib3's retry warning.
    for key in ("token", "access_token", "pass", "passphrase"):
        cs.append(
            Case(
                f"secret: mlflow ?{key}= from the environment, server down, retries on",
                sweep(
                    "logger=mlflow",
                    "logger.mlflow.tracking_uri=${oc.env:MY_URI}",
                    "logger.mlflow.timeout_s=2",
                    "hydra.run.dir={d}/run",
                    "steps=2",
                ),
                secret_nowhere,
                driver=with_env({"MY_URI": f"http://127.0.0.1:9/?{key}=s3cr3t"}),
                quick=key == "token",
            )
        )
    cs.append(
        Case(
            "secret: ledger ?pass= from the environment, server down",
            sweep(
                "ledger.storage=${oc.env:SWEEP_LEDGER_URL}",
                "ledger.lock_timeout_s=2",
                "hydra.run.dir={d}/run",
                "steps=2",
            ),
            secret_nowhere,
            driver=with_env({"SWEEP_LEDGER_URL": "postgresql://me@127.0.0.1:9/x?pass=s3cr3t"}),
        )
    )
    for key in ("pass", "passphrase"):  # finding 10: on the command line too
        cs.append(
            Case(
                f"password ?{key}=",
                sweep(f"ledger.storage='postgresql://me@db/x?{key}=s3cr3t'", "hydra.run.dir={d}/run"),
                no_secret,
            )
        )

    # Finding 3b: a password in a --config-dir experiment file was copied into every .hydra/config.yaml.
    def experiment(body: str, name: str = "leak") -> Callable[[Path], None]:
        def setup(d: Path) -> None:
            (d / "mine" / "experiment").mkdir(parents=True, exist_ok=True)
            (d / "mine" / "experiment" / f"{name}.yaml").write_text("# @package _global_\n" + body)
            (d / "mine" / "experiment" / "ok.yaml").write_text("# @package _global_\nsteps: 1\n")

        return setup

    def no_secret_written(o: Outcome) -> Optional[str]:
        return secret_nowhere(o, rc=2, but=("mine",))  # the experiment file itself holds it

    config_dir = ["--config-dir", "{d}/mine"]
    for name, body, how in [
        ("ledger user:pw@", "ledger:\n  storage: postgresql://me:s3cr3t@127.0.0.1:9/x\n", ["+experiment=leak"]),
        (
            "mlflow ?token=",
            "logger:\n  mlflow:\n    tracking_uri: http://127.0.0.1:9/?token=s3cr3t\n",
            ["+experiment=leak"],
        ),
        ("?passphrase=", "ledger:\n  storage: postgresql://me@127.0.0.1:9/x?passphrase=s3cr3t\n", ["+experiment=leak"]),
        (
            "env_set password",
            "hydra:\n  job:\n    env_set:\n      MLFLOW_TRACKING_PASSWORD: s3cr3t\n",
            ["+experiment=leak"],
        ),
        ("a URL in model.kwargs", "model:\n  kwargs:\n    weights: https://me:s3cr3t@hub/x\n", ["+experiment=leak"]),
        (
            "a grid",
            "ledger:\n  storage: postgresql://me:s3cr3t@127.0.0.1:9/x\n",
            ["-m", "+experiment=leak", "optim.lr=1e-3,2e-3"],
        ),
        (
            "one cell of a grid",
            "ledger:\n  storage: postgresql://me:s3cr3t@127.0.0.1:9/x\n",
            ["-m", "+experiment=ok,leak"],
        ),
        (
            "hydra.sweeper.params",
            "hydra:\n  sweeper:\n    params:\n      ledger.storage: sqlite:///a.db,postgresql://me:s3cr3t@db/x\n",
            ["-m", "+experiment=leak"],
        ),
    ]:
        args = [*config_dir, *FAST, "steps=1", "hydra.run.dir={d}/run", "hydra.sweep.dir={d}/s", *how]
        cs.append(
            Case(
                f"secret in a --config-dir experiment: {name}",
                ["-m", "sweep", *(["-m"] if "-m" in how else []), *[a for a in args if a != "-m"]],
                no_secret_written,
                setup=experiment(body),
                quick=name == "ledger user:pw@",
            )
        )

    # Finding 4: a sweep inside a finished sweep's dir, or a single run into <sweep>/7, leaked into its report.
    def finished_sweep(d: Path) -> None:
        o = run(sweep("-m", "optim.lr=1e-3", "hydra.sweep.dir={d}/s", "steps=1", "ledger.enabled=false"), d)
        assert (d / "s" / "0" / "result.json").exists(), o.text[-2000:]

    def refused_and_sweep_intact(key: str, where: str) -> Check:
        def check(o: Outcome) -> Optional[str]:
            if o.rc != 2 or key not in o.err:
                return f"exit {o.rc}, not 2 naming {key}"
            found = sorted(str(p.relative_to(o.dir)) for p in o.dir.rglob("result.json"))
            if found != ["s/0/result.json"]:
                return f"results now: {found}"
            return f"{where} was written" if (o.dir / where).exists() else None

        return check

    for name, args, key, where in [
        ("a single run into <sweep>/7", sweep("steps=1", "hydra.run.dir={d}/s/7"), "hydra.run.dir", "s/7"),
        (
            "a single run into <sweep>/0",
            sweep("steps=1", "optim.lr=1e-3", "hydra.run.dir={d}/s/0/x"),
            "hydra.run.dir",
            "s/0/x",
        ),
        (
            "a sweep into <sweep>/sub",
            sweep("-m", "optim.lr=1e-3,2e-3", "steps=1", "hydra.sweep.dir={d}/s/sub"),
            "hydra.sweep.dir",
            "s/sub",
        ),
        (
            "an Optuna sweep into <sweep>/sub",
            sweep(
                "-m",
                "hydra/sweeper=optuna_sweep",
                "hydra.sweeper.sampler.name=grid",
                "optim.lr=choice(1e-3)",
                "steps=1",
                "hydra.sweep.dir={d}/s/sub",
            ),
            "hydra.sweep.dir",
            "s/sub",
        ),
    ]:
        cs.append(
            Case(
                f"leak: {name}",
                args,
                refused_and_sweep_intact(key, where),
                setup=finished_sweep,
                quick=name.endswith("/7"),
            )
        )
    cs.append(
        Case(
            "leak: a single run beside a sweep is fine",
            sweep("steps=1", "hydra.run.dir={d}/run"),
            lambda o: None if o.rc == 0 and (o.dir / "run" / "result.json").exists() else f"exit {o.rc}",
            setup=finished_sweep,
        )
    )

    # Finding 10: a sweep refused beside a single run was told about "a sweep whose multirun.yaml is missing".
    def single_run(d: Path) -> None:
        o = run(sweep("steps=1", "ledger.enabled=false", "hydra.run.dir={d}/run"), d)
        assert (d / "run" / "result.json").exists(), o.text[-2000:]

    for name, where in [("its dir", "{d}/run"), ("its parent", "{d}")]:
        cs.append(
            Case(
                f"a sweep into a single run's {name}",
                sweep("-m", "optim.lr=1e-3,2e-3", "steps=1", f"hydra.sweep.dir={where}"),
                lambda o: (
                    f"exit {o.rc}, not 2 naming hydra.sweep.dir"
                    if o.rc != 2 or "hydra.sweep.dir" not in o.err
                    else (
                        "does not say it holds a single run"
                        if "single run" not in o.err or "missing" in o.err
                        else None
                    )
                ),
                setup=single_run,
            )
        )

    # Finding 5: os:popen, subprocess:run, shutil:rmtree ran (twice) before "not a torch.nn.Module".
    def victim(d: Path) -> None:
        (d / "victim").mkdir()
        (d / "victim" / "keep.txt").write_text("keep me")

    for target, kw in [
        ("os:popen", "model.kwargs={cmd:'touch {d}/PWNED'}"),
        ("subprocess:run", "model.kwargs={args:[touch,'{d}/PWNED']}"),
        ("subprocess:Popen", "model.kwargs={args:[touch,'{d}/PWNED']}"),
        ("shutil:rmtree", "model.kwargs={path:'{d}/victim'}"),
        ("os.path:join", "model.kwargs={a:x}"),
        ("pathlib:Path.touch", "model.kwargs={self:'{d}/PWNED'}"),
        ("tests.custom_factories:popen_alias", "model.kwargs={cmd:'touch {d}/PWNED'}"),
        ("tests.custom_factories:partial_factory", "model.kwargs={}"),
    ]:
        cs.append(
            Case(
                f"model.target={target}",
                sweep("model=custom", f"model.target={target}", kw, "hydra.run.dir={d}/run"),
                lambda o: (
                    exit2_naming("model.target")(o)
                    or ("the factory ran" if (o.dir / "PWNED").exists() or not (o.dir / "victim").is_dir() else None)
                ),
                setup=victim,
                quick=target == "shutil:rmtree",
            )
        )

    # Finding 6: a huge custom model passing device="cpu" was built for real (4.4 GB) before the refusal.
    def refused_small_naming(key: str) -> Check:
        def check(o: Outcome) -> Optional[str]:
            problem = exit2_naming(key)(o) or (None if "meta device" in o.err else "not counted on the meta device")
            if problem is None and o.extra["peak_mb"] > 2000:
                return f"refused, but only after it took {o.extra['peak_mb']:,.0f} MB (built for real)"
            return problem or (None if o.extra["s"] < 30 else f"took {o.extra['s']:.0f} s")

        return check

    def peak_memory(case: Case, d: Path) -> Outcome:
        """The command, with its own peak memory (os.wait4's ru_maxrss of that child) and its time."""
        argv = [PY, *[str(a).replace("{d}", str(d)) for a in case.args]]
        t0 = time.time()
        with open(d / ".out", "w") as out, open(d / ".err", "w") as err:
            p = subprocess.Popen(argv, cwd=d, env=ENV, stdout=out, stderr=err)
            import threading

            timer = threading.Timer(case.timeout, p.kill)
            timer.start()
            _, status, usage = os.wait4(p.pid, 0)
            timer.cancel()
        o = Outcome(os.waitstatus_to_exitcode(status), (d / ".out").read_text(), (d / ".err").read_text(), d)
        o.extra.update(s=time.time() - t0, peak_mb=usage.ru_maxrss / 1024)
        return o

    for target in ("huge_on_cpu", "huge_then_reads"):
        cs.append(
            Case(
                f"custom model {target}",
                sweep(
                    "model=custom", f"model.target=tests.custom_factories:{target}", "hydra.run.dir={d}/run", "steps=2"
                ),
                refused_small_naming("model.kwargs"),
                driver=peak_memory,
                timeout=60,
                quick=target == "huge_on_cpu",
            )
        )

    # Finding 7: logger.tensorboard.dir wrote outside the run dir.
    for folder in ("{d}/elsewhere", "../..", "tb/../../up"):
        cs.append(
            Case(
                f"logger.tensorboard.dir={folder.replace('{d}', '/abs')}",
                sweep("logger=tensorboard", f"logger.tensorboard.dir={folder}", "hydra.run.dir={d}/a/b/run", "steps=2"),
                lambda o: (
                    exit2_naming("logger.tensorboard.dir")(o)
                    or ("event files written" if list(o.dir.rglob("events.out.tfevents*")) else None)
                ),
                quick=folder == "../..",
            )
        )

    # Finding 10: resume_from the run dir or its checkpoints/ was a corrupt_checkpoint divergence.
    def names_steps(key: str) -> Check:
        def check(o: Outcome) -> Optional[str]:
            if o.rc != 2 or key not in o.err:
                return f"exit {o.rc}, not 2 naming {key} ({result(o) and result(o).get('verdict')})"
            return None if "step_000002" in o.err else "the step directories are not named"

        return check

    for name, over, key in [
        ("resume_from the run dir", "checkpoint.resume_from={d}/sweepdir/0", "checkpoint.resume_from"),
        ("resume_from checkpoints/", "checkpoint.resume_from={d}/sweepdir/0/checkpoints", "checkpoint.resume_from"),
        ("init_from the run dir", "model.init_from={d}/sweepdir/0", "model.init_from"),
    ]:
        cs.append(
            Case(
                name,
                sweep(over, "hydra.run.dir={d}/run", "steps=4"),
                names_steps(key),
                setup=lambda d: copy_run(d),
                quick=name == "resume_from checkpoints/",
            )
        )

    # Finding 10: one unreadable overrides.yaml split the divergence map by every fixed key.
    def broken_overrides(content: str) -> Callable[[Path], None]:
        def setup(d: Path) -> None:
            copy_run(d, "sweepdir/0")
            (d / "sweepdir" / "1" / ".hydra").mkdir(parents=True)
            (d / "sweepdir" / "1" / ".hydra" / "overrides.yaml").write_text(content)

        return setup

    def map_not_split(o: Outcome) -> Optional[str]:
        if o.rc != 0:
            return f"exit {o.rc}"
        head = o.out.split("Stability frontier")[0]
        if "None" in head or "NaN" in head:
            return "the divergence map is split by the unreadable run"
        return None if "overrides.yaml" in o.err else "the unreadable overrides.yaml is not named"

    for name, content in [
        ("unclosed YAML", "optim.lr: [unclosed\n"),
        ("a mapping", "optim.lr: 1\n"),
        ("bad grammar", "- 'optim.lr=='\n"),
    ]:
        cs.append(
            Case(
                f"report: overrides.yaml {name}",
                ["-m", "sweep.report", "{d}/sweepdir", "--no-html"],
                map_not_split,
                setup=broken_overrides(content),
                quick=name == "unclosed YAML",
            )
        )
    return cs


class _Bomb:
    """Unpickling this runs a command: a weights file must never be unpickled with code in it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# -- classification -------------------------------------------------------------------------------------


def classify(case: Case, o: Outcome) -> tuple[str, str]:
    if o.extra.get("skip"):  # the driver found the machine cannot stage it
        return "skipped", o.extra["skip"]
    text = o.text + "".join(e.text for e in o.extra.values() if isinstance(e, Outcome))
    if o.rc is None:
        return "unclear", "timed out"
    if "Traceback (most recent call last)" in text:
        last = [ln for ln in text.splitlines() if ln.strip()][-1:]
        return "traceback", last[0][:120] if last else ""
    signalled = o.rc < 0 or o.rc == 139
    if signalled and not case.driver:
        return "traceback", f"killed by signal (rc {o.rc})"
    problem = case.check(o) if case.check else None
    if problem:
        return "wrong", problem
    if o.rc in (1, 2) and not case.driver and o.rc not in case.verdict_rc:
        lines = [ln for ln in o.err.splitlines() if ln.strip() and not ln.startswith("[")]
        if len(lines) != 1:
            return "unclear", f"exit {o.rc} with {len(lines)} lines on stderr"
        return "clean", lines[0][:120]
    if o.rc == 0 and not case.driver and case.args[:2] == ["-m", "sweep"] and "-m" not in case.args[2:3]:
        r = result(o)
        if r is not None and r.get("status") is None:
            return "wrong", "result.json without a status"
    return "clean", f"exit {o.rc}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one case of each kind")
    ap.add_argument("-k", default=None, help="only the cases whose name contains this")
    ap.add_argument("--keep", action="store_true", help="keep the cases' directories")
    args = ap.parse_args()
    global BASE
    BASE = Path(tempfile.mkdtemp(prefix="adversarial-"))
    todo = [c for c in cases() if (not args.quick or c.quick) and (args.k is None or args.k in c.name)]
    rows, start = [], time.time()
    for i, case in enumerate(todo, 1):
        d = BASE / f"case{i:03d}"
        d.mkdir()
        t0 = time.time()
        if case.skip:
            kind, detail = "skipped", case.skip
        else:
            try:
                if case.setup:
                    case.setup(d)
                o = case.driver(case, d) if case.driver else run(case.args, d, case.timeout)
                kind, detail = classify(case, o)
            except Exception as e:  # noqa: BLE001  (the bench's own staging failed: say so, go on)
                kind, detail = "unclear", f"bench: {type(e).__name__}: {e}"[:120]
        rows.append((case.name, kind, detail, time.time() - t0))
        print(f"{i:3d}/{len(todo)} {kind:9s} {time.time() - t0:5.1f}s  {case.name}: {detail}", flush=True)
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    print(f"\n{'case':45s} {'outcome':9s} detail")
    for name, kind, detail, _ in rows:
        print(f"{name[:45]:45s} {kind:9s} {detail}")
    totals = {k: sum(1 for r in rows if r[1] == k) for k in ("clean", "traceback", "wrong", "unclear", "skipped")}
    print(f"\n{len(rows)} cases in {time.time() - start:.0f} s: " + ", ".join(f"{v} {k}" for k, v in totals.items()))
    if not args.keep:
        shutil.rmtree(BASE, ignore_errors=True)
    return 0 if totals["traceback"] + totals["wrong"] + totals["unclear"] == 0 else 1


BASE = Path(tempfile.gettempdir())

if __name__ == "__main__":
    sys.exit(main())
