"""Planning: how a bucket's columns are cut into parts, and which codec each part goes through.

A bucket is the packed reduce-scatter input of ``chunk`` columns, each parameter a
:class:`~tagc.hooks.core.segment.Segment` of them. The columns the ``select`` policy leaves alone (and
the padding) go to the plain codec as one part; the selected ones go to the hook's codec, grouped
by their ratio and cut into parts of at least ``min_part`` elements, so part ``k+1`` is encoded
while part ``k`` is on the wire. A codec that can batch takes its parts of one size in one call
(:attr:`BucketPlan.batches`: a ratio group's parts have two sizes at most), so a bucket's host work follows
its batches, not its parts. Plans are device-free and cached (:class:`Planner`): the same settings give the
same plan, on every rank, at every step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch

from tagc.hooks.codecs.codec import Codec, Wire
from tagc.hooks.core.segment import Segment
from tagc.hooks.core.settings import HookSettings

BATCHING = True
"""Whether plans batch their parts (:attr:`BucketPlan.batches`); ``False`` (tests only): one part per codec call."""


@dataclasses.dataclass
class Part:
    """Columns of a bucket that one codec encodes together."""

    columns: slice | torch.Tensor
    numel: int
    codec: Codec
    key: str  # the codec's state key: the bucket's parameters and the part's place
    _on_device: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def index(self, device: torch.device) -> slice | torch.Tensor:
        """``columns`` to index a tensor on ``device``: a slice, or the column list copied there once
        (a host index on a GPU tensor would be copied to the device at every use)."""
        if isinstance(self.columns, slice):
            return self.columns
        if device not in self._on_device:
            self._on_device[device] = self.columns.to(device)
        return self._on_device[device]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The part's columns of ``x`` (its last dimension): a view for a slice, else one ``index_select``, which
        a CPU runs several times faster than the same advanced indexing."""
        columns = self.index(x.device)
        return x[..., columns] if isinstance(columns, slice) else x.index_select(-1, columns)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """``out[columns] = values`` for a 1-D ``out`` (``index_copy_`` for a column list)."""
        columns = self.index(out.device)
        if isinstance(columns, slice):
            out[columns] = values
        else:
            out.index_copy_(0, columns, values.to(out.dtype))


