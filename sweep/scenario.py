"""The scenario library: each known NaN post-mortem reproduced on a tiny model, with its fix, and checked.

    python -m sweep +scenario=videochat2_fp16_overflow      # one scenario (a small multirun)
    python -m sweep.scenario                                # list them

A scenario is an experiment file, `conf/scenario/<name>.yaml`: the config that makes the failure
happen, a sweep over the failing setting and its fix (`hydra.mode: MULTIRUN`), and a `scenario:` node
saying what must come out (`expect`: for the runs whose params match `when`, the status, verdict,
cause and, for a data fault, one first_bad_step whatever the lr). When the sweep ends, the summary
tables print as for any sweep, then one block says whether every expectation was met, and
`scenario.json` in the sweep directory records it. docs/scenarios.md describes each one.

A scenario that fine-tunes or resumes "pretrained" weights sets `pretrain_steps`: before its runs,
the scenario's model trains that long and saves `<sweep dir>/pretrained/checkpoints/step_<N>`;
`pretrain_overrides` (dotted keys) say how that earlier stage differed, e.g. a larger batch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sweep.config import ConfigError, RunConfig, ScenarioConfig, ScenarioExpect, flatten, to_run_config
from sweep.run.results import recorded_mechanism

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "scenario"


def pretrain_config(config: DictConfig) -> RunConfig:
    """The run a scenario pretrains: its composed config with `scenario.pretrain_overrides` set."""
    cfg = copy.deepcopy(config)
    overrides = OmegaConf.to_container(config.scenario.pretrain_overrides)
    for key, value in flatten(overrides).items():  # {data.batch_size: 16} or {data: {batch_size: 16}}
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException as e:
            raise ConfigError(f"scenario.pretrain_overrides: {key}: {str(e).splitlines()[0]}") from None
    return to_run_config(cfg)


def pretrain(run: RunConfig, sweep_dir: Path) -> Path | None:
    """Train the scenario's model `pretrain_steps` steps from scratch and keep only its checkpoint."""
    from sweep.run.execute import execute

    steps = run.scenario.pretrain_steps
    if steps <= 0:
        return None
    out = Path(sweep_dir) / "pretrained"
    ckpt = out / "checkpoints" / f"step_{steps:06d}"
    if ckpt.is_dir():  # a resumed sweep keeps the weights its finished runs started from
        return ckpt
    base = dataclasses.replace(
        run,
        steps=steps,
        model=dataclasses.replace(run.model, init_from=None),
        checkpoint=dataclasses.replace(run.checkpoint, every=steps, keep=1, resume_from=None, inject=None),
        data=dataclasses.replace(run.data, faults=[]),
        ledger=dataclasses.replace(run.ledger, enabled=False),
    )
    result = execute(base, out, params={}, label="pretrain")
    (out / "result.json").replace(out / "pretrain.json")  # not a cell of the sweep
    (out / "metrics.csv").unlink(missing_ok=True)
    if result.status != "stable" or not ckpt.is_dir():
        raise RuntimeError(f"the scenario's pretraining run did not finish stable: {result.headline()}")
    return ckpt


@dataclass
class Outcome:
    """How the runs matching one expectation ended."""

    expect: ScenarioExpect
    matched: int
    failures: list[str]

    @property
    def ok(self) -> bool:
        return self.matched > 0 and not self.failures

    def describe(self) -> str:
        e = self.expect
        when = " ".join(f"{k}={v}" for k, v in e.when.items()) or "every run"
        want = e.status + (f" {e.verdict}" if e.verdict else "")
        where = "/".join(x for x in (e.cause_where, e.cause_module) if x)
        want += f" (cause {where})" if where else ""
        want += ", all at the same step" if e.same_step else ""
        want += f", max attention logit > {e.max_attn_logit_above:g}" if e.max_attn_logit_above is not None else ""
        want += f", max attention logit < {e.max_attn_logit_below:g}" if e.max_attn_logit_below is not None else ""
        want += f", modulate kernel parity {e.modulate_parity}" if e.modulate_parity else ""
        mark = "ok  " if self.ok else "FAIL"
        head = f"{mark} {when}: {want}: {self.matched - len(self.failures)}/{self.matched} runs"
        return (
            head + "".join(f"\n       {f}" for f in self.failures[:4]) + ("" if self.matched else " (no run matched)")
        )


def _same(a, b) -> bool:
    """A swept value against a `when` value: numbers by value (0 is 0.0, 1e-3 is 0.001), the rest as text."""
    if not isinstance(a, bool) and not isinstance(b, bool):
        try:
            x, y = float(a), float(b)
            if math.isfinite(x) and math.isfinite(y):  # "nan" (checkpoint.inject=nan) is a word here, not a number
                return x == y
        except (TypeError, ValueError):
            pass
    return str(a).lower().replace(" ", "") == str(b).lower().replace(" ", "")  # [0.9, 0.95] is [0.9,0.95]


