"""The three packages import and only point downwards (engine -> offload -> swap)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> packages it must never import
FORBIDDEN = {"swap": {"offload", "engine"}, "offload": {"engine"}}


@pytest.mark.parametrize("name", ["engine", "offload", "swap", "configs"])
def test_package_imports(name: str) -> None:
    importlib.import_module(f"tierzero.{name}")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package: str) -> None:
    bad: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for mod in names:
                parts = mod.split(".")
                layer = parts[1] if parts[0] == "tierzero" and len(parts) > 1 else parts[0]
                if layer in FORBIDDEN[package]:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {mod}")
    assert not bad, "imports must point down (engine -> offload -> swap):\n" + "\n".join(bad)