@dataclasses.dataclass
class Batch(Part):
    """Parts that one codec call encodes and one exchange per wire tensor carries (issue 61): parts of one codec
    object and one size whose codec can batch (:attr:`Codec.batchable`), so that a bucket's host work follows its
    batches, not its parts. ``columns``: every member's, in order; ``numel``: theirs together. A batch of one part
    is the per-part case."""

    parts: tuple[Part, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(part.key for part in self.parts)

    def wire(self, world: int, dtype: torch.dtype) -> list[Wire]:
        """The batch's wire tensors: each of a member's, its columns once per member (members side by side)."""
        member = self.parts[0]
        return [Wire(w.columns * len(self.parts), w.dtype) for w in self.codec.wire(member.numel, world, dtype)]


def batch(parts: Sequence[Part]) -> Batch:
    """``parts`` (one codec, one size) as a :class:`Batch` keyed by its first part. Its columns: one part's own,
    else every part's in one list (a host tensor of 8 bytes per column, copied to the device once by
    :meth:`Part.index`; a slice where they follow one another)."""
    first = parts[0]
    columns = first.columns
    if len(parts) > 1:
        columns = _selector(torch.cat([torch.arange(p.columns.start, p.columns.stop, device="cpu")
                                       if isinstance(p.columns, slice) else p.columns for p in parts]))
    return Batch(columns, sum(p.numel for p in parts), first.codec, first.key, parts=tuple(parts))


@dataclasses.dataclass
class BucketPlan:
    """A bucket's parts, and the parameters it compresses."""

    key: str
    chunk: int
    parts: list[Part]  # the plain columns first (if any), then the compressed parts
    chosen: tuple[Segment, ...] = ()  # the compressed parameters
    batches: list[Batch] = dataclasses.field(init=False, repr=False, compare=False)
    """The parts as :class:`Batch` es, in order of their first parts: each codec that can batch takes its parts of
    one size in one call, every other part goes alone. Made with the plan (not under a compiler's fake tensors, which
    may ask a cached plan for its wire), the same on every rank."""

    def __post_init__(self) -> None:
        groups: dict = {}
        for part in self.parts:
            same = (id(part.codec), part.numel) if BATCHING and part.codec.batchable else id(part)
            groups.setdefault(same, []).append(part)
        self.batches = [batch(members) for members in groups.values()]

    @property
    def compressed_parts(self) -> list[Part]:
        return [part for part in self.parts if part.codec.compresses]

    @property
    def compressed(self) -> bool:
        return bool(self.compressed_parts)


def _columns(segments: Sequence[Segment]) -> torch.Tensor | None:
    """A plan's column list, on the host: plans are device-free; :meth:`Part.index` puts it on the device."""
    if not segments:
        return None
    return torch.cat([torch.arange(s.start, s.start + s.numel, device="cpu") for s in segments])


def _selector(columns: torch.Tensor) -> slice | torch.Tensor:
    """A slice where ``columns`` are consecutive (indexing by it is a view, not a gather)."""
    if columns.numel() > 1 and not bool((columns[1:] - columns[:-1] == 1).all()):
        return columns
    return slice(int(columns[0]), int(columns[-1]) + 1)


def ratio_of(segment: Segment, settings: HookSettings, codec: Codec) -> float | None:
    """``None``: the segment goes plain; else its compression ratio: the config's, or the one
    the ``select`` policy gave it (a number)."""
    chosen = settings.select(segment.name, segment.module) if segment.selected is None else segment.selected
    if isinstance(chosen, bool) or chosen is None:
        return settings.config.ratio if chosen else None
    if not isinstance(chosen, (int, float)) or not 1.0 < float(chosen) < float("inf"):
        raise ValueError(f"select returned {chosen!r} for {segment.name!r}: return True/False, or a compression "
                         "ratio > 1")
    if not codec.uses_ratio:
        raise ValueError(f"select returned the ratio {chosen!r} for {segment.name!r}, but codec {codec.name!r} has no "
                         "ratio: return True/False (per-parameter ratios apply to tagc and topk)")
    return float(chosen)


def make_plan(segments: tuple[Segment, ...], chunk: int, world: int, settings: HookSettings, codec: Codec, plain: Codec,
              codec_at: Callable[[float], Codec]) -> BucketPlan:
    """The plan of a bucket of ``chunk`` columns over ``world`` ranks. ``codec_at(ratio)``: the codec for the
    parts of that ratio."""
    covered = sum(s.numel for s in segments)
    if covered > chunk:
        raise ValueError(f"segments cover {covered} elements of a {chunk}-element chunk")
    tail = [Segment("<padding>", covered, chunk - covered)] if covered < chunk else []
    ratios = {}
    if codec.compresses:
        ratios = {s: ratio for s in segments if (ratio := ratio_of(s, settings, codec)) is not None}
    chosen = list(ratios)
    compressed = sum(s.numel for s in chosen)
    if compressed < max(1, settings.config.min_compress_numel):
        chosen, compressed = [], 0
    rest = [s for s in segments if s not in chosen] + tail
    key = f"{'|'.join(s.name for s in chosen) or '|'.join(s.name for s in segments)}#{chunk}"
    parts = []
    plain_columns = _columns(rest)
    if plain_columns is not None:
        parts.append(Part(_selector(plain_columns), plain_columns.numel(), plain, f"{key}/plain"))
    if chosen and codec.whole_segments:  # one part: every selected parameter, whole
        at = [0] + list(itertools.accumulate(s.numel for s in chosen))
        codec.prepare(f"{key}/part0", [dataclasses.replace(s, start=a) for s, a in zip(chosen, at)], world)
        parts.append(Part(_selector(_columns(chosen)), compressed, codec, f"{key}/part0"))
    elif chosen:  # the config's ratio first, then each other ratio in order of first use
        numbered = itertools.count()
        for ratio in dict.fromkeys(sorted(ratios.values(), key=lambda r: r != settings.config.ratio)):
            group = [s for s in chosen if ratios[s] == ratio]
            columns = _columns(group)
            numel = columns.numel()
            n_parts = max(1, numel // settings.min_part)
            bounds = [round(i * numel / n_parts) for i in range(n_parts + 1)]
            part_codec = codec_at(ratio)
            for a, b in itertools.pairwise(bounds):
                parts.append(Part(_selector(columns[a:b]), b - a, part_codec, f"{key}/part{next(numbered)}"))
    return BucketPlan(key=key, chunk=chunk, parts=parts, chosen=tuple(chosen))


class Planner:
    """Plans of buckets, cached by ``(segments, chunk, world)``, and the codec at each ratio (one object per
    ratio, all sharing the codec's state)."""

    def __init__(self, settings: HookSettings, codec: Codec, plain: Codec) -> None:
        self.settings, self.codec, self.plain = settings, codec, plain
        self.plans: dict[tuple, BucketPlan] = {}
        self._codecs_at: dict[float, Codec] = {}

    def plan(self, segments: tuple[Segment, ...], chunk: int, world: int) -> BucketPlan:
        """The bucket's plan, made once."""
        cache_key = (segments, chunk, world)
        if cache_key not in self.plans:
            self.plans[cache_key] = self.make_plan(segments, chunk, world)
        return self.plans[cache_key]

    def make_plan(self, segments: tuple[Segment, ...], chunk: int, world: int) -> BucketPlan:
        """A plan, not cached (:func:`make_plan`), its parts' codecs from :meth:`codec_at`."""
        return make_plan(segments, chunk, world, self.settings, self.codec, self.plain, self.codec_at)

    def plain_plan(self, key: str, chunk: int) -> BucketPlan:
        """The whole bucket through the plain codec (a dense warm-up step), under the steady plan's ``key``."""
        return BucketPlan(key=key, chunk=chunk, parts=[Part(slice(0, chunk), chunk, self.plain, f"{key}/plain")])

    def codec_at(self, ratio: float) -> Codec:
        """The hook's codec at ``ratio`` (one object per ratio, all sharing the codec's state)."""
        if ratio not in self._codecs_at:
            self._codecs_at[ratio] = self.codec.at_ratio(ratio)
        return self._codecs_at[ratio]

    def ratio_of(self, segment: Segment) -> float | None:
        """:func:`ratio_of` under this planner's settings and codec."""
        return ratio_of(segment, self.settings, self.codec)
