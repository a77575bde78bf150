"""What the one line does to a model: every parameter, compressed or plain, and the bytes per step.

``describe(hook, model)`` (also :meth:`TAGCHook.describe`; an example: docs/guide.md, "The hook") renders
:func:`describe_plan`'s rows as a table: every parameter of every FSDP unit with the codec its columns take once
warmed up, its ratio and its share of the unit's planned wire bytes; per unit, those bytes against a plain fp32
reduce-scatter's. Nothing here moves a byte: the plan is the engine's own (``hook.planner``), and the bytes are its
codecs' wire shapes counted as the engine counts what it launches, so they are what ``hook.stats()`` reports.

:func:`warn_if_weak_selection` is the engine's check at the end of the first step: a hook asked to
compress that compresses nothing, or only the embedding and the LM head, says so once
(``warnings.warn``), since the transformer blocks then cross the wire as plain as without it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc.hooks.core.hierarchy import Topology, group_ranks, layout
from tagc.hooks.core.plan import BucketPlan
from tagc.hooks.core.segment import Segment
from tagc.hooks.core.selection import is_embedding_or_head, non_attention_linear, select_none
from tagc.hooks.core.stats import plain_bytes

TAGCHook = Any
"""A :class:`tagc.hooks.core.engine.TAGCHook`, read by duck typing: the engine imports this module."""

@dataclasses.dataclass(frozen=True)
class ParameterRow:
    """One parameter in one unit's bucket, as the engine plans it once the warm-up is over."""

    bucket: str
    """The unit's label, as ``hook.stats()["units"]`` names it."""
    name: str
    shape: Optional[tuple[int, ...]]
    """The unsharded parameter's shape (``None`` where the wrapper does not say: FSDP1)."""
    numel: int
    """Its columns in every rank's chunk (its padded shard)."""
    compressed: bool
    """Whether the hook's codec takes it (else the plain columns' codec, ``plain=``)."""
    codec: str
    """The codec its columns take: ``hook(codec=...)``'s when selected, else the plain columns' (``plain=``)."""
    ratio: Optional[float]
    """Its compression ratio when compressed by a codec with one (``tagc``, ``topk``), else ``None``."""
    planned_bytes: Optional[float]
    """Its share of its parts' wire bytes per step, by columns (parts pack several parameters, so
    a share, not a count); ``None`` where the codec's wire is not fixed by the settings (``powersgd``)."""
    plain_bytes: int
    """What a plain fp32 reduce-scatter sends for these columns per step."""


@dataclasses.dataclass(frozen=True)
class BucketRow:
    """One unit's bucket: its planned wire bytes per step against plain."""

    bucket: str
    world: int
    """Ranks of the unit's group."""
    codec_world: int
    """Ranks of the codec's exchange (the hosts, when the exchange is hierarchical)."""
    chunk: int
    """Elements of every rank's chunk."""
    compressed_numel: int
    """Columns of the chunk the hook's codec takes (0: the bucket goes plain)."""
    planned_bytes: Optional[int]
    """Bytes this rank sends per step once the warm-up is over (``None``: not fixed by the settings, ``powersgd``;
    ``fallback="raw"``'s re-sends depend on the data and are not counted)."""
    plain_bytes: int
    """Bytes of a plain fp32 reduce-scatter of the bucket (the engine's ``plain_equivalent_bytes``)."""


@dataclasses.dataclass(frozen=True)
class Description:
    """:func:`describe_plan`'s answer: the hook's settings, a row per parameter and per bucket."""

    codec: str
    ratio: Optional[float]
    """The configured ratio, for codecs with one (``tagc``, ``topk``); a policy may give parameters their own."""
    plain: str
    select: str
    dense_steps: int
    parameters: tuple[ParameterRow, ...]
    buckets: tuple[BucketRow, ...]

    @property
    def planned_bytes(self) -> Optional[int]:
        """Bytes per step once warmed up, every bucket (``None`` when a codec's wire is not fixed)."""
        if any(b.planned_bytes is None for b in self.buckets):
            return None
        return sum(b.planned_bytes for b in self.buckets)

    @property
    def plain_bytes(self) -> int:
        return sum(b.plain_bytes for b in self.buckets)

    @property
    def compressed(self) -> tuple[str, ...]:
        """The names of the parameters the hook's codec takes."""
        return tuple(row.name for row in self.parameters if row.compressed)

    def __str__(self) -> str:
        return render(self)


