"""The exchange state of a hook: where the run is (steps and the dense warm-up),
its statistics, and the buckets in flight.

The codecs hold their own state (error-feedback residuals); this is everything else that changes
from bucket to bucket, kept in one small object so that the functions of the eager path
(:mod:`tagc.hooks.core.eager`) and the traced path (:mod:`tagc.hooks.core.traced`) take it explicitly.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from tagc.hooks.core.stats import ExchangeStats


@dataclasses.dataclass
class UnitTiming:
    """One bucket's exchange in one step, in ``time.perf_counter()`` seconds.

    ``wire_s`` runs from the first launch to the last byte received; ``exposed_s`` is how long
    the caller blocked waiting for those bytes (the rest of ``wire_s`` was hidden behind other
    work); ``events`` are ``(kind, start, end)`` spans on the caller's thread (``compress``,
    ``decode``, ``wait``) and ``wire`` spans of the parts, for a timeline picture.
    """

    unit: str
    wire_bytes: int = 0
    launched: float = 0.0
    arrived: float = 0.0
    exposed_s: float = 0.0
    compress_s: float = 0.0
    decode_s: float = 0.0
    events: list = dataclasses.field(default_factory=list)

    @property
    def wire_s(self) -> float:
        return max(0.0, self.arrived - self.launched)

    def as_dict(self) -> dict:
        return {"unit": self.unit, "wire_bytes": self.wire_bytes, "wire_s": self.wire_s, "exposed_s": self.exposed_s,
                "compress_s": self.compress_s, "decode_s": self.decode_s, "events": list(self.events)}


class ExchangeState:
    """Steps, statistics, buckets in flight and a loaded checkpoint's bookkeeping.

    ``dense_steps`` (resolved) places each step in the schedule: the dense warm-up sends everything plain,
    then the steady plan runs."""

    def __init__(self, dense_steps: int) -> None:
        self.dense_steps = dense_steps
        self.step_count = 0
        """Steps completed."""
        self.seen_this_step: set[str] = set()
        self.current = ExchangeStats()
        self.total = ExchangeStats()
        self.last_step = ExchangeStats()
        self.units: list[UnitTiming] = []
        self.last_units: list[UnitTiming] = []
        self.host_read_sites: collections.Counter[str] = collections.Counter()
        self.in_flight: list[Any] = []
        """Buckets started and not yet waited for (:class:`tagc.hooks.core.eager.PendingBucket`), oldest first."""
        self.restored: Any | None = None
        """What a loaded checkpoint holds codec state for (:class:`tagc.hooks.core.checkpoint.Restored`), until a
        compressed step has run after the load."""

    @property
    def dense(self) -> bool:
        """Whether this step is in the dense warm-up (every bucket goes plain)."""
        return self.step_count < self.dense_steps

    def record(self, stats: ExchangeStats, timing: UnitTiming | None = None) -> None:
        """Add an exchange's statistics to this step's and the run's (and its timing to this step's units)."""
        self.current.add(stats)
        self.total.add(stats)
        if timing is not None:
            self.units.append(timing)

    def note_host_reads(self, reads: Any) -> None:
        """Count the host reads of an entry point (strict sync mode: :class:`tagc.hooks.core.strict.HostReads`)."""
        for stats in (self.current, self.total):
            stats.host_reads += reads.count
            stats.backend_host_reads += reads.backend
        self.host_read_sites.update(reads.sites)

    def repeats(self, key: str) -> bool:
        """Whether bucket ``key`` was already exchanged this step (then a new step began)."""
        return key in self.seen_this_step

    def settle_restored(self) -> None:
        """At the end of a step: once a compressed step has run, every part found a loaded checkpoint's state."""
        if self.restored is not None and self.step_count >= self.dense_steps:
            self.restored = None

    def close_step(self) -> None:
        """This step's statistics become the last step's (the caller counts the step)."""
        self.last_step = self.current
        self.last_units = self.units
        self.current = ExchangeStats()
        self.units = []
        self.seen_this_step.clear()
