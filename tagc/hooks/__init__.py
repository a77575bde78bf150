"""The compressed exchange in three rooms: ``core`` (the engine), ``codecs`` (what crosses the wire) and
``adapters`` (DDP, FSDP1, FSDP2, SimpleFSDP, HSDP). ``core`` imports no adapter; the adapters register what the
engine calls into (:data:`tagc.hooks.core.engine.ADAPTERS`) when :mod:`tagc.hooks.adapters` is imported."""

from tagc.hooks.core.engine import Segment, TAGCHook, op_scale
from tagc.hooks.core.selection import POLICIES, non_attention_linear, resolve_policy, select_all, select_none

__all__ = ["POLICIES", "Segment", "TAGCHook", "non_attention_linear", "op_scale", "resolve_policy", "select_all",
           "select_none"]
