"""The one-line entry points: ``tagc.hook(...)``, ``tagc.register_comm_hook(model, hook)`` and, for
users who call DDP's own ``register_comm_hook``, ``tagc.ddp_hook(model, ...)``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tagc.hooks.ddp import DDPHookState, bind_ddp, register_ddp
from tagc.hooks.engine import TAGCHook
from tagc.hooks.selection import SelectPolicy
from tagc.hooks.settings import MIN_PART, HookSettings


def hook(
    ratio: float | None = None,
    index_bits: int | None = None,
    sparsity: float | str | None = None,
    select: str | SelectPolicy = "non_attention_linear",
    *,
    codec: str = "tagc",
    overlap: bool = True,
    nonfinite: str = "propagate",
    residual_dtype: torch.dtype = torch.float32,
    min_part: int = MIN_PART,
    dense_steps: int | None = None,
    plain: str | None = None,
    hierarchy: str = "auto",
    ranks_per_host: int | None = None,
    ramp_steps: int = 0,
    piece_bytes: int | None = None,
    side_stream: bool = True,
    feedback: str | None = None,
    feedback_momentum: float = 0.0,
    feedback_decay: float | None = None,
    **options,
) -> TAGCHook:
    """A TAGC comm hook.

    With no arguments, codec ``tagc`` runs the setting that stayed closest to plain training's loss at no more
    bytes than ``int4``'s (:data:`~tagc.hooks.settings.RECOMMENDED`): ratio 4.5, the other columns in
    ``int4``, EF21 fading by 0.9 a step, coded positions and float16 cells. Every argument given overrides
    its part of it; ``tagc.hook(ratio=10, plain="fp32", feedback="classic", positions="bitmap",
    value_dtype="float32")`` is the TAGC paper's codec. ``codec="topk"`` likewise runs the list at the same bytes
    that held plain's loss (ratio 1.2, float8 values, the rest as for ``tagc``).

    Args:
        ratio: count-sketch compression ratio (> 1; default 4.5 for ``tagc``, 1.2 for ``topk``). Like ``index_bits``,
            ``sparsity`` and the other :class:`~tagc.config.TAGCConfig` fields, it applies to the codecs
            that select with TAGC's threshold (``tagc``, ``topk``) and is an error elsewhere.
        index_bits: 1 (exact OR of bitmaps, default) or 4 (rank counts, <= 15 ranks).
        sparsity: fraction of each chunk zeroed before encoding, or ``"auto"`` (default).
        select: which parameters to compress: ``"non_attention_linear"`` (default),
            ``"all"``, ``"none"`` or a callable ``(param_fqn, module) -> bool``; for ``tagc`` and
            ``topk`` the callable may return a parameter's own ratio instead of ``True``
            (:func:`tagc.hooks.selection.ratio_for`, e.g. a denser embedding).
        codec: how the selected columns cross the wire, one of
            :func:`tagc.hooks.codec_registry.codec_names`: ``"tagc"`` (index + count sketch,
            error feedback), ``"plain"`` (the fair uncompressed reduce-scatter, for baselines),
            or a peer codec; the unselected columns always go plain (:mod:`tagc.hooks.codecs`).
        overlap: launch each bucket's exchange as soon as its gradient is packed and finish
            them all at the end of the backward pass (SimpleFSDP eager, FSDP2, DDP), decoding
            whatever has arrived while later blocks compute; ``False`` blocks per bucket.
        nonfinite: ``"propagate"`` (NaN/Inf reach the owners: plain columns where they are, a
            compressed part NaN as a whole; residuals are never poisoned) or ``"raise"``
            (``FloatingPointError`` on every rank once the exchange is complete). The same in
            eager and compiled models.
        residual_dtype: error-feedback residual dtype (``torch.bfloat16`` halves its memory).
        min_part: compressed columns are cut into pipeline parts of at least this many
            elements (part ``k+1`` is compressed while part ``k`` is on the wire).
        dense_steps: send everything uncompressed for the first this many steps (a dense
            warm-up, as in Deep Gradient Compression): early gradients carry the large,
            dense moves (e.g. every vocabulary row of the LM head) that sparsification with
            error feedback under Adam would spread over many steps. ``None`` (default):
            :data:`~tagc.hooks.settings.DENSE_STEPS` (10) for the error-feedback codecs (``tagc``,
            ``topk``, ``sign``, ``powersgd``), 0 for the others; 0: compress from the first step.
            Steps are counted by :meth:`TAGCHook.end_step` (or a bucket seen twice). A compiled
            model runs the warm-up's exchange as one opaque op per block, then recompiles once
            with the traced halves (its graph guards on :attr:`TAGCHook.warmed_up`).
        ramp_steps: after the warm-up, climb to the ratio over this many steps in
            :data:`~tagc.hooks.plan.RAMP_STAGES` geometric stages (DGC's density ramp; ratio 10:
            1.58, 2.51, 3.98, 6.31, then 10). ``tagc`` and ``topk`` only; counted in the warm-up
            a compiled model runs as one opaque exchange per block.
        plain: the codec of the columns that are not sparsified (those ``select`` leaves alone,
            and everything during ``dense_steps``): ``"fp32"`` (as they are),
            ``"bf16"``, ``"fp8"`` or ``"int4"`` (:mod:`tagc.hooks.quantized`, summed in float32
            at the owner). ``"bf16"`` halves them at bf16 rounding. ``None`` (default): ``"int4"`` for ``tagc``
            and ``topk``, ``"fp32"`` for the others.
        hierarchy: ``"auto"`` (default): when the group spans more than one host, reduce plainly
            inside each host first and compress only the exchange across hosts, planned for the
            number of hosts (:mod:`tagc.hooks.hierarchy`); ``"flat"``: one compressed exchange
            over the whole group. Nothing changes on one host. FSDP2 HSDP meshes are always
            reduced in two steps (:mod:`tagc.hooks.fsdp2`).
        ranks_per_host: ranks per host, numbered host-major as torchrun does (global rank ``r``
            on host ``r // ranks_per_host``); must divide the world size. ``None`` (default):
            torchrun's ``LOCAL_WORLD_SIZE`` when set, else one host.
        piece_bytes: bytes per peer of each all-to-all piece. ``None`` (default): pieces of
            :data:`~tagc.hooks.transport.PIECE_BYTES` on gloo, whole collectives on NCCL (whose plain
            columns go through its own reduce-scatter); a number cuts pieces on every backend.
        side_stream: on CUDA, run the codec work on a side stream of the hook's, so the caller's
            stream (the rest of the backward pass) runs on while parts are encoded and sent
            (:mod:`tagc.hooks.eager`); ``False``: on the caller's stream. No effect on the CPU.
        feedback: ``"classic"`` (the codec's own error feedback, the unsent rest waits as a
            residual) or ``"ef21"`` (each rank sends the compressed change of its gradient against the
            last estimate the owners know, and the owners hand the optimizer the running sum, dense, so
            an unsent element keeps its last known value instead of zero; :mod:`tagc.hooks.feedback`).
            Error-feedback codecs only, with ``residual_dtype=torch.float32``. ``None`` (default): ``"ef21"``
            for ``tagc`` and ``topk``, ``"classic"`` for the others.
        feedback_momentum: with ``"ef21"``, the ``beta`` of each rank's running average of its gradient,
            compressed instead of the gradient (EF21-SGDM); 0 (default): none.
        feedback_decay: with ``"ef21"``, the factor ``gamma`` every rank's shift (and the owners' sum) fades
            by before each step's change is chosen against it: ``h = gamma h + C(g - gamma h)``. An element
            that is not sent then fades toward zero instead of holding its last value, which AdamW would
            otherwise turn into full-size steps in one direction for as long as it waits. Its time constant
            ``1 / (1 - gamma)`` steps is meant to be near how long an element waits between sends (about one
            over the kept fraction): fading much faster leaves the compressed weights moving less than plain
            training's. 1: EF21 as published. ``None`` (default): 0.9 when ``tagc`` or ``topk`` runs EF21, else 1.
        **options: the other :class:`~tagc.config.TAGCConfig` fields (``lane``, ``seed``, ``fallback``,
            ``min_compress_numel``), or the codec's own options
            (:data:`tagc.hooks.codec_registry.SPECS`, e.g. ``block`` for ``int4``). The lean
            wire of ``tagc`` and ``topk``: ``positions="coded"`` (each rank's support Elias-Fano
            coded, ~0.25 instead of 1 bit per element at ratio 10; :mod:`tagc.sketch.positions`)
            and ``value_dtype=torch.bfloat16`` (sketch cells or listed values in bf16; ``"float16"`` and
            ``"float8"`` are scaled per block, and float8 suits ``topk`` only: a warning says why); ``tagc`` defaults
            to ``positions="coded"`` (``"bitmap"`` with ``index_bits=4``) and ``value_dtype="float16"``,
            ``topk`` to ``positions="coded"`` and ``value_dtype="float8"``;
            ``positions="bitmap"`` and ``value_dtype="float32"`` are the paper's wire.
    """
    settings = HookSettings.from_arguments(
        ratio, index_bits, sparsity, codec=codec, select=select, nonfinite=nonfinite, residual_dtype=residual_dtype,
        min_part=min_part, dense_steps=dense_steps, overlap=overlap, plain=plain, hierarchy=hierarchy,
        ranks_per_host=ranks_per_host, ramp_steps=ramp_steps, piece_bytes=piece_bytes, side_stream=side_stream,
        feedback=feedback, feedback_momentum=feedback_momentum, feedback_decay=feedback_decay, **options)
    return TAGCHook(settings)


def ddp_hook(model: nn.parallel.DistributedDataParallel, *args, group: dist.ProcessGroup | None = None,
             **settings) -> tuple[DDPHookState, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``: every codec of
    :func:`hook` as a DDP comm hook (:mod:`tagc.hooks.ddp`)::

        ddp_model.register_comm_hook(*tagc.ddp_hook(ddp_model))

    ``model``: the DDP model, so that ``select`` sees parameter names, error feedback is keyed by
    them, and the hook knows when DDP's buckets are final (its first iteration is reduced as DDP
    reduces it). ``group``: the group DDP reduces over (default: the DDP model's,
    else the default group). ``*args, **settings``: exactly :func:`hook`'s, checked by it.
    ``tagc.register_comm_hook(ddp_model, tagc.hook(...))`` does the same in one call. ``state``
    has ``state_dict``/``load_state_dict``/``stats``/``end_step``; ``state.hook`` is the
    :class:`TAGCHook`."""
    return bind_ddp(model, hook(*args, **settings), group)


