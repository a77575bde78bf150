"""The compressed reduce-scatter and its FSDP adapters."""

from tagc.hooks.engine import Segment, TAGCHook, op_scale
from tagc.hooks.selection import POLICIES, non_attention_linear, resolve_policy, select_all, select_none

__all__ = [
    "POLICIES",
    "Segment",
    "TAGCHook",
    "non_attention_linear",
    "op_scale",
    "resolve_policy",
    "select_all",
    "select_none",
]
