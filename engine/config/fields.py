"""`meta()`: the metadata every config field carries (doc line and checks).

Its own file so that sections defined outside schema.py (zero.py, optim.py,
batch.py, outputs.py, train.py) use the same helper without an import cycle.
"""

from __future__ import annotations

from typing import Any, Literal

MiB = 1 << 20


def meta(
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    unit: Literal["bytes"] | None = None,
    path: bool = False,
    internal: bool = False,
) -> dict[str, Any]:
    """A field's metadata: one line of doc and its checks (see schema.py's module doc).

    `internal` fields are filled in by the loader and never read from a file.
    """
    return {
        "doc": doc,
        "ge": ge,
        "gt": gt,
        "le": le,
        "unit": unit,
        "path": path,
        "internal": internal,
    }
