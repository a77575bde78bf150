"""Fair transports on any process group: true reduce-scatter volume, line-rate pieces on gloo (docs/design.md §7,
§10).

Every exchange is an all-to-all (row ``j`` to rank ``j``): each rank sends ``(N-1)/N`` of its buffer, a ring
reduce-scatter's volume, and the owner reduces locally. On gloo (whose ``reduce_scatter`` is an all-reduce
underneath, twice the bytes) an all-to-all is cut into pieces of at most :data:`PIECE_BYTES` per peer; on NCCL
(and any other backend, :func:`backend_of`) it goes whole, and a plain reduce-scatter (:func:`reduce_scatter_rows`)
is NCCL's own ``reduce_scatter_single``, the collective FSDP uses. ``piece_bytes`` given (an int) cuts every
all-to-all on every backend.
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
"""gloo reaches a shaped link's line rate only with messages of at most about 1 MB (docs/design.md §9)."""
REDUCING_BACKENDS = ("nccl",)
"""Backends whose reduce-scatter moves the reduce-scatter volume (a ring): a plain exchange uses it."""


def backend_of(group: Optional[dist.ProcessGroup], device: torch.device) -> str:
    """The backend that runs a collective on ``device``'s tensors over ``group``: ``"gloo"``,
    ``"nccl"``, ... (a mixed group such as ``"cpu:gloo,cuda:nccl"`` gives the one for ``device``)."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name:
        per_device = dict(item.split(":", 1) for item in name.split(",") if ":" in item)
        return per_device.get(device.type, name)
    return name


def piece_columns(send: torch.Tensor, group: Optional[dist.ProcessGroup], piece_bytes: Optional[int]) -> int:
    """Columns of ``send`` per all-to-all piece: ``piece_bytes`` when given; else
    :data:`PIECE_BYTES` on gloo and the whole tensor on any other backend (one launch)."""
    if piece_bytes is None:
        if backend_of(group, send.device) != "gloo":
            return max(1, send.shape[1])
        piece_bytes = PIECE_BYTES
    return max(1, piece_bytes // max(1, send.element_size()))


@contextlib.contextmanager
def peer_errors() -> Iterator[None]:
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
            try:
                future = future() if future is not None else None
            except RuntimeError:  # e.g. gloo's reduce-scatter: no future; the arrival is then taken at the wait
                future = None
            if future is None:
                return
            future.add_done_callback(piece_done)

    def is_completed(self) -> bool:
        """Whether every piece has arrived (never blocks)."""
        return all(piece.work.is_completed() for piece in self.works)

    def wait(self) -> torch.Tensor:
        with peer_errors():
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
    with peer_errors():
        counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(counts, torch.full((1,), wanted.numel(), dtype=torch.int64, device=device), group=group)
        sizes = torch.cat(counts).tolist()  # one host read: the sizes below are data-dependent (not sync-free)
        padded = torch.zeros(max(sizes), dtype=torch.int64, device=device)
        padded[: wanted.numel()] = wanted
        lists = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(lists, padded, group=group)
        send = torch.cat([rows[r].index_select(0, lists[r][: sizes[r]]).float() for r in range(world)])
        recv = torch.empty(world * wanted.numel(), dtype=torch.float32, device=device)
        dist.all_to_all_single(
            recv, send, output_split_sizes=[wanted.numel()] * world, input_split_sizes=sizes, group=group
        )
    me = dist.get_rank(group)
    sent = (sum(sizes) - sizes[me]) * 4 + (world - 1) * (8 + 8 * max(sizes))
    return recv.view(world, wanted.numel()).sum(dim=0), sent


def all_to_all_rows(send: torch.Tensor, group: Optional[dist.ProcessGroup],
                    piece_bytes: Optional[int] = None) -> PendingExchange:
    """Start sending row ``s`` of ``send`` (``[N, C]``) to rank ``s`` of ``group``: in pieces on gloo,
    whole elsewhere (:func:`piece_columns`).

    Asynchronous: returns at once; compute can run while the bytes are on the wire.
    """
    world = send.shape[0]
    send = send.contiguous()
    recv = torch.empty_like(send)
    columns = send.shape[1]
    step = piece_columns(send, group, piece_bytes)
    works = []
    launched = time.perf_counter()
    with peer_errors():
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


def reduce_scatter_rows(send: torch.Tensor, group: Optional[dist.ProcessGroup],
                        piece_bytes: Optional[int] = None) -> PendingExchange:
    """Start a plain reduce-scatter of ``send`` (``[N, C]``, row ``j`` for rank ``j``).

    On a backend of :data:`REDUCING_BACKENDS` (NCCL) with ``piece_bytes`` unset: that backend's own
    ``reduce_scatter_single`` (SUM, in ``send``'s dtype, as FSDP reduces), and ``wait()`` returns the
    sum as one row ``[1, C]``. Elsewhere: :func:`all_to_all_rows` (``wait()`` returns every rank's row
    ``[N, C]``, which the caller sums in float32). Either way, summing the rows of what ``wait()``
    returns gives the reduced chunk, and ``sent_bytes`` is a ring reduce-scatter's volume."""
    if piece_bytes is not None or backend_of(group, send.device) not in REDUCING_BACKENDS:
        return all_to_all_rows(send, group, piece_bytes)
    world, columns = send.shape
    send = send.contiguous()
    recv = send.new_empty(1, columns)
    launched = time.perf_counter()
    with peer_errors():
        work = _reduce_scatter(recv.view(-1), send.view(-1), group=group, async_op=True)
    sent = (world - 1) * columns * send.element_size()
    return PendingExchange(recv, [_PieceWork(work, recv, recv, 0, columns)], sent, launched)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], async_op: bool):
    """``dist.reduce_scatter_single`` where torch has it (``reduce_scatter_tensor`` is its older, deprecated name)."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, input, group=group, async_op=async_op)


def premul_sum_factor(op: dist.ReduceOp) -> float | torch.Tensor:
    """A ``PREMUL_SUM`` op's factor: ``op.factor`` where torch has it (2.13 on), else its pickled state's (torch
    2.11's ``ReduceOp`` shows the factor nowhere else)."""
    return op.factor if hasattr(op, "factor") else op.__getstate__()[1]


def op_scale(op, world_size: int) -> float | torch.Tensor:
    """The factor FSDP's reduce op applies to the sum (SUM 1, AVG 1/N, PREMUL_SUM its factor).

    A PREMUL_SUM factor given as a tensor is returned as that tensor, never read on the host (on a
    GPU that read would wait for the device): :func:`scale_into` applies it on the device."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = premul_sum_factor(op)
        return factor if isinstance(factor, torch.Tensor) else float(factor)
    raise ValueError(f"TAGC reduces with SUM, AVG or PREMUL_SUM; got {op}")


def scale_into(output: torch.Tensor, summed: torch.Tensor, scale: float | torch.Tensor) -> None:
    """``output = summed * scale``, rounded to ``output``'s (reduce) dtype first and scaled in it: FSDP's own order.

    The scale divides as its float64 reciprocal, a Python float or a tensor alike (a tensor scale
    stays where it is: no host read)."""
    output.copy_(summed)
    if isinstance(scale, torch.Tensor):
        output.div_(torch.reciprocal(scale.detach().to(torch.float64)))
    elif scale != 1.0:
        output.div_(1.0 / scale)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
                      async_op: bool = False):
    """``dist.all_gather_single`` where torch has it (``all_gather_into_tensor`` is its older, deprecated name,
    the only one before torch 2.13)."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, input, group=group, async_op=async_op)


def plain_reduce_scatter(
    chunks: torch.Tensor, group: Optional[dist.ProcessGroup], piece_bytes: Optional[int] = None
) -> tuple[torch.Tensor, int]:
    """Sum over ranks of row ``rank`` of ``chunks`` (``[N, S]``), as float32: accumulated in float32 from
    the all-to-all's rows, or NCCL's reduce-scatter in ``chunks``' dtype (:func:`reduce_scatter_rows`).

    Returns ``(summed chunk, bytes this rank sent)``.
    """
    pending = reduce_scatter_rows(chunks, group, piece_bytes)
    received = pending.wait()
    return received.sum(dim=0, dtype=torch.float32), pending.sent_bytes
