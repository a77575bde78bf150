"""The project's source files by module name, for the tests that read the code (imports, torch internals)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(packages: Sequence[str]) -> dict[str, Path]:
    """``{dotted module name: path}`` of every ``.py`` file under ``packages`` (a package's ``__init__``
    under the package's own name)."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found
