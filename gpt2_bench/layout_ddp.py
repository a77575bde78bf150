"""The DDP layout: the model replicated on every rank, only the gradient crosses, as an all-reduce.

``--integration ddp``: DDP's own all-reduce (``--compression none --transport gloo``), torch's ``bf16_compress_hook``
or ``powerSGD_hook`` (``--torch-hook``), or our codec through ``tagc.ddp_hook``. :func:`wrap_ddp` returns the model
and a counter that answers what the training loop asks of a TAGC hook (``end_step``, ``stats``, ...). How each
counts its bytes, when ``powerSGD_hook`` starts, and checkpoints: docs/layout.md, "Training under DDP".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpt2_bench.config import TORCH_HOOKS, TrainConfig
from tagc.hooks.adapters.ddp import DDPHookState, bind_ddp, ring
from tagc.hooks.adapters.torch_ddp import has_rebuilt_buckets
from tagc.hooks.core.stats import ExchangeStats

MIN_COMPRESSION_RATE = 2
"""``PowerSGDState``'s default ``min_compression_rate``: a matrix is compressed only where it sends
fewer than half its elements."""


def powersgd_start_iter(dense_steps: int) -> int:
    """``start_powerSGD_iter`` for a dense warm-up of ``dense_steps``: the iteration ours start at
    (module docstring)."""
    return max(2, dense_steps + 1)


def wrap_ddp(
    model: nn.Module, cfg: TrainConfig, world: int, device: torch.device, hook: Any = None
) -> tuple[nn.Module, Any]:
    """``model`` (on ``device``) wrapped in ``DistributedDataParallel`` with the comm hook ``cfg`` asks for;
    ``hook`` is the ``tagc.hook(...)`` to install (``None``: DDP's own reduction, or torch's hook with
    ``cfg.torch_hook``). Returns ``(ddp_model, counter)``, the counter as module docstring."""
    device_ids = None if device.type != "cuda" else [device.index if device.index is not None
                                                     else torch.cuda.current_device()]
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    ranks_per_host = world // max(1, cfg.hosts)
    if cfg.torch_hook:
        from tagc.hooks.codecs.powersgd import DEFAULT_RANK

        rank = int(cfg.codec_options.get("rank", DEFAULT_RANK))  # our codec's default rank
        counter: Any = TorchHook(ddp, cfg.codec, rank, powersgd_start_iter(cfg.dense_steps), ranks_per_host == 1)
    elif hook is None:
        counter = DDPOwnReduction(ddp, ranks_per_host == 1)
    else:
        state, comm_hook = bind_ddp(ddp, hook)
        ddp.register_comm_hook(state, comm_hook)
        counter = OurHook(state, ranks_per_host == 1)
    return ddp, counter


# ----------------------------------------------------------------------------- counters


class _Counter:
    """Per-step and total :class:`ExchangeStats`, in the shape of :meth:`tagc.TAGCHook.stats`."""

    dense_steps = 0

    def __init__(self, one_rank_per_host: bool) -> None:
        self.one_rank_per_host = one_rank_per_host
        self.step_count = 0
        self._current = ExchangeStats()
        self.last_step = ExchangeStats()
        self.total = ExchangeStats()

    def _record(self, stats: ExchangeStats) -> None:
        if self.one_rank_per_host:  # every byte a rank sends goes to another host
            stats.inter_host_bytes = stats.wire_bytes
        self._current.add(stats)
        self.total.add(stats)

    def end_step(self) -> None:
        """Close a step (after ``optimizer.step()``)."""
        self.step_count += 1
        self.last_step, self._current = self._current, ExchangeStats()

    def stats(self) -> dict:
        return {"step": self.step_count, "last_step": self.last_step.as_dict(), "total": self.total.as_dict(),
                "units": []}

    def state_dict(self) -> dict:
        return {"step": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])

    def settle(self, forward_backward: Callable[[], None]) -> bool:
        """After a resume, before the first trained step: nothing here (DDP's own reduction and torch's stateless
        hooks reduce DDP's first iteration as every other). Returns whether it ran ``forward_backward``."""
        return False


class DDPOwnReduction(_Counter):
    """No comm hook: DDP's own fp32 all-reduce, ``ring(4 n)`` per rank and step, counted, not timed."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, one_rank_per_host: bool) -> None:
        super().__init__(one_rank_per_host)
        self.world = dist.get_world_size(ddp.process_group)
        self.numel = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)

    def end_step(self) -> None:
        nbytes = ring(4 * self.numel, self.world)
        self._record(ExchangeStats(buckets=1, wire_bytes=nbytes, plain_equivalent_bytes=nbytes))
        super().end_step()


class OurHook(_Counter):
    """``tagc.ddp_hook``'s state, read as the FSDP paths read a :class:`tagc.TAGCHook`."""

    def __init__(self, state: DDPHookState, one_rank_per_host: bool) -> None:
        super().__init__(one_rank_per_host)
        self.state = state

    @property
    def hook(self):
        """The :class:`tagc.TAGCHook` (the diagnostics read its exchange statistics)."""
        return self.state.hook

    @property
    def codec(self):
        """The hook's codec (the diagnostics read its error feedback kind and fading)."""
        return self.state.hook.codec

    @property
    def dense_steps(self) -> int:
        return self.state.hook.dense_steps

    @property
    def residuals(self) -> dict:
        return self.state.hook.residuals

    def follow_lr(self, optimizer) -> None:
        self.state.follow_lr(optimizer)

    def end_step(self) -> None:
        self.state.end_step()

    def stats(self) -> dict:
        stats = self.state.stats()
        if self.one_rank_per_host:
            for span in ("last_step", "total"):
                stats[span]["inter_host_bytes"] = stats[span]["wire_bytes"]
        return stats

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)

    def settle(self, forward_backward: Callable[[], None]) -> bool:
        """After a resume, before the first trained step: a forward and backward whose gradients the caller drops
        (``forward_backward``), as DDP's first iteration in this process. The hook reduces it as DDP does and
        counts no step; DDP then rebuilds its buckets in the order the uninterrupted run rebuilt them after its
        step 0, so the first trained step is compressed from the restored residuals as that run's was, and the
        resumed run repeats its losses bit for bit."""
        forward_backward()
        self.state.end_step()
        return True


