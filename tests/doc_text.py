"""The README and docs/ as the doc tests read them: the files, and each file's ``##`` sections."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def sections(doc: Path) -> list[tuple[str, str]]:
    """``(heading, text)`` of each ``## `` section of ``doc``, the text before the first one under heading ``""``."""
    chunks = re.split(r"^(?=## )", doc.read_text(), flags=re.M)
    return [(chunk.splitlines()[0] if chunk.startswith("## ") else "", chunk) for chunk in chunks]


def records_removals(heading: str) -> bool:
    """Whether a section records what was removed ("Removed from the bench", ...): its names and commands are gone
    on purpose."""
    return "Removed" in heading
