"""Counters a TAGC hook keeps: what went on the wire, how decoding went, where time went."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ExchangeStats:
    """Totals over some span (one step, or the whole run)."""

    buckets: int = 0
    compressed_buckets: int = 0
    nonfinite_parts: int = 0
    wire_bytes: int = 0
    plain_equivalent_bytes: int = 0
    support: int = 0
    peeled: int = 0
    unpeeled: int = 0
    estimated: int = 0
    raw: int = 0
    compress_s: float = 0.0
    exposed_s: float = 0.0
    """Time the caller blocked waiting for bytes: the exchange time not hidden behind other work."""
    wire_s: float = 0.0
    """Per bucket, first launch to last byte received, summed over buckets."""
    decode_s: float = 0.0

    def add(self, other: "ExchangeStats") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["peel_success"] = self.peeled / self.support if self.support else 1.0
        out["wire_ratio"] = self.wire_bytes / self.plain_equivalent_bytes if self.plain_equivalent_bytes else 1.0
        return out
