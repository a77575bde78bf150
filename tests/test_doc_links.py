"""Every relative link in the README and docs/ names a file that exists and, with ``#``, a heading in it: the docs
move sections often, and a reader who follows a result to its section should land there."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.doc_text import DOCS

CODE_BLOCK = re.compile(r"```.*?```", flags=re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``_`` and ``-`` kept), spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache  # each doc links to a few others many times: read and parse each once
def anchors(path: Path) -> frozenset[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", CODE_BLOCK.sub("", path.read_text()), flags=re.M):
        anchor = github_anchor(heading)
        repeat = seen.get(anchor, 0)
        seen[anchor] = repeat + 1
        found.add(anchor if repeat == 0 else f"{anchor}-{repeat}")
    return frozenset(found)


@pytest.mark.parametrize("heading, anchor", [
    ("Eleventh screen: a fading (`tagc-dlr`), one seed", "eleventh-screen-a-fading-tagc-dlr-one-seed"),
    ("`RECOMMENDED`: what `tagc.hook()` fills in", "recommended-what-tagchook-fills-in"),
    ("`feedback_decay` at 4x the batch", "feedback_decay-at-4x-the-batch"),
])
def test_the_anchor_rule_matches_githubs(heading, anchor):
    assert github_anchor(heading) == anchor


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", doc.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)
