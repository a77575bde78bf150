"""Sharded, resumable training checkpoints through torch's Distributed Checkpoint (DCP).

A checkpoint is one directory ``<dir>/step-<N>`` (``N`` = steps completed) holding, sharded
the way the model is: the model and optimizer (``torch.distributed.checkpoint.state_dict``,
so SimpleFSDP, FSDP2 and FSDP1 all save their DTensor / flat shards), the comm hook's state
(its step and every rank's error-feedback residuals) and, per rank, torch's RNG state (the
training windows follow from the step alone). It is written as ``step-<N>.partial`` and renamed by rank 0 once every
rank has finished writing, so :func:`latest` never picks a partial one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_COMPLETE = re.compile(r"^step-(\d+)$")


def complete(directory: str | Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint under ``directory`` as ``(steps done, path)``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        (int(m.group(1)), path) for path in directory.iterdir() if path.is_dir() and (m := _COMPLETE.match(path.name))
    )


def latest(directory: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``directory`` (``None`` if there is none)."""
    found = complete(directory)
    return found[-1][1] if found else None


def step_of(path: str | Path) -> int:
    """Steps completed when the checkpoint at ``path`` was written."""
    match = _COMPLETE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-<N>)")
    return int(match.group(1))


def _state(model, optimizer, hook) -> dict:
    rank = dist.get_rank()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, f"rng.rank{rank}": {"torch": torch.get_rng_state()}}
    if hook is not None:
        state["hook"] = hook.state_dict()
    return state


def save(
    directory: str | Path, steps_done: int, model, optimizer, hook, keep: int = 0
) -> Path:
    """Write ``step-<steps_done>`` under ``directory`` on every rank (a collective); returns its path.

    With ``keep`` > 0, only the newest ``keep`` complete checkpoints stay: older ones are removed
    once the new one is complete, so there is always one to resume from.
    """
    directory = Path(directory)
    final = directory / f"step-{steps_done}"
    partial = directory / f"step-{steps_done}.partial"
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while writing
    dist.barrier()
    dcp.save(_state(model, optimizer, hook), checkpoint_id=str(partial))
    dist.barrier()  # every rank's shard is on disk
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for _, old in complete(directory)[:-keep] if keep else ():
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _hook_entries(path: str | Path, hook_state: dict) -> dict:
    """``hook_state`` with an empty tensor for every entry of this rank's hook state in the
    checkpoint: a fresh hook has no residuals yet, and DCP loads only the keys it is given."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    entries = dict(hook_state)
    mine = f"hook.residual.rank{dist.get_rank()}."
    for key, meta in metadata.items():
        if key.startswith(mine) and isinstance(meta, TensorStorageMetadata) and key[5:] not in entries:
            entries[key[5:]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return entries


def load(path: str | Path, model, optimizer, hook) -> int:
    """Restore every piece saved by :func:`save` from ``path`` in place; returns the steps completed. The training
    windows follow from the step alone (:meth:`gpt2_bench.data.TokenData.train_batch`), so no sampler state is kept."""
    state = _state(model, optimizer, hook)
    if hook is not None:
        state["hook"] = _hook_entries(path, state["hook"])
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if hook is not None:
        hook.load_state_dict(state["hook"])
    rng = state[f"rng.rank{dist.get_rank()}"]
    torch.set_rng_state(rng["torch"])
    return step_of(path)
