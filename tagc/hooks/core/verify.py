"""The cross-rank settings check: every rank of a group must exchange with the same settings.

Each rank's settings (:meth:`tagc.hooks.core.settings.HookSettings.agreed`) travel as pickled bytes in
tensors on the exchange's own device (NCCL takes no CPU tensor), by two all-gathers on the group:
no collective on another group or device. A difference is a clear error on every rank, naming
each setting and both values.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from tagc.hooks.core.transport import backend_of, peer_errors


def object_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the check puts its bytes when the caller names no device: the CPU on a gloo group, else this
    rank's current CUDA device."""
    if backend_of(group, torch.device("cpu")) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_settings(settings: dict, group: dist.ProcessGroup | None, device: torch.device) -> list[dict]:
    """Every rank's ``settings`` (by group rank), through two all-gathers of tensors on ``device``:
    the lengths, then the pickled bytes padded to the longest. Once per group: its host reads are
    the settings check's, not the exchange's."""
    world = dist.get_world_size(group)
    payload = pickle.dumps(settings)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    length = torch.full((1,), len(payload), dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    with peer_errors():
        dist.all_gather(lengths, length, group=group)
        sizes = torch.cat(lengths).cpu().tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[: len(payload)] = data
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(row[:size].cpu().numpy().tobytes()) for row, size in zip(gathered, sizes)]


def check_agreement(mine: dict, group: dist.ProcessGroup | None, device: torch.device | None = None) -> None:
    """Raise on every rank of ``group`` unless every rank's settings equal ``mine``."""
    everyone = all_gather_settings(mine, group, device if device is not None else object_device(group))
    for rank, theirs in enumerate(everyone):
        differ = [f"{name} (this rank {mine[name]!r}, rank {rank} {theirs.get(name)!r})" for name in mine
                  if theirs.get(name) != mine[name]]
        if differ:
            hint = (" (select is compared by what it selects: the policies pick different parameters or ratios)"
                    if any(d.startswith("select ") for d in differ) else "")
            raise ValueError(f"TAGC settings differ across ranks: {'; '.join(differ)}{hint}")