def register_comm_hook(model: nn.Module, comm_hook: TAGCHook) -> nn.Module:
    """Install ``comm_hook`` on a SimpleFSDP, FSDP2 (``fully_shard``), FSDP1 or DDP
    (``DistributedDataParallel``: :mod:`tagc.hooks.ddp`) model; returns the model."""
    from tagc.hooks.fsdp2 import register_fsdp2

    if not isinstance(comm_hook, TAGCHook):
        raise TypeError(f"expected a hook from tagc.hook(...), got {type(comm_hook).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        register_ddp(model, comm_hook)
        return model
    if getattr(model, "_simple_fsdp_units", None) is not None:  # SimpleFSDP: through its reduce-scatter hook point
        from tagc.hooks.simple import bind

        return model.register_comm_hook(functools.partial(bind, comm_hook))
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        FullyShardedDataParallel = ()
    if isinstance(model, FullyShardedDataParallel):
        from tagc.hooks.fsdp1 import register_fsdp1

        register_fsdp1(model, comm_hook)
        return model
    if register_fsdp2(model, comm_hook) == 0:
        raise ValueError(
            "no FSDP module found: wrap the model first with fsdp_integration.simple_fsdp(...) (SimpleFSDP), "
            "fully_shard(...) (FSDP2), FullyShardedDataParallel (FSDP1) or DistributedDataParallel (DDP)"
        )
    return model
