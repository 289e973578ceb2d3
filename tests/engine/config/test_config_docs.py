"""docs/config.md stays in step with the schema and the DeepSpeed tables."""

from __future__ import annotations

from pathlib import Path

from tierzero.engine.config import reference

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_generated_tables_are_current() -> None:
    text = DOC.read_text()
    assert text.count("<!-- generated:") == len(reference.SECTIONS)
    assert reference.render(text) == text, (
        "docs/config.md is stale; run: python -m tierzero.engine.config.reference docs/config.md")

