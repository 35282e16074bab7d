"""The layers stay layers: checked on the source, so an import that crosses a boundary fails
here before it becomes a cycle or a policy that knows how time is simulated."""

from __future__ import annotations

import ast
import pathlib

import pytest

JSERVE = pathlib.Path(__file__).resolve().parents[1] / "jserve"


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (relative imports are
    resolved against the file's package)."""
    package = ".".join(path.relative_to(JSERVE.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def crossings(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{path.relative_to(JSERVE.parent)}: {module}"
                  for path in (JSERVE / layer).rglob("*.py")
                  for module in imported_modules(path)
                  if any(module == f or module.startswith(f + ".") for f in forbidden))


ASSEMBLY = ("jserve.builder", "jserve.config", "jserve.serving", "jserve.benchmarking", "jserve.cli")


@pytest.mark.parametrize(("layer", "forbidden"), [
    ("policies", ("jserve.runners", *ASSEMBLY)),  # the plan/view contract and data only
    ("runners", ASSEMBLY),  # runners sit below what assembles engines and the front ends
    ("engine", ("jserve.runners", "jserve.policies", *ASSEMBLY)),
    ("cache_features", ("jserve.runners", "jserve.policies", *ASSEMBLY)),  # plugged into the engine
])
def test_layer_does_not_import(layer: str, forbidden: tuple[str, ...]) -> None:
    assert crossings(layer, forbidden) == []


def test_the_check_sees_imports() -> None:
    assert "jserve.engine.preemption_costs.PreemptionCosts" in imported_modules(
        JSERVE / "policies" / "cacheopt.py")