def describe(hook: TAGCHook, model: nn.Module) -> str:
    """:func:`describe_plan`'s rows for ``model`` (a SimpleFSDP, FSDP2 or FSDP1 model) as a table (module
    docstring)."""
    return render(describe_plan(hook, model))


def describe_plan(hook: TAGCHook, model: nn.Module) -> Description:
    """The rows behind :func:`describe`: the engine's plan of every unit of ``model`` under ``hook``.

    Needs ``torch.distributed`` initialised (the units' groups give the world size); runs no
    collective, so any rank may call it at any time, before the first step or after."""
    parameters: list[ParameterRow] = []
    buckets: list[BucketRow] = []
    for label, segments, chunk, group, dtype, rows in _buckets(hook, model):
        world = dist.get_world_size(group)
        topo = _topology(hook, group)
        codec_world = topo.hosts if topo.hierarchical else world
        plan = hook.planner.make_plan(segments, chunk, codec_world)
        shares = _column_bytes(plan, chunk, codec_world, dtype)  # per column: its part's wire bytes per step
        step1 = topo.step1_bytes(chunk, dtype)
        planned = None if shares is None else step1 + sum(_part_bytes(p, codec_world, dtype) for p in plan.parts)
        compressed_numel = sum(p.numel for p in plan.parts if p.codec is not hook.plain)  # plain="bf16" compresses too
        buckets.append(BucketRow(label, world, codec_world, chunk, compressed_numel, planned,
                                 plain_bytes(world, chunk)))
        for segment, compressed, codec, ratio in _segment_codecs(hook, plan, segments):
            share = None if shares is None else float(shares[segment.start : segment.start + segment.numel].sum())
            for name, shape, numel in rows(segment):
                parameters.append(ParameterRow(label, name, shape, numel, compressed, codec, ratio,
                                               None if share is None else share * numel / max(1, segment.numel),
                                               plain_bytes(world, numel)))
    select = getattr(hook.settings.select, "__name__", repr(hook.settings.select))
    ratio = hook.settings.config.ratio if hook.codec.uses_ratio else None
    return Description(hook.codec.name, ratio, hook.settings.plain, select, hook.dense_steps,
                       tuple(parameters), tuple(buckets))


def warn_if_weak_selection(hook: TAGCHook) -> None:
    """The module docstring's warning, over the buckets ``hook`` has planned; silent when nothing was asked for
    (``codec="plain"`` or ``select="none"``, the fair baseline). The usual cause is a model whose linear layers the
    ``select`` policy does not recognise, or buckets below ``min_compress_numel``."""
    if not hook.codec.compresses or hook.settings.select is select_none:
        return
    planned = [(segments, plan) for (segments, _, _), plan in list(hook.planner.plans.items())]
    if not planned:
        return
    chosen = [s for segments, plan in planned
              for s, compressed, _, _ in _segment_codecs(hook, plan, segments) if compressed]
    see = "hook.describe(model) lists every parameter with its codec"
    if not chosen:
        select = getattr(hook.settings.select, "__name__", hook.settings.select)
        warnings.warn(f"TAGC compresses nothing: every one of the {len(planned)} buckets goes plain (codec "
                      f"{hook.codec.name!r}, select={select!r}, min_compress_numel="
                      f"{hook.settings.config.min_compress_numel}). Check that select recognises the model's linear "
                      f"layers, or lower min_compress_numel for small units; {see}.", stacklevel=2)
    elif all(_is_embedding_or_head(s) for s in chosen):
        names = sorted({s.name for s in chosen})
        warnings.warn(f"TAGC compresses only the embedding / LM head ({', '.join(names)}): every transformer block "
                      f"goes plain. Check that select recognises the blocks' linear layers, or that their units reach "
                      f"min_compress_numel={hook.settings.config.min_compress_numel}; {see}.", stacklevel=2)


