"""The traced exchange: the eager path's encode and decode (per batch of parts) around one fixed-shape collective.

:func:`encode_bucket` puts every batch's wire tensors side by side as bytes (``uint8 [N, B]``), one
all-to-all per bucket (a compiled graph's functional collective, :mod:`tagc.hooks.adapters.simple`), whose
wait a compiler can move past later compute; :func:`decode_bucket` cuts what arrived back into the
batches' wires and decodes them. ``B`` follows from the settings alone (:func:`wire_row_bytes`), so a
compiled graph can hold it.
"""

from __future__ import annotations

import torch

from tagc.hooks.codecs.codec import Wire
from tagc.hooks.core.exchange import PartCoder
from tagc.hooks.core.hierarchy import Topology
from tagc.hooks.core.plan import BucketPlan
from tagc.hooks.core.state import UnitTiming
from tagc.hooks.core.stats import ExchangeStats, plain_bytes
from tagc.hooks.core.transport import op_scale, scale_into


def wires(plan: BucketPlan, world: int, dtype: torch.dtype) -> list[Wire]:
    """Every batch's wire tensors (:attr:`BucketPlan.batches`), in order."""
    return [wire for batch in plan.batches for wire in batch.wire(world, dtype)]


def wire_row_bytes(plan: BucketPlan, world: int, dtype: torch.dtype) -> int:
    """Bytes per rank row of :func:`encode_bucket`'s tensor."""
    return sum(wire.row_bytes for wire in wires(plan, world, dtype))


def traceable(plan: BucketPlan, world: int) -> bool:
    """Whether the bucket can go through fixed-shape collectives: it has compressed parts, and no codec
    needs data-dependent sizes (``fallback="raw"``)."""
    return world > 1 and plan.compressed and all(p.codec.traceable() for p in plan.parts)


def encode_bucket(plan: BucketPlan, rows: torch.Tensor, group, coder: PartCoder) -> tuple[torch.Tensor, UnitTiming]:
    """Every batch of ``rows`` (``[N, chunk]``) encoded, its wire tensors side by side as bytes, and the timing."""
    timing = UnitTiming(plan.key)
    encoded = [w.contiguous().view(torch.uint8) for batch in plan.batches
               for w in coder.encode(batch, batch.take(rows), group, timing)]
    return torch.cat(encoded, dim=1), timing


def decode_bucket(plan: BucketPlan, received: torch.Tensor, group, world: int, dtype: torch.dtype, op,
                  coder: PartCoder, whole: Topology | None = None,
                  remote_rows: int = 0) -> tuple[torch.Tensor, ExchangeStats]:
    """Every rank's row of :func:`encode_bucket`'s bytes (row ``j`` from rank ``j``, ``world`` ranks) -> this
    rank's reduced ``plan.chunk`` elements in ``dtype`` (FSDP's reduce ``op``), and the exchange's statistics.

    ``whole``: the whole group's topology when ``group`` is its cross group (a hierarchical exchange):
    ``op`` then scales over the whole group, the plain-equivalent bytes are the whole group's, and the
    wire bytes count its intra-host step.
    ``remote_rows``: rows of the exchange that went to another host."""
    chunk = plan.chunk
    full = whole.world if whole is not None else world
    step1 = whole.step1_bytes(chunk, dtype) if whole is not None else 0
    stats = ExchangeStats(buckets=1, compressed_buckets=1, plain_equivalent_bytes=plain_bytes(full, chunk),
                          wire_bytes=(world - 1) * received.shape[1] + step1,
                          inter_host_bytes=remote_rows * received.shape[1])
    summed = torch.zeros(chunk, dtype=torch.float32, device=received.device)
    at = 0
    for batch in plan.batches:
        batch_received = []
        for wire in batch.wire(world, dtype):
            batch_received.append(received[:, at : at + wire.row_bytes].contiguous().view(wire.dtype))
            at += wire.row_bytes
        batch.put(summed, coder.decode(batch, batch_received, group, stats))
    output = torch.empty(chunk, dtype=dtype, device=summed.device)
    scale_into(output, summed, op_scale(op, full))
    return output, stats
