"""Error feedback of another kind for every error-feedback codec: EF21 (``tagc.hook(feedback="ef21")``).

Classic error feedback (the codecs' own, docs/design.md §3.2) keeps the unsent rest in a residual and sends
it, many steps later, as one burst of what it accumulated (staleness).

**EF21** (Richtárik, Sokolov, Fatkhullin 2021, arXiv 2106.05203): rank ``i`` keeps a *shift*
``h_i``, its last gradient estimate the owners know, and sends the compressed *change*
``C(g_i - h_i)``; then ``h_i += C(g_i - h_i)``. The owner keeps ``H = sum_i h_i`` by adding the
decoded sum of the changes every step and hands the optimizer ``H``, dense: an element not
sent this step keeps its last known value instead of zero, so AdamW moves every element every
step, and a change is sent when the gradient moves, not when a sum piled up.

**Fading shifts**, ``feedback_decay=gamma`` (``< 1``): ``h_i = gamma h_i + C(g_i - gamma h_i)``, and every
owner fades ``H`` alike, so ``H`` stays the sum of the ``h_i``; an unsent element shrinks toward zero with a time
constant of ``1 / (1 - gamma)`` steps instead of holding a value AdamW would turn into full-size steps; that
constant is meant to be near how long an element waits between sends (about one over the kept fraction): fading much
faster leaves the compressed weights moving less than plain training's (docs/guide.md, "The hook").

How it is built, for every codec alike (:class:`EF21Codec` wraps the codec the settings make). The codecs'
residual holds ``-h_i`` between steps: the codec encodes ``x = g + r = g - h_i``, sends ``C(x)`` and leaves
``r = x - C(x)``; taking this step's ``g`` off gives ``-(h_i + C(x))``, the next step's ``-h_i``. The part's
decoded sum (over ranks, on this rank's columns) is added to ``H``, and ``H`` is returned. With ``feedback_decay``
the residual (each matrix's, for ``powersgd``) is multiplied by ``gamma`` before the encode (:meth:`EF21Codec.fade`)
and ``H`` before the sum is added. Where ``g`` is taken off is the codec's to say
(:attr:`~tagc.hooks.codecs.codec.Codec.feedback_at`): right after ``encode`` for the
:class:`~tagc.hooks.codecs.codec.ResidualCodec` codecs (``tagc``, ``topk``, ``sign``; ``tagc``'s ``fallback="raw"``
copy of ``g + r`` too, so the re-sent values stay what was sent), in ``decode`` for ``powersgd``, which turns each
matrix's residual into ``r_before - P Q^T / N`` from the ``M`` it kept; the columns it sends plain (biases) have no
error feedback under either kind and reach the optimizer as their plain sum, not through ``H``.

In an all-reduce form (DDP's, :mod:`tagc.hooks.core.allreduce`), where every rank decodes the whole part,
each part's shift is a :class:`SummedShift`: every rank keeps the whole part's ``H``.

NaN/Inf (the codecs' policy, :mod:`tagc.hooks.codecs.codec`, kept): a rank whose part is not finite
sends NaN and keeps its residual (its ``h_i``) and ``v_i`` as they were; the owner's part is NaN
(counted in ``nonfinite_parts``). ``H`` stays the sum of the ``h_i``: the owner sums the rows of
the ranks that sent finite values (what they added to their ``h_j``) into ``H``, and leaves
the poisoned rows out. ``powersgd`` keeps every rank's residual of a matrix whose summed ``Q`` is
not finite, and ``H`` keeps those columns as they were.

State, per part (the codec's keys): the residual (``-h_i``, ``[N, n]``, float32) and ``H`` (float32,
this rank's ``n`` columns; in DDP's ``gather`` form, where every rank decodes every replica's piece,
one per piece). Both in :meth:`EF21Codec.state_dict` (entries ``<part>#ef21_sum``), so a checkpoint resumes
bit for bit.

Caveats:

* The dense warm-up (``dense_steps``) does not go through the codec: EF21 starts from ``h_i = 0``
  and ``H = 0`` at the first compressed step, so that step's ``H`` is as sparse as classic error
  feedback's, and it fills in over about ``1 / density`` steps.
* ``H`` is the sum of every decoded change since the start: a decode error (``tagc``'s
  ``fallback="estimate"`` where peeling fails, rounding of bf16/fp16 sketch cells) stays in ``H``
  instead of being lost once. ``fallback="raw"`` removes the first.
* ``h_i`` is kept through float32 rounding (``(g - h) - g``): it drifts from the exact sum of what
  was sent by about one float32 rounding of ``|g|`` per step, a random walk. A bf16 residual would
  drift 65,000 times faster, so ``feedback="ef21"`` needs ``residual_dtype=torch.float32``.
* Memory: ``H`` adds the part's shard (``1 / N`` of the residual).
* DDP: TAGC under EF21 keeps DDP's all-reduce (``sketch``) form, where every rank keeps the whole
  part's ``H`` (:mod:`tagc.hooks.adapters.ddp`); the other codecs' buckets go ``rs+ag`` or ``gather`` (the
  engine's exchange), whose bytes differ from their classic all-reduce form's.
* A staleness measure that reads the residual cannot count a zero as "sent": the residual is
  ``-h_i``, zero only where the shift is. An element was sent when its residual changed
  (``gpt2_bench.diagnostics.StaleAges(changed=True)``, which the trainer's diagnostics pick under EF21).
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tagc.hooks.codecs.codec import Codec, Stacks, finite
from tagc.hooks.core import nonfinite
from tagc.hooks.core.allreduce import Shift
from tagc.hooks.core.state_keys import part_key
from tagc.hooks.core.stats import ExchangeStats

FEEDBACKS = ("classic", "ef21")
"""``tagc.hook(feedback=...)``: the codecs' own error feedback, or EF21 (:class:`EF21Codec`)."""
SUM = "#ef21_sum"
"""State entry suffix of a part's ``H``: ``<part>#ef21_sum``; in DDP's gather form ``<part>#ef21_sum<k>`` for piece
``k > 0``."""
MARK = "#ef21_"
"""What every EF21 state entry's name holds (:func:`tagc.hooks.core.checkpoint.check_feedback`)."""


