"""The one-line entry points: ``tagc.hook(...)`` and ``tagc.register_comm_hook(model, hook)``."""

from __future__ import annotations

from typing import Union

import torch
import torch.nn as nn

from tagc.config import TAGCConfig
from tagc.hooks.engine import MIN_PART, TAGCHook
from tagc.hooks.selection import SelectPolicy


def hook(
    ratio: float = 10,
    index_bits: int = 1,
    sparsity: Union[float, str] = "auto",
    select: Union[str, SelectPolicy] = "non_attention_linear",
    *,
    codec: str = "tagc",
    overlap: bool = True,
    nonfinite: str = "propagate",
    residual_dtype: torch.dtype = torch.float32,
    min_part: int = MIN_PART,
    dense_steps: int = 0,
    **options,
) -> TAGCHook:
    """A TAGC comm hook.

    Args:
        ratio: count-sketch compression ratio (> 1).
        index_bits: 1 (exact OR of bitmaps) or 4 (rank counts, <= 15 ranks).
        sparsity: fraction of each chunk zeroed before encoding, or ``"auto"``.
        select: which parameters to compress: ``"non_attention_linear"`` (default),
            ``"all"``, ``"none"`` or a callable ``(param_fqn, module) -> bool``.
        codec: how the selected columns cross the wire: ``"tagc"`` (index + count sketch,
            error feedback) or ``"plain"`` (the fair uncompressed reduce-scatter, for baselines);
            the unselected columns always go plain (:mod:`tagc.hooks.codecs`).
        overlap: launch each bucket's exchange as soon as its gradient is packed and finish
            them all at the end of the backward pass (SimpleFSDP eager, FSDP2), decoding
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
            error feedback under Adam would spread over many steps. Steps are counted by
            :meth:`TAGCHook.end_step` (or a bucket seen twice).
        **options: the other :class:`TAGCConfig` fields (``lane``, ``seed``, ``fallback``,
            ``min_compress_numel``).
    """
    config = TAGCConfig(ratio=ratio, index_bits=index_bits, sparsity=sparsity, **options)
    return TAGCHook(config, select=select, nonfinite=nonfinite, residual_dtype=residual_dtype, min_part=min_part,
                    dense_steps=dense_steps, codec=codec, overlap=overlap)


def register_comm_hook(model: nn.Module, comm_hook: TAGCHook) -> nn.Module:
    """Install ``comm_hook`` on a SimpleFSDP, FSDP2 (``fully_shard``) or FSDP1 model; returns the model."""
    from tagc.hooks.fsdp2 import register_fsdp2

    if not isinstance(comm_hook, TAGCHook):
        raise TypeError(f"expected a hook from tagc.hook(...), got {type(comm_hook).__name__}")
    if getattr(model, "_simple_fsdp_units", None) is not None:
        return model.register_comm_hook(comm_hook)
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
            "fully_shard(...) (FSDP2) or FullyShardedDataParallel (FSDP1)"
        )
    return model
