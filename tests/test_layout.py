"""The dependency direction of the house, read from the real import statements (module level and inside functions).

run/ is one run from RunConfig to result.json: it never imports search/, Hydra or OmegaConf (pruning
reaches it as step hooks). data/ never imports run/. models/ never imports sweep/ or Hydra. The plugins'
modules, which Hydra's discovery imports in every Hydra app, import only glue at module level. And no
two of our modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sweep", "models", "hydra_plugins")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def ours() -> dict[str, Path]:
    return {module_name(p): p for p in sources(*PACKAGES)}


def offending(paths: list[Path], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in paths:
        for name in sorted(imports(path)):
            hit = any(name == f or name.startswith(f + ".") for f in forbidden)
            if hit and not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_the_import_parser_sees_what_it_must():
    """The checks below are only as good as this: relative, from-package and function-level imports count."""
    probe = ROOT / "sweep" / "run" / "_probe_for_test.py"
    probe.write_text("from ..search import ledger\nfrom . import build\n\ndef f():\n    import hydra.core\n")
    try:
        found = imports(probe)
    finally:
        probe.unlink()
    assert {"sweep.search", "sweep.search.ledger", "sweep.run.build", "hydra.core"} <= found
    assert offending([ROOT / "sweep" / "run" / "execute.py"], ("sweep.run",)), "execute.py imports run/ modules"


def test_run_imports_neither_search_nor_hydra():
    assert (
        offending(
            sources("sweep/run"),
            (
                "sweep.search",
                "hydra",
                "omegaconf",
                "optuna",
                "hydra_plugins",
                "sweep.job",
                "sweep.callbacks",
                "sweep.report",
                "sweep.__main__",
            ),
        )
        == []
    )


def test_data_imports_nothing_from_run():
    assert offending(sources("sweep/data"), ("sweep.run", "sweep.search", "hydra", "omegaconf", "optuna")) == []


def test_models_import_neither_sweep_nor_hydra():
    assert offending(sources("models"), ("sweep", "hydra", "omegaconf", "optuna")) == []


def test_plugin_discovery_imports_glue_only():
    """Hydra imports these modules in every Hydra app: the implementation waits until a plugin is set up."""
    heavy = ("torch", "optuna", "models", "sweep")
    for path in sources("hydra_plugins"):
        eager = {n for n in imports(path, top_level_only=True) if any(n == h or n.startswith(h + ".") for h in heavy)}
        assert eager <= {"sweep.search.conf", "sweep.search.conf.OptunaSweepConf"}, (
            f"{path.name} imports {sorted(eager)}"
        )


def test_no_import_cycle():
    modules = ours()
    graph = {m: {n for n in imports(p) if n in modules and n != m} for m, p in modules.items()}
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join(path[path.index(n) :] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("top", ["sweep"])
def test_the_top_of_sweep_holds_only_what_a_user_runs_or_configures(top):
    """The app, schema, callbacks, the one-line error, how a command exits, and the commands; the rest lives in
    run/, data/, search/."""
    assert {p.stem for p in (ROOT / top).glob("*.py")} == {
        "__init__",
        "__main__",
        "errors",
        "exit",  # how every command above ends (sweep/exit.py)
        "callbacks",
        "job",
        "replay",
        "parity",
        "doctor",
        "scenario",
        "sync_ledger",
        "coord_check",  # python -m sweep.coord_check (issue #30)
    }
    assert (ROOT / top / "config" / "__init__.py").is_file()  # the schema and its checks: a package
