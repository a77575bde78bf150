"""Fair transports on any process group: true reduce-scatter volume, line-rate pieces.

Gloo's ``reduce_scatter_tensor`` is an all-reduce underneath (twice the bytes), and one large
gloo message reaches about half of a shaped link's rate. Here every exchange is an
all-to-all split into pieces of at most :data:`PIECE_BYTES` per peer: each rank sends
``(N-1)/N`` of its buffer, the volume of a ring reduce-scatter, and reduces locally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

PIECE_BYTES = 1 << 20


@contextlib.contextmanager
def _peer_errors() -> Iterator[None]:
    """Turn a collective's failure (a dead or stuck peer, after the group's timeout) into a clear error."""
    try:
        yield
    except RuntimeError as exc:
        raise RuntimeError(
            f"TAGC exchange failed: a peer rank probably died or timed out ({type(exc).__name__}: {exc}). "
            "Check the other ranks' logs; the process group's timeout bounds this wait."
        ) from exc


@dataclasses.dataclass
class PendingExchange:
    """An all-to-all in flight: ``wait()`` returns the ``[N, C]`` rows received (row j from rank j).

    ``launched`` and ``arrived`` are ``time.perf_counter()`` stamps of the launch and of the last
    piece's completion (set by the collective's future, so it is known without blocking).
    """

    recv: torch.Tensor
    works: list
    sent_bytes: int
    launched: float = 0.0
    arrived: Optional[float] = None

    def __post_init__(self) -> None:
        done = itertools.count(1)  # next() on it is atomic: the callbacks may run on several threads

        def piece_done(_future) -> None:  # runs where the collective completes
            if next(done) == len(self.works):
                self.arrived = time.perf_counter()

        for piece in self.works:
            future = getattr(piece.work, "get_future", None)
            if future is None:
                return
            future().add_done_callback(piece_done)

    def is_completed(self) -> bool:
        """Whether every piece has arrived (never blocks)."""
        return all(piece.work.is_completed() for piece in self.works)

    def wait(self) -> torch.Tensor:
        with _peer_errors():
            for work in self.works:
                work.wait()
        return self.recv


def gather_from_owners(
    wanted: torch.Tensor, rows: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> tuple[torch.Tensor, int]:
    """Each rank asks every rank for ``rows[me, wanted]``; returns the sum over ranks and the bytes sent.

    ``wanted`` (int64 positions in this rank's chunk) may differ in length across ranks; every
    rank must call this (with an empty ``wanted`` if it needs nothing). Every buffer handed to a
    collective is on ``rows``' device. Not free of host synchronisation: the sizes are read on the
    host (the ``fallback="raw"`` re-send has data-dependent sizes).
    """
    world = rows.shape[0]
    device = rows.device  # every buffer a collective sees lives here (NCCL takes no CPU tensor)
    with _peer_errors():
        counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(counts, torch.full((1,), wanted.numel(), dtype=torch.int64, device=device), group=group)
        sizes = torch.cat(counts).tolist()  # one host read: the sizes below are data-dependent (not sync-free)
        padded = torch.zeros(max(sizes), dtype=torch.int64, device=device)
        padded[: wanted.numel()] = wanted
        lists = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(lists, padded, group=group)
        send = torch.cat([rows[r].index_select(0, lists[r][: sizes[r]]).float() for r in range(world)])
        recv = torch.empty(world * wanted.numel(), dtype=torch.float32, device=device)
        dist.all_to_all_single(recv, send, output_split_sizes=[wanted.numel()] * world, input_split_sizes=sizes, group=group)
    me = dist.get_rank(group)
    sent = (sum(sizes) - sizes[me]) * 4 + (world - 1) * (8 + 8 * max(sizes))
    return recv.view(world, wanted.numel()).sum(dim=0), sent


def all_to_all_rows(send: torch.Tensor, group: Optional[dist.ProcessGroup], piece_bytes: int = PIECE_BYTES) -> PendingExchange:
    """Start sending row ``s`` of ``send`` (``[N, C]``) to rank ``s`` of ``group``, in pieces.

    Asynchronous: returns at once; compute can run while the bytes are on the wire.
    """
    world = send.shape[0]
    send = send.contiguous()
    recv = torch.empty_like(send)
    columns = send.shape[1]
    step = max(1, piece_bytes // max(1, send.element_size()))
    works = []
    launched = time.perf_counter()
    with _peer_errors():
        for start in range(0, columns, step):
            stop = min(columns, start + step)
            if stop - start == columns:
                s_piece, r_piece = send, recv
            else:
                s_piece = send[:, start:stop].contiguous()
                r_piece = torch.empty(world, stop - start, dtype=send.dtype, device=send.device)
            work = dist.all_to_all_single(r_piece, s_piece, group=group, async_op=True)
            works.append(_PieceWork(work, r_piece, recv, start, stop))
    return PendingExchange(recv, works, (world - 1) * columns * send.element_size(), launched)


@dataclasses.dataclass
class _PieceWork:
    work: object
    piece: torch.Tensor
    recv: torch.Tensor
    start: int
    stop: int

    def wait(self) -> None:
        self.work.wait()
        if self.piece.data_ptr() != self.recv.data_ptr():
            self.recv[:, self.start : self.stop] = self.piece


def plain_reduce_scatter(
    chunks: torch.Tensor, group: Optional[dist.ProcessGroup], piece_bytes: int = PIECE_BYTES
) -> tuple[torch.Tensor, int]:
    """Sum over ranks of row ``rank`` of ``chunks`` (``[N, S]``), accumulated in float32.

    Returns ``(summed chunk, bytes this rank sent)``.
    """
    pending = all_to_all_rows(chunks, group, piece_bytes)
    received = pending.wait()
    return received.sum(dim=0, dtype=torch.float32), pending.sent_bytes