def render(description: Description) -> str:
    """The table :func:`describe` prints."""
    d = description

    def size(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{value:,.0f}"

    def share(planned: Optional[float], plain: int) -> str:
        return "" if planned is None or not plain else f"{planned / plain:.1%}"

    at = "" if d.ratio is None else f" at ratio {d.ratio:g}"
    head = f"TAGC plan: codec {d.codec!r}{at} on the selected columns, plain columns {d.plain!r}, select {d.select!r}"
    warm = []
    if d.dense_steps:
        warm.append(f"the first {d.dense_steps} steps send every bucket plain (dense warm-up)")
    lines = [head, f"bytes per step once warmed up; {'; '.join(warm)}" if warm else "bytes per step"]
    table = [("unit", "parameter", "shape", "per rank", "codec", "ratio", "bytes/step", "plain", "")]
    for row in d.parameters:
        shape = "" if row.shape is None else "x".join(map(str, row.shape))
        ratio = "" if row.ratio is None else f"{row.ratio:g}"
        table.append((row.bucket, row.name, shape, f"{row.numel:,}", row.codec, ratio, size(row.planned_bytes),
                      f"{row.plain_bytes:,}", share(row.planned_bytes, row.plain_bytes)))
    table.append(("", "", "", "", "", "", "", "", ""))
    for b in d.buckets:
        table.append((b.bucket, f"unit: {b.compressed_numel:,} of {b.chunk:,} columns compressed", "", f"{b.chunk:,}",
                      "", "", size(b.planned_bytes), f"{b.plain_bytes:,}", share(b.planned_bytes, b.plain_bytes)))
    table.append(("all", f"{len(d.compressed)} of {len(d.parameters)} parameters compressed", "", "", "", "",
                  size(d.planned_bytes), f"{d.plain_bytes:,}", share(d.planned_bytes, d.plain_bytes)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    right = {3, 6, 7, 8}
    for row in table:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plumbing


def _is_embedding_or_head(segment: Segment) -> bool:
    """Whether a segment holds an embedding or an LM head and no block's linear layer. An FSDP1 unit is
    one segment named ``a+b+...``: the root unit of a model wrapped per block holds the embedding with
    the position embedding and the final norm, while a model wrapped as one unit holds every block too."""
    names = segment.name.split("+")
    module = segment.module if len(names) == 1 else None
    if not any(is_embedding_or_head(name, module) for name in names):
        return False
    return not any(non_attention_linear(name, None) and not is_embedding_or_head(name, module) for name in names)


def _part_bytes(part, world: int, dtype: torch.dtype) -> int:
    """What the engine counts for a part per step: ``(N - 1)`` rank rows of every wire tensor."""
    return (world - 1) * sum(wire.row_bytes for wire in part.codec.wire(part.numel, world, dtype))


def _column_bytes(plan: BucketPlan, chunk: int, world: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Per column of the chunk, its part's wire bytes per step spread evenly over the part's columns;
    ``None`` when a part's wire is not fixed by the settings (``powersgd``)."""
    shares = torch.zeros(chunk, dtype=torch.float64, device="cpu")  # a host-side report, never exchanged
    for part in plan.parts:
        try:
            part_bytes = _part_bytes(part, world, dtype)
        except NotImplementedError:
            return None
        shares[part.index(shares.device)] = part_bytes / max(1, part.numel)
    return shares


def _segment_codecs(hook: TAGCHook, plan: BucketPlan,
                    segments: Sequence[Segment]) -> Iterator[tuple[Segment, bool, str, Optional[float]]]:
    """Each segment with whether the hook's codec takes its columns in ``plan`` (the plain columns'
    part holds the hook's plain codec itself), that codec's name and the segment's ratio (compressed
    by a codec with a ratio)."""
    owner = torch.full((plan.chunk,), -1, dtype=torch.int64, device="cpu")  # a host-side report
    for i, part in enumerate(plan.parts):
        owner[part.index(owner.device)] = i
    for segment in segments:
        if segment.numel == 0:
            continue
        part = plan.parts[int(owner[segment.start])]
        compressed = part.codec is not hook.plain
        ratio = hook.planner.ratio_of(segment) if compressed and part.codec.uses_ratio else None
        yield segment, compressed, part.codec.name, ratio


def _topology(hook: TAGCHook, group) -> Topology:
    """The group's topology as the engine uses it: the hook's own once it has exchanged on the group;
    before that from the ranks alone (:func:`tagc.hooks.core.hierarchy.layout`), without making the subgroups
    (a collective): a hierarchical one is then marked by its group standing in for the cross group."""
    ranks = group_ranks(group)
    if ranks in hook.topologies:
        return hook.topologies[ranks]
    world = len(ranks)
    hosts, remote, regular = layout(ranks, dist.get_rank(), hook.settings.ranks_per_host, dist.get_world_size())
    hierarchical = hook.settings.hierarchy == "auto" and hosts > 1 and regular and world != hosts
    return Topology(world, hosts, remote, cross=group if hierarchical else None)


def _one_row(segment: Segment) -> list[tuple[str, Optional[tuple[int, ...]], int]]:
    return [(segment.name, segment.shape, segment.numel)]


def _buckets(hook: TAGCHook, model: nn.Module) -> Iterator[tuple]:
    """``(label, segments, chunk, group, dtype, rows)`` for every unit of ``model``, as its adapter
    hands them to the engine; ``rows(segment)`` lists the parameters a segment holds."""
    units = getattr(model, "_simple_fsdp_units", None)
    for unit in units or ():  # SimpleFSDP: the segments tagc.hooks.adapters.simple.bind hands the engine
        bucket = unit.bucket
        segments = tuple(Segment(entry.fqn, entry.start, entry.numel, module, shape=tuple(entry.shape))
                         for entry, module in zip(bucket.entries, unit.owner_modules, strict=True))
        dtype = bucket.reduce_dtype or bucket.param_dtype or unit.params[0].dtype
        yield unit.name, segments, bucket.chunk, bucket.group, dtype, _one_row
    if units is not None:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        yield from _fsdp1_buckets(hook, model)
        return
    found = list(_fsdp2_buckets(hook, model))
    if not found:
        raise ValueError("describe() found no FSDP unit: pass the model wrapped by fsdp_integration.simple_fsdp(...) "
                         "(SimpleFSDP), fully_shard(...) (FSDP2) or FullyShardedDataParallel (FSDP1)")
    yield from found


def _fsdp2_buckets(hook: TAGCHook, model: nn.Module) -> Iterator[tuple]:
    from torch.distributed.fsdp import FSDPModule

    from tagc.hooks.adapters.torch_fsdp2 import hsdp_mesh_info, mp_policy, packed_segments, param_groups

    names = {id(p): name for name, p in model.named_parameters()}  # a tied parameter: its first name
    paths = {id(module): name for name, module in model.named_modules()}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = param_groups(module)
        if not groups:
            continue
        group = groups[0]
        if hsdp_mesh_info(group) is not None:
            raise NotImplementedError("describe() plans flat FSDP2 units; an HSDP mesh reduces in two steps: read "
                                      "hook.stats() after a step for its bytes")
        # the segments TAGCReduceScatter.segments hands the engine; FSDP2 names its parameters at the root's lazy
        # init: before the first forward, from the model
        segments = packed_segments(list(group.fsdp_params), names)
        start = sum(segment.numel for segment in segments)
        mp = mp_policy(group)
        dtype = mp.reduce_dtype or mp.param_dtype or group.fsdp_params[0].sharded_param.dtype
        label = paths.get(id(module)) or "<root>"
        yield label, segments, start, group.mesh_info.shard_process_group, dtype, _one_row


def _fsdp1_buckets(hook: TAGCHook, model: nn.Module) -> Iterator[tuple]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from tagc.hooks.adapters.torch_fsdp1 import comm_hook_state, flat_param, param_entries, reduce_dtype, sharded_numel

    for unit in FSDP.fsdp_modules(model):
        flat = flat_param(unit)
        if flat is None:
            continue
        # the adapter's own per-unit state (tagc.hooks.adapters.fsdp1), set at registration
        state = comm_hook_state(unit)
        if getattr(state, "hook", None) is not hook:
            raise ValueError("describe an FSDP1 model after installing this hook on it: "
                             "tagc.register_comm_hook(model, hook)")
        prefix = state.prefix
        chunk = sharded_numel(flat)
        segments = state.segments(chunk)  # the one segment the FSDP1 adapter plans
        world = dist.get_world_size(unit.process_group)
        # FSDP1 splits the flat buffer by position: a parameter's columns per rank are about numel / world
        params = [(prefix + fqn, shape, -(-numel // world)) for fqn, shape, numel in param_entries(flat)]
        dtype = reduce_dtype(unit)

        def rows(segment: Segment, params=params) -> list[tuple[str, Optional[tuple[int, ...]], int]]:
            return params  # every parameter of the unit takes the unit's codec

        yield prefix.rstrip(".") or "<root>", segments, chunk, unit.process_group, dtype, rows
