"""Counters a TAGC hook keeps: what went on the wire, how decoding went, where time went."""

from __future__ import annotations

import dataclasses
from typing import Union

import torch

PLAIN_BYTES_PER_ELEMENT = 4
"""The fair baseline sends float32."""


def plain_bytes(world: int, numel: int) -> int:
    """What one rank puts on the wire in a plain float32 reduce-scatter of ``numel``-element chunks over
    ``world`` ranks: ``world - 1`` chunks (the ``plain_equivalent_bytes`` every exchange is set against)."""
    return (world - 1) * numel * PLAIN_BYTES_PER_ELEMENT


Count = Union[int, torch.Tensor]
"""A counter the codecs may keep on the device: a Python int, or a 0-d int64 tensor added to without a
host read (read once, by :meth:`ExchangeStats.as_dict`)."""


@dataclasses.dataclass
class ExchangeStats:
    """Totals over some span (one step, or the whole run).

    The fields typed :data:`Count` may hold 0-d int64 tensors (counted on the device, so the exchange
    never waits for a host read); :meth:`as_dict` gives every field as a number.
    """

    buckets: int = 0
    compressed_buckets: int = 0
    nonfinite_parts: Count = 0
    """Parts some rank's NaN/Inf made NaN at their owner (:meth:`count_nonfinite`)."""
    wire_bytes: int = 0
    """Every byte this rank sent (both steps of a hierarchical exchange)."""
    plain_equivalent_bytes: int = 0
    """What a flat fp32 reduce-scatter of the same buckets over the whole group would send (ring
    volume, ``(N-1)/N`` of the bucket), hierarchical or not; FSDP2 HSDP: native HSDP's fp32 volume
    (the intra-host reduce-scatter and a ring all-reduce across hosts)."""
    inter_host_bytes: int = 0
    """The part of ``wire_bytes`` sent to ranks on other hosts (0 on one host, or when the hook does
    not know the hosts: ``ranks_per_host``). ``fallback="raw"``'s re-sends are not split by host."""
    support: Count = 0
    peeled: Count = 0
    unpeeled: Count = 0
    estimated: Count = 0
    raw: int = 0
    overflow: Count = 0
    """Entries the selection rule keeps but a row's capacity (:func:`tagc.sketch.sparsify.capacity`)
    held back: ``topk``'s fixed-size lists, and ``tagc``'s rows on every wire (a sample that
    misjudged its row). They stay in the residual and are sent later."""
    bitmap_blocks: Count = 0
    """Coded positions: blocks dense enough to travel as their bitmap (:mod:`tagc.sketch.positions`)."""
    compress_s: float = 0.0
    exposed_s: float = 0.0
    """Time the caller blocked waiting for bytes: the exchange time not hidden behind other work."""
    wire_s: float = 0.0
    """Per bucket, first launch to last byte received, summed over buckets."""
    decode_s: float = 0.0
    host_reads: int = 0
    """Strict sync mode (``TAGC_STRICT_SYNC=1``, :mod:`tagc.hooks.core.strict`): host reads of tensors
    in the exchange, each a device synchronisation on a GPU (0 otherwise: not counted)."""
    backend_host_reads: int = 0
    """Strict sync mode: host reads inside the CPU-only Numba back end (CPU tensors, no synchronisation)."""

    def count_nonfinite(self, ok: torch.Tensor) -> None:
        """``nonfinite_parts += 1`` where ``ok`` (bool, 0-d or one per part: the part was finite) is false, on
        ``ok``'s device: the one place a codec counts a NaN/Inf part, with no host read."""
        self.count("nonfinite_parts", (~ok).sum())

    def count(self, name: str, amount: Count) -> None:
        """``self.<name> += amount`` for a field (a :data:`Count`, or an int or float), where either may be a device
        tensor made on another stream (a DDP future's callback counts on the hook's stream what the backward's
        stream began)."""
        total = getattr(self, name)
        _used_on_current_stream(total)
        _used_on_current_stream(amount)
        setattr(self, name, total + amount)

    def add(self, other: "ExchangeStats") -> None:
        for field in dataclasses.fields(self):
            self.count(field.name, getattr(other, field.name))

    def as_dict(self) -> dict:
        # a codec counts on the device (0-d tensors: no host sync in the exchange): read here, once
        out = {field.name: _number(getattr(self, field.name)) for field in dataclasses.fields(self)}
        out["peel_success"] = out["peeled"] / out["support"] if out["support"] else 1.0
        out["wire_ratio"] = out["wire_bytes"] / out["plain_equivalent_bytes"] if out["plain_equivalent_bytes"] else 1.0
        return out


def _used_on_current_stream(value: object) -> None:
    """Tell the caching allocator that the current stream reads ``value`` (a CUDA tensor; anything else is left
    alone), so that a counter made on another stream is not reused before it is read (docs/design.md §2, "Where
    DDP's callbacks run"). No host synchronisation; nothing under compilation, which orders its own buffers."""
    if isinstance(value, torch.Tensor) and value.is_cuda and not torch.compiler.is_compiling():
        value.record_stream(torch.cuda.current_stream(value.device))


def _number(value: Union[Count, float]) -> Union[int, float]:
    return value.item() if isinstance(value, torch.Tensor) else value