def check_feedback(feedback: str, decay: float = 1.0) -> None:
    """Clear errors for ``feedback`` and ``feedback_decay`` (the codec is checked by :func:`with_feedback`)."""
    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback must be one of {FEEDBACKS}, got {feedback!r}")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        raise ValueError(f"feedback_decay must be a number in (0, 1] (1: EF21's shifts hold; gamma of "
                         f"h = gamma h + C(g - gamma h)), got {decay!r}")
    if decay != 1.0 and feedback != "ef21":
        raise ValueError(f"feedback_decay applies only with feedback='ef21' (it fades EF21's shifts), got "
                         f"feedback={feedback!r}")


def with_feedback(codec: Codec, feedback: str = "classic", decay: float = 1.0) -> Codec:
    """``codec`` itself (``"classic"``), or wrapped in :class:`EF21Codec` (``"ef21"``). A codec without error
    feedback (``plain``, ``bf16``, ``fp8``, ``int4``) is an error under ``"ef21"``: it keeps no residual to shift."""
    check_feedback(feedback, decay)
    return codec if feedback == "classic" else EF21Codec(codec, decay)


def _inner(attr: str, doc: Optional[str] = None) -> property:
    """A read-only property that is the wrapped codec's ``attr``, a method bound to it included
    (:attr:`EF21Codec.inner`)."""
    return property(lambda self: getattr(self.inner, attr), doc=doc)


