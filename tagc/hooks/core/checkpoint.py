"""Checkpoints of a hook: its codec's state (this rank's residuals), the step, and the settings the
state's keys follow from, and the checks that a loaded state is used, never silently dropped.

Codecs key their state by the bucket part (``"<parameters>#<chunk>/part<k>"``), so a checkpoint
fits only a hook that plans the same parts: the same ``select`` (compared by what it selects),
ratios, ``min_part`` and ``min_compress_numel``. A mismatch is an error, raised as soon as it can
be seen: at the settings check once the hook is bound to its model (:meth:`Restored.check_select`),
else at the first compressed part the checkpoint holds no state for (:meth:`Restored.check_part`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from tagc.config import TAGCConfig
from tagc.hooks.codecs.codec import Codec
from tagc.hooks.codecs.feedback import MARK
from tagc.hooks.core.plan import Part
from tagc.hooks.core.state_keys import part_key


def part_order(key: str) -> tuple[str, int]:
    """Sorts part keys by bucket, then part number."""
    bucket, _, index = key.rpartition("/part")
    return bucket, int(index) if index.isdigit() else -1


def residuals_by_bucket(codec: Codec) -> dict[str, list[torch.Tensor]]:
    """The codec's error-feedback residuals, ``{bucket key: [one [N, part] tensor per part]}``."""
    grouped: dict[str, list[torch.Tensor]] = {}
    for key, value in sorted(getattr(codec, "residuals", {}).items(), key=lambda kv: part_order(kv[0])):
        grouped.setdefault(key.rsplit("/part", 1)[0], []).append(value)
    return grouped


def _prefix() -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"residual.rank{rank}."


def state_dict(codec: Codec, step: int, config: TAGCConfig, select_fingerprint: str) -> dict:
    """The codec's state (this rank's residuals, keyed by rank, bucket and part), the step counter,
    and the settings the keys follow from (``config``; ``select``: its fingerprint)."""
    prefix = _prefix()
    return {"step": step, "config": repr(config.fingerprint()), "select": select_fingerprint,
            **{f"{prefix}{key}": value for key, value in codec.state_dict().items()}}


@dataclasses.dataclass
class Restored:
    """A loaded checkpoint's bookkeeping: the bucket parts it holds codec state for, and the ``select``
    fingerprint it was written with."""

    parts: set[str]
    select: str | None

    def check_select(self, mine: str, bound: bool) -> None:
        """The checkpoint's ``select`` against the hook's (``mine``), where both are fingerprints of what they
        select and the hook is bound to its model (``bound``)."""
        saved = self.select
        if saved is None or not bound or "digest" not in saved or "digest" not in mine:
            return
        if saved != mine:
            raise ValueError(f"this checkpoint's residuals are keyed for select={saved!r}; the hook has "
                             f"select={mine!r}: build the hook with the select policy (and ratios) the checkpoint "
                             "was written with")

    def check_part(self, part: Part, plain: Codec, mine: Callable[[], str]) -> None:
        """The first steps after a load: a compressed part must find the checkpoint's state for it
        (``mine()``: the hook's ``select`` fingerprint, for the message)."""
        if part.codec is plain or part.key in self.parts:
            return
        held = sorted(self.parts)
        raise ValueError(
            f"this checkpoint's residuals are keyed for buckets {held[:4]}{' ...' if len(held) > 4 else ''}; this "
            f"hook compresses bucket part {part.key!r}, for which it holds none (checkpoint "
            f"select={self.select!r}, the hook has select={mine()!r}): select, its "
            "ratios, min_part or min_compress_numel differ from the hook that wrote it. Build the hook with those "
            "settings, or start without the checkpoint's residuals")


def restored_from(state: dict, config: TAGCConfig) -> Restored | None:
    """Check that ``state`` (:func:`state_dict`'s output) was written with ``config``; the bookkeeping of what
    it restores (``None``: it holds no codec state for this rank)."""
    if state.get("config") != repr(config.fingerprint()):
        raise ValueError(f"checkpoint was written with TAGC settings {state.get('config')}, this hook has {config}")
    parts = {part_key(key) for key in codec_state(state)}
    return Restored(parts, state.get("select")) if parts else None


def check_feedback(state: dict, codec: Codec) -> None:
    """A checkpoint of EF21 (:mod:`tagc.hooks.codecs.feedback`: entries ``<part>#ef21_...``) loaded into a hook of
    classic
    error feedback is an error: its residuals are EF21's shifts, not what a classic codec left unsent. (The other
    way round :meth:`tagc.hooks.codecs.feedback.EF21Codec.load_state_dict` raises.)"""
    if getattr(codec, "feedback", "classic") == "ef21":
        return
    written = sorted(key for key in codec_state(state) if MARK in key)
    if written:
        raise ValueError(f"this checkpoint was written with feedback='ef21' (entries such as {written[0]!r}); this "
                         "hook has feedback='classic': build it with feedback='ef21' to resume it")


def codec_state(state: dict) -> dict:
    """This rank's codec state in a checkpoint, keyed as the codec keys it."""
    prefix = _prefix()
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
