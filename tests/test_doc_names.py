"""Every dotted name of this repo's code the README and docs/ quote (```tagc.hooks.core.settings.RECOMMENDED```)
still names something: code moves and renames, and a reader who looks a name up should find it. A name of
something removed may stay as a record in a "Removed" section, or where its paragraph says it was removed."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.doc_text import DOCS, records_removals, sections

NAME = re.compile(r"`((?:tagc|gpt2_bench|testbed|fsdp_integration|backward_drain)(?:\.\w+)+)(?:\([^`]*\))?`")


def quoted_names() -> list[tuple[str, str, str]]:
    """``(doc, name, its paragraph)`` outside the "Removed" sections; a heading counts as part of the paragraph
    under it."""
    found = []
    for doc in DOCS:
        for heading, section in sections(doc):
            if records_removals(heading):
                continue
            for paragraph in re.split(r"\n\s*\n", re.sub(r"^(#+ .*)\n\n", r"\1\n", section, flags=re.M)):
                found += [(doc.name, match.group(1), paragraph) for match in NAME.finditer(paragraph)]
    return found


def resolves(dotted: str) -> bool:
    """Whether the longest importable prefix of ``dotted`` has the rest as attributes or submodules."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


NAMES = quoted_names()


def test_the_docs_quote_names():
    assert len({name for _, name, _ in NAMES}) >= 50


@pytest.mark.parametrize("doc, name, paragraph", NAMES, ids=[f"{doc}:{name}" for doc, name, _ in NAMES])
def test_a_quoted_name_exists_or_its_paragraph_says_it_was_removed(doc, name, paragraph):
    assert resolves(name) or "removed" in paragraph.lower(), f"{doc}: `{name}` names nothing in the code"
