"""``select`` by what it selects: a digest of the parameters a policy compresses and their ratios.

Two policies that select differently must never pass the cross-rank settings check
(:mod:`tagc.hooks.core.verify`) or a checkpoint's check (:mod:`tagc.hooks.core.checkpoint`) as equal, whatever
their names (two lambdas are both ``<lambda>``): both compare this fingerprint instead of the name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from tagc.hooks.core.plan import Planner
from tagc.hooks.core.segment import Segment


class SelectionRecord:
    """What ``select`` gives each parameter the hook has seen, and its digest."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.answers: dict[str, float | str | None] = {}
        self.bound = False
        """Whether an adapter bound the hook to its model's parameters (:meth:`note_parameters`)."""
        self._fingerprint: str | None = None  # until the answers change

    def note_parameters(self, segments: Iterable[Segment]) -> None:
        """Record the answers for a model's parameters (an adapter calls this when it installs the hook)."""
        for segment in segments:
            self.answers[segment.name] = self.answer(segment)
        self._fingerprint = None
        self.bound = True

    def note_bucket(self, segments: Sequence[Segment]) -> None:
        """A hook no adapter bound to a model fingerprints ``select`` by the buckets it starts (host work on
        the first step of each bucket only)."""
        if self.planner.codec.compresses and any(s.name not in self.answers for s in segments):
            for segment in segments:
                self.answers.setdefault(segment.name, self.answer(segment))
            self._fingerprint = None

    def answer(self, segment: Segment) -> float | str | None:
        """``select``'s answer for ``segment``: its ratio, ``None`` (plain), or the repr of an answer
        :func:`tagc.hooks.core.plan.ratio_of` rejects (it raises when the bucket is planned)."""
        try:
            return self.planner.ratio_of(segment)
        except ValueError:
            select = self.planner.settings.select
            return repr(select(segment.name, segment.module) if segment.selected is None else segment.selected)

    def fingerprint(self) -> str:
        """A digest of the parameters ``select`` compresses and their ratios, over the parameters seen; the
        policy's name while none were seen, or when the codec compresses nothing."""
        if self._fingerprint is None:
            select = self.planner.settings.select
            name = select.__name__ if hasattr(select, "__name__") else repr(select)
            if not self.answers or not self.planner.codec.compresses:
                return name
            chosen = sorted((param, answer) for param, answer in self.answers.items() if answer is not None)
            digest = hashlib.sha256(repr(chosen).encode()).hexdigest()[:16]
            self._fingerprint = f"{name}: {len(chosen)} of {len(self.answers)} parameters compressed, digest {digest}"
        return self._fingerprint