@lru_cache(maxsize=None)
def modulate_parity(impl: str) -> str:
    """ok | mismatch: `python -m sweep.parity --modulate IMPL` (forward and backward, batch 1-4, every dtype)."""
    from sweep.parity import SHORT_NAMES, resolve
    from sweep.parity import check as parity_check

    fn = resolve("modulate", impl)
    worst = max(max(parity_check("modulate", fn, dtype, batch)) for dtype in SHORT_NAMES for batch in (1, 2, 3, 4))
    return "ok" if worst <= 1 else "mismatch"


def check(expects: list[ScenarioExpect], results: list[dict]) -> list[Outcome]:
    """Each expectation against the result.json contents of the sweep's runs."""
    outcomes = []
    for e in expects:
        runs = [r for r in results if all(_same((r.get("params") or {}).get(k), v) for k, v in e.when.items())]
        failures = []
        for r in runs:
            cause = r.get("cause") or {}
            got = (r.get("status"), r.get("verdict"), cause.get("where"), cause.get("module") or "")
            mechanism = recorded_mechanism(r)  # its own signals', whatever a diagnosis found since
            logit = r.get("max_attn_logit")
            impl = (r.get("params") or {}).get("modulate")
            parity = modulate_parity(str(impl)) if e.modulate_parity and impl is not None else None
            bad = (
                got[0] != e.status
                or (e.verdict and got[1] != e.verdict)
                or (e.cause_where and got[2] != e.cause_where)
                or (e.cause_module and not got[3].startswith(e.cause_module))
                or (e.mechanism and mechanism != e.mechanism)
                or (e.max_attn_logit_above is not None and not (logit is not None and logit > e.max_attn_logit_above))
                or (e.max_attn_logit_below is not None and not (logit is not None and logit < e.max_attn_logit_below))
                or (e.modulate_parity and parity != e.modulate_parity)
            )
            if bad:
                label = " ".join(f"{k}={v}" for k, v in (r.get("params") or {}).items())
                failures.append(
                    f"{label}: got {got[0]} {got[1] or ''} at step {r.get('first_bad_step')} "
                    f"(cause {got[2]}/{got[3] or '-'}, mechanism {mechanism}, max attention logit {logit}"
                    + (f", modulate parity {parity})" if e.modulate_parity else ")")
                )
        steps = {r.get("first_bad_step") for r in runs}
        if e.same_step and len(steps) > 1:
            failures.append(f"first_bad_step differs between runs: {sorted(steps, key=str)}")
        outcomes.append(Outcome(e, len(runs), failures))
    return outcomes


def render(scenario: ScenarioConfig, outcomes: list[Outcome], changed: list[str] = ()) -> str:
    """The scenario block; `changed`: the command line's overrides besides the scenario itself, named when the
    expectations failed (they are the scenario's own settings', e.g. its 20 steps, not a longer run's)."""
    reproduced = all(o.ok for o in outcomes)
    lines = [
        f"Scenario {scenario.name}: {'REPRODUCED' if reproduced else 'NOT reproduced'}",
        f"  case: {scenario.case}",
    ]
    lines += [f"  {o.describe()}" for o in outcomes]
    lines.append(f"  fix: {scenario.fix}")
    if changed and not reproduced:
        lines.append(
            f"  note: the expectations are for the scenario's own settings; this sweep set {' '.join(changed)}"
        )
    return "\n".join(lines)


def write(sweep_dir: Path, scenario: ScenarioConfig, outcomes: list[Outcome]) -> Path:
    path = Path(sweep_dir) / "scenario.json"
    path.write_text(
        json.dumps(
            {
                "name": scenario.name,
                "case": scenario.case,
                "fix": scenario.fix,
                "reproduced": all(o.ok for o in outcomes),
                "expectations": [
                    {**dataclasses.asdict(o.expect), "matched": o.matched, "ok": o.ok, "failures": o.failures}
                    for o in outcomes
                ],
            },
            indent=2,
        )
        + "\n"
    )
    return path


def available() -> dict[str, str]:
    """{name: first comment line} of every conf/scenario/*.yaml."""
    out = {}
    for path in sorted(CONF_DIR.glob("*.yaml")):
        lines = [ln[2:].strip() for ln in path.read_text().splitlines() if ln.startswith("# ") and "@package" not in ln]
        out[path.stem] = lines[0] if lines else ""
    return out


def main() -> int:
    width = max(map(len, available()), default=0)
    print("Scenarios (run one with: python -m sweep +scenario=NAME; docs/scenarios.md explains each):")
    for name, title in available().items():
        print(f"  {name:<{width}}  {title}")
    return 0


if __name__ == "__main__":
    from sweep.exit import exit_after

    exit_after(main)
