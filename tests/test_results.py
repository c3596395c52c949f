"""result.json is always written, as strict JSON, whatever values a run held."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

from sweep.run.results import RESULT_FILE, RunResult, write_result


class Color(str, Enum):
    red = "red"


def strict_load(path: Path) -> dict:
    """json.loads that refuses NaN/Infinity, as JavaScript's JSON.parse and most other readers do."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_nonfinite_and_huge_values_never_lose_result_json(tmp_path):
    result = RunResult(
        status="diverged",
        verdict="nonfinite_loss",
        final_loss=float("nan"),
        max_grad_norm=float("inf"),
        seed=10**30,
        params={
            "optim.lr": float("inf"),
            "tag": float("-inf"),
            "big": 10**30,
            "where": Path("/tmp/x"),
            "color": Color.red,
            "pair": (1.0, float("nan")),
        },
        cause={"where": "forward", "module": None, "detail": "x", "amax": float("inf")},
        headroom=[{"module": "blocks.0", "amax": float("inf")}],
    )
    data = strict_load(write_result(tmp_path, result))
    assert (data["final_loss"], data["max_grad_norm"]) == (None, None)  # measured: null, as before
    assert data["params"] == {
        "optim.lr": "inf",
        "tag": "-inf",
        "big": str(10**30),
        "where": "/tmp/x",
        "color": "red",
        "pair": [1.0, "nan"],
    }
    assert data["cause"]["amax"] == "inf" and data["headroom"][0]["amax"] == "inf"
    assert data["seed"] == str(10**30)


def test_ordinary_values_are_written_as_they_are(tmp_path):
    result = RunResult(status="stable", final_loss=0.5, seed=7, params={"optim.lr": 1e-3, "steps": 5, "q": True})
    data = strict_load(write_result(tmp_path, result))
    assert data == json.loads(json.dumps(result.to_dict()))
    assert (tmp_path / RESULT_FILE).is_file() and not (tmp_path / "result.tmp").exists()
