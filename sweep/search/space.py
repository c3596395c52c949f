"""Hydra sweep syntax -> Optuna distributions, compatible with hydra-optuna-sweeper's syntax.

    optim.lr=tag(log,interval(1e-5,1e-1))   -> FloatDistribution(1e-5, 1e-1, log=True)
    optim.warmup_steps=interval(0,20)        -> IntDistribution(0, 20)
    precision=choice(fp32,bf16_amp)          -> CategoricalDistribution
    precision=fp32,bf16_amp                  -> CategoricalDistribution (Hydra's comma list)
    steps=range(10,50,10)                    -> CategoricalDistribution((10, 20, 30, 40))

Unlike hydra-optuna-sweeper 1.3, range(a, b, step) keeps Hydra's exclusive upper bound for every
sampler (that plugin turned it into an IntDistribution that includes b). A plain `key=value` is a
fixed override passed to every job unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution


def distribution_of(override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override."""
    value = override.value()
    if isinstance(value, ChoiceSweep):
        return CategoricalDistribution(tuple(override.sweep_iterator(transformer=lambda x: x)))
    if isinstance(value, RangeSweep):
        return CategoricalDistribution(tuple(override.sweep_iterator(transformer=lambda x: x)))
    if isinstance(value, IntervalSweep):
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(int(value.start), int(value.end), log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise ValueError(f"{override.input_line}: not a sweep (choice, range, interval or a comma list)")


def parse(arguments: list[str]) -> tuple[dict[str, BaseDistribution], list[str]]:
    """(search space by dotted key, fixed overrides) from sweep arguments."""
    space: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for override in OverridesParser.create().parse_overrides(arguments):
        if override.is_sweep_override():
            space[override.get_key_element()] = distribution_of(override)
        else:
            fixed.append(override.input_line)
    return space, fixed


def repeated_value(arguments: list[str]) -> str | None:
    """A line naming the first sweep axis that lists one value twice (compared after parsing: 1e-3 and
    0.001 are one value), or None. A repeated value is no replicate: the same cell runs with the same seed
    and the tables would count it twice with zero spread."""
    for override in OverridesParser.create().parse_overrides(arguments):
        if not override.is_sweep_override() or not isinstance(override.value(), (ChoiceSweep, RangeSweep)):
            continue
        seen: dict[Any, Any] = {}
        for value in override.sweep_iterator(transformer=lambda x: x):
            same = _comparable(value)
            if same in seen:
                key, listed = override.get_key_element(), override.input_line.split("=", 1)[-1]
                return (
                    f"{key}: the value {value!r} is listed twice in the sweep ({listed}); "
                    "a repeated value is not a replicate (same cell, same seed): list each value once, and use "
                    "replicates=N for several seeds"
                )
            seen[same] = value
    return None


def shadowed_axis(params: list[str], arguments: list[str]) -> str | None:
    """A line for the first key that `hydra.sweeper.params` (`params`, as key=value) sweeps and the command
    line gives one plain value, or None. The sweep would run every value of the axis anyway (the single
    value is ignored: `+ladder=width model.width=32` ran 32, 64 and 128); a comma list replaces the axis."""
    parser = OverridesParser.create()
    swept = {o.get_key_element(): o for o in parser.parse_overrides(params) if o.is_sweep_override()}
    for override in parser.parse_overrides(arguments):
        key = override.get_key_element()
        if key in swept and not override.is_sweep_override() and not override.is_delete():
            axis = swept[key].input_line.split("=", 1)[-1]
            return (
                f"{key}: this sweep already sweeps {key} over {axis} (hydra.sweeper.params, e.g. from +ladder=...), "
                f"so one value would be ignored; give the values to sweep as a list ({key}=a,b,...), which "
                "replaces them, or leave out the config that sweeps it to run one value"
            )
    return None


def _comparable(value: Any) -> Any:
    """What makes two parsed sweep values the same value: numbers by value (1e-3 == 0.001, 1 == 1.0), the
    rest by type and text."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    if isinstance(value, str):
        return ("str", value)
    return (type(value).__name__, repr(value))


def grid_cells(space: dict[str, BaseDistribution]) -> list[dict[str, Any]]:
    """Every cell of an all-categorical space, in a fixed order."""
    if any(not isinstance(d, CategoricalDistribution) for d in space.values()):
        raise ValueError("the grid sampler needs choices for every axis (no interval(...))")
    keys = sorted(space)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(space[k].choices for k in keys))]


def as_override(key: str, value: Any) -> str:
    """key=value in Hydra override syntax (strings quoted when they need it)."""
    if isinstance(value, str) and not value.replace("_", "").replace("-", "").replace(".", "").isalnum():
        return f"{key}='{value}'"
    return f"{key}={value}"