class EF21Codec(Codec):
    """``inner`` with EF21 instead of its own error feedback (module docstring).

    Everything but the error feedback is ``inner``'s: its wire, rounds, planning, name; a copy at another
    ratio (:meth:`at_ratio`) shares ``inner``'s state and this wrapper's.
    """

    feedback = "ef21"
    summed_rows = False  # the rows are needed apart: a NaN rank's are left out of H

    def __init__(self, inner: Codec, decay: float = 1.0) -> None:
        if not inner.error_feedback:
            raise ValueError(f"feedback='ef21' shifts an error-feedback codec's residual; codec {inner.name!r} keeps "
                             "none (it sends every element every step): use feedback='classic' with it")
        if inner.feedback_at not in ("encode", "decode"):
            raise ValueError(f"feedback='ef21' does not know where codec {inner.name!r} finalises its residual: it "
                             "serves ResidualCodec codecs (whose encode leaves r = x - sent) and powersgd")
        if getattr(inner, "residual_dtype", torch.float32) != torch.float32:
            raise ValueError("feedback='ef21' keeps its shift in the residual through a float32 rounding per step; "
                             f"residual_dtype={inner.residual_dtype} would drift from the owners' sum: use "
                             "residual_dtype=torch.float32")
        check_feedback("ef21", decay)
        self.inner = inner
        self._fading = {"decay": float(decay)}  # one dict for every ratio's copy: set_decay reaches them all
        self.sums: dict[str, torch.Tensor] = {}
        """``H`` per part (and per DDP gather piece), keyed by its state entry name."""
        self._decodes: dict[str, int] = {}  # decodes of a part since its encode: the piece a gather form decodes
        self.stacks = Stacks(self.sums)  # the H of a batch of parts (decode_batch)

    @property
    def decay(self) -> float:
        """``gamma``: the factor every shift and ``H`` fade by at each step (1: they hold)."""
        return self._fading["decay"]

    def set_decay(self, decay: float) -> None:
        """Fade by ``decay`` from the next step on (in ``(0, 1]``), in this codec and its copies at other ratios.
        Every rank must set the same value before the same step (e.g. from the learning-rate schedule):
        the owners fade ``H`` by the value their ranks faded their shifts by."""
        check_feedback("ef21", decay)
        self._fading["decay"] = float(decay)

    # ------------------------------------------------------------------ what the inner codec is

    name = _inner("name")
    compresses = _inner("compresses")
    rounds = _inner("rounds")
    whole_segments = _inner("whole_segments")
    uses_ratio = _inner("uses_ratio")
    error_feedback = True
    residuals = _inner("residuals", "The inner codec's residuals: ``-h_i`` per part "
                       "(:attr:`tagc.hooks.core.engine.TAGCHook.residuals`).")
    config = _inner("config", "The inner codec's :class:`~tagc.config.TAGCConfig` (``tagc``, ``topk``).")
    wire_codec = _inner("wire_codec")
    # the inner codec's methods as they are (its parts' feedback this wrapper's: :meth:`summed_shift`)
    all_reduce_form = _inner("all_reduce_form")
    prepare = _inner("prepare")
    wire = _inner("wire")
    next_round = _inner("next_round")
    overlappable = _inner("overlappable")
    traceable = _inner("traceable")

    def summed_shift(self, key: str, numel: int) -> "SummedShift":
        return SummedShift(self, key, numel)

    def at_ratio(self, ratio: float) -> "EF21Codec":
        inner = self.inner.at_ratio(ratio)
        if inner is self.inner:
            return self
        clone = copy.copy(self)  # the same dicts: one state for every ratio
        clone.inner = inner
        return clone

    # ------------------------------------------------------------------ encode: g - h_i, then h_i += what was sent

    @property
    def batchable(self) -> bool:
        return self.inner.batchable and self.inner.feedback_at == "encode"

    def encode_batch(self, grad, keys, group):
        """:meth:`encode` of parts side by side: the inner codec's residuals as one tensor, faded and shifted once."""
        if not self.batchable:
            (key,) = keys
            return self.encode(grad, key, group)
        self._decodes.update(dict.fromkeys(keys, 0))
        residual = self.inner.residual_batch(keys, grad)  # [N, P, n]: h = 0 where new, as fade() finds it
        if self.decay != 1.0:
            residual.mul_(self.decay)
        wires = self.inner.encode_batch(grad, keys, group)
        residual.sub_(nonfinite.zero_unless_finite(grad.reshape(residual.shape))[1])  # a non-finite part: nothing
        return wires

    def encode(self, grad: torch.Tensor, key: str, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
        self._decodes[key] = 0
        self.fade(key)
        wires = self.inner.encode_batch(grad, (key,), group)
        if self.inner.feedback_at == "encode":
            # a non-finite part: the codec kept the residual as it was, so nothing is subtracted either
            taken = torch.where(finite(grad), grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
            self.inner.subtract_input(key, taken)
        return wires

    def fade(self, key: str) -> None:
        """``feedback_decay``: ``h_i *= decay`` on every residual of part ``key`` (each holds ``-h_i``), before this
        step's change is chosen against it; the owners fade ``H`` alike in :meth:`add_decoded`. A no-op at 1."""
        if self.decay == 1.0:
            return
        for name in self.inner.residual_keys(key):
            residual = self.inner.residuals.get(name)  # none yet at the first step: h = 0
            if residual is not None:
                residual.mul_(self.decay)

    # ------------------------------------------------------------------ decode: H += the decoded sum; H out

    def decode(self, received: Sequence[torch.Tensor], numel: int, key: str, group: Optional[dist.ProcessGroup],
               stats: ExchangeStats) -> torch.Tensor:
        if self.inner.feedback_at == "encode":
            return self.decode_batch(received, numel, (key,), group, stats)
        name = self._sum_names((key,))[0]
        values, shifted = self.inner.decode_shifted(received, numel, key, group, stats)
        total = self._faded_sum(name, numel, values.device)
        total.copy_(torch.where(shifted, total + values, total))
        return torch.where(shifted, total, values)  # the plain columns (and a non-finite matrix) as decoded

    def decode_batch(self, received, numel, keys, group, stats):
        """``H += `` the decoded sums of the parts ``keys`` (``feedback_at == "encode"``), every ``H`` a view of one
        tensor per batch; a part some rank sent NaN/Inf for is NaN (its rows left out of ``H``)."""
        if self.inner.feedback_at == "decode":
            (key,) = keys
            return self.decode(received, numel, key, group, stats)
        parts = len(keys)
        rows_ok, clean = _finite_rows(received, parts)
        decoded = self.inner.decode_batch(clean, numel, keys, group, stats).view(parts, numel)
        ok = nonfinite.finite_parts(decoded[None])
        total = self.stacks.stack(self._sum_names(keys), (parts, numel), 0, torch.float32, decoded.device)
        if self.decay != 1.0:
            total.mul_(self.decay)  # as every rank faded its h_j (zeros where new)
        total.add_(torch.where(ok[:, None], decoded, 0.0))
        ok = ok & rows_ok
        stats.count_nonfinite(ok)
        return torch.where(ok[:, None], total, torch.nan).view(-1)

    def _sum_names(self, keys: Sequence[str]) -> list[str]:
        """The state entries of the parts' ``H`` this decode adds to: a DDP gather form decodes every replica's
        piece after one encode, each into an ``H`` of its own."""
        names = []
        for key in keys:
            piece = self._decodes.get(key, 0)
            self._decodes[key] = piece + 1
            names.append(key + SUM + (str(piece) if piece else ""))
        return names

    def add_decoded(self, name: str, numel: int, decoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``H`` (state entry ``name``) plus the decoded sum of the ranks' changes where it is finite (what the ranks
        that sent finite values added to their ``h_j``); returns ``(H, ok)``, ``ok`` whether ``decoded`` is finite."""
        ok = finite(decoded)
        total = self._faded_sum(name, numel, decoded.device)
        total.add_(torch.where(ok, decoded, 0.0))
        return total, ok

    def _faded_sum(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """``H`` of state entry ``name`` (zeros the first time), faded by ``decay`` as every rank faded its ``h_j``
        in :meth:`fade`, ready for this step's decoded sum."""
        total = self.sums.get(name)
        if total is None:
            total = self.sums[name] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif self.decay != 1.0:
            total.mul_(self.decay)
        return total

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.inner.state_dict(), **self.sums}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The inner codec's entries to it, ``H`` here (copies, into the same dict). A checkpoint of classic error
        feedback (residuals without ``H``) is an error: its residuals mean another thing, and EF21 is never
        restarted from zeros silently."""

        mine = {key: value for key, value in state.items() if MARK in key}
        theirs = {key: value for key, value in state.items() if MARK not in key}
        sums = {key: value for key, value in mine.items() if SUM in key}
        unknown = sorted(set(mine) - set(sums))
        if unknown:
            raise ValueError(f"unknown EF21 state entries {unknown[:4]}")
        parts = {part_key(key) for key in theirs}
        missing = sorted(parts - {part_key(key) for key in sums})
        if missing:
            raise ValueError(f"this checkpoint holds residuals without EF21's sums for parts {missing[:4]}: it was "
                             "written with feedback='classic', whose residuals are not EF21's shifts. Build the hook "
                             "with feedback='classic' to resume it (and, for a checkpoint of tagc.hook() before "
                             "2026-11-26, the paper's wire it ran: ratio=10, plain='fp32', positions='bitmap', "
                             "value_dtype='float32')")
        self.inner.load_state_dict(theirs)
        self.sums.clear()
        self.sums.update({key: value.clone() for key, value in sums.items()})
        self.stacks.held.clear()


class SummedShift(Shift):
    """EF21 on one part of an all-reduce form (:mod:`tagc.hooks.core.allreduce`): as :meth:`EF21Codec.encode` on the
    residual, and every rank adds the decoded sum to its copy of ``H`` (replicated). A part whose summed table is not
    finite leaves every shift and ``H`` as they were (the sum cannot tell which rank's change was finite), and comes
    out NaN, as the codecs' policy has it."""

    def __init__(self, ef21: EF21Codec, key: str, numel: int) -> None:
        self.ef21, self.key, self.numel = ef21, key, numel
        self.residual = self.before = None

    def feed(self, grad: torch.Tensor) -> torch.Tensor:
        self.ef21.fade(self.key)
        return grad

    def hold(self, residual: torch.Tensor) -> None:
        self.residual, self.before = residual, residual.clone()

    def sent(self, taken: torch.Tensor) -> None:
        self.residual.sub_(taken)  # -(h_i + sent), as EF21Codec.encode leaves it

    def decoded(self, decoded: torch.Tensor) -> torch.Tensor:
        total, ok = self.ef21.add_decoded(self.key + SUM, self.numel, decoded)
        self.residual.copy_(torch.where(ok, self.residual, self.before))
        return torch.where(ok, total, torch.nan)


def _finite_rows(received: Sequence[torch.Tensor], parts: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(ok, clean)`` of ``parts`` parts side by side: ``ok`` (bool ``[P]``) whether every rank's row of every
    floating wire tensor is finite, per part; ``clean`` the wires with a part's floating rows of a rank that sent a
    NaN/Inf zeroed (its part adds nothing at the owner: a rank with a non-finite part keeps its residual and sends
    nothing else, e.g. an all-zero index)."""
    floating = [wire.reshape(wire.shape[0], parts, -1) for wire in received if wire.is_floating_point()]
    if not floating:
        return torch.ones(parts, dtype=torch.bool, device=received[0].device), list(received)
    rows = torch.stack([nonfinite.finite_rows(wire) for wire in floating]).all(dim=0)  # [N, P]
    clean = [torch.where(rows[..., None], wire.reshape(rows.shape + (-1,)), torch.zeros((), dtype=wire.dtype,
                         device=wire.device)).view(wire.shape) if wire.is_floating_point() else wire
             for wire in received]
    return rows.all(dim=0), clean


class LearningRateFading:
    """EF21's fading from an optimizer's learning rate (``hook.follow_lr``): ``1 - (1 - decay) * lr / peak``.

    ``decay`` at the peak rate; as the rate decays the shifts hold longer, toward 1 (no fading) at a rate of 0.
    ``lr`` is the first parameter group's; ``peak`` is ``peak_lr``, else the group's ``initial_lr`` (torch's
    schedulers set it), else the largest rate read so far."""

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float, peak_lr: float | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or not optimizer.param_groups:
            raise TypeError(f"follow_lr reads a torch.optim.Optimizer's learning rate, got {type(optimizer).__name__}")
        if peak_lr is not None and (isinstance(peak_lr, bool) or not isinstance(peak_lr, (int, float))
                                    or not 0 < peak_lr < float("inf")):
            raise ValueError(f"peak_lr must be a positive number (the schedule's largest rate), got {peak_lr!r}")
        check_feedback("ef21", decay)
        self.optimizer = optimizer
        self.base = float(decay)
        self.peak_lr = peak_lr
        self._largest = 0.0
        self.read()  # a rate held as a tensor fails here, not in the backward

    def read(self) -> float:
        """The first parameter group's rate now, as a Python number (never a device read)."""
        lr = self.optimizer.param_groups[0]["lr"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:  # a tensor is neither
            raise ValueError(f"follow_lr reads the learning rate as a number and got {lr!r} (a rate held in a "
                             "tensor would cost a device read each step): call hook.set_feedback_decay("
                             "1 - (1 - feedback_decay) * lr / peak_lr) yourself between steps instead")
        return float(lr)

    def decay(self) -> float:
        """This step's fading, in ``[decay, 1]``."""
        lr = self.read()
        self._largest = max(self._largest, lr)
        peak = self.peak_lr or self.optimizer.param_groups[0].get("initial_lr") or self._largest
        if not peak:
            return 1.0  # a rate of 0 from the start: nothing moves, so nothing needs fading
        return 1.0 - (1.0 - self.base) * min(1.0, lr / peak)