class TorchHook(_Counter):
    """Torch's ``bf16_compress_hook`` or ``powerSGD_hook`` on ``ddp``, its bytes counted per bucket
    (module docstring)."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, codec: str, rank: int, start_iter: int,
                 one_rank_per_host: bool) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        super().__init__(one_rank_per_host)
        self.ddp = ddp
        self.codec = codec
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        if codec == "bf16":
            self.state: Any = self.group
            self._hook: Callable = default_hooks.bf16_compress_hook
        elif codec == "powersgd":
            self.state = powerSGD_hook.PowerSGDState(process_group=self.group, matrix_approximation_rank=rank,
                                                     start_powerSGD_iter=start_iter,
                                                     min_compression_rate=MIN_COMPRESSION_RATE)
            self._hook = powerSGD_hook.powerSGD_hook
            self.dense_steps = start_iter
        else:
            raise ValueError(f"torch ships DDP hooks for {TORCH_HOOKS}, not {codec!r}")
        self.serialize = codec == "powersgd" and dist.get_backend(self.group) == "gloo"
        """Whether a bucket's hook waits for the previous bucket's future first. ``powerSGD_hook`` issues its
        ``P`` and ``Q`` all-reduces from completion callbacks, which on gloo run on its worker threads: with
        several buckets the ranks can then issue collectives in different orders, and gloo pairs them by order
        (a mismatch aborts the run: "Received data size doesn't match expected size"). Waiting keeps every
        rank's order the bucket order, at the cost of the hook's overlap with the backward pass."""
        self._previous: torch.futures.Future | None = None
        ddp.register_comm_hook(self, TorchHook._call)

    @staticmethod
    def _call(
        counter, bucket
    ):  # no annotations: DDP checks them against its own objects, and this module's are strings
        self = counter
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if self.serialize and self._previous is not None:
            self._previous.wait()
        start = time.perf_counter()
        stats = ExchangeStats(buckets=1, plain_equivalent_bytes=ring(4 * bucket.buffer().numel(), self.world))
        if self.codec == "powersgd" and not has_rebuilt_buckets(self.ddp):
            # DDP's first iteration (and a resumed run's): buckets it rebuilds next, whose indices PowerSGD's
            # state must not key; reduced as powerSGD_hook reduces its vanilla iterations, and counted as one
            stats.wire_bytes = ring(4 * bucket.buffer().numel(), self.world)
            self.state.maybe_increase_iter(bucket)
            future = default_hooks.allreduce_hook(self.group, bucket)
        else:
            stats.wire_bytes = self.bucket_bytes(bucket)
            if stats.wire_bytes < stats.plain_equivalent_bytes:
                stats.compressed_buckets = 1
            future = self._hook(self.state, bucket)
        stats.compress_s = time.perf_counter() - start
        self._record(stats)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self._current.wire_s += time.perf_counter() - start
            self.total.wire_s += time.perf_counter() - start
            return fut.value()

        finished = future.then(done)
        self._previous = finished
        return finished

    def bucket_bytes(self, bucket: dist.GradBucket) -> int:
        """What the hook puts on the wire for ``bucket`` (this rank, ring volumes), read before it runs."""
        buffer = bucket.buffer()
        if self.codec == "bf16":
            return ring(2 * buffer.numel(), self.world)
        if self.state.iter < self.state.start_powerSGD_iter:
            return ring(4 * buffer.numel(), self.world)
        size = buffer.element_size()
        p, q, uncompressed = powersgd_sizes(
            [tuple(g.shape) for g in bucket.gradients()],
            self.state.matrix_approximation_rank,
            self.state.min_compression_rate,
        )
        return ring(size * uncompressed, self.world) + ring(size * p, self.world) + ring(size * q, self.world)


def powersgd_sizes(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE
                   ) -> tuple[int, int, int]:
    """``(P elements, Q elements, uncompressed elements)`` of ``powerSGD_hook`` on gradients of ``shapes``:
    each viewed as ``shape[0] x rest`` and compressed at ``min(rows, cols, rank)`` where
    ``(rows + cols) r min_compression_rate < rows cols`` (torch's documented rule)."""
    p = q = uncompressed = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        numel = 1
        for dim in shape:
            numel *= dim
        cols = numel // rows if rows else 0
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_compression_rate < rows * cols:
            p, q = p + rows * r, q + cols * r
        else:
            uncompressed += numel
    return p, q, uncompressed
