"""Codecs: how one part of a bucket's columns crosses the wire and is summed at its owner.

The exchange engine (:mod:`tagc.hooks.core.engine`) cuts every bucket into *parts* (a set of
columns of the packed ``[N, S]`` reduce-scatter input, row ``j`` for rank ``j``) and hands
each part to a codec:

* :meth:`Codec.wire` - the tensors a part sends, as ``(columns per rank row, dtype)``. They
  follow from the part's size and the settings alone, so a compiled graph can hold them and
  the bytes on the wire are known before anything is sent;
* :meth:`Codec.encode` - this rank's rows ``[N, n]`` -> those wire tensors (row ``j`` goes
  to rank ``j``), updating any error-feedback state the codec owns;
* :meth:`Codec.decode` - every rank's row for this rank (``[N, columns]`` per wire tensor,
  row ``j`` from rank ``j``) -> the float32 sum over ranks of this rank's ``n`` columns.

A codec may take more than one exchange round (``rounds > 1``, e.g. PowerSGD's P then Q):
:meth:`Codec.next_round` turns what round ``k-1`` received into round ``k``'s wire tensors,
and :meth:`Codec.decode` gets what the last round received. Such a codec is not traceable.
A codec that needs whole parameters (their shapes) sets ``whole_segments``: the engine then
gives it one part per bucket holding every selected segment, and tells it their places once,
through :meth:`Codec.prepare`.

A codec whose wire adds up offers an all-reduce form (:meth:`Codec.all_reduce_form`,
:mod:`tagc.hooks.core.allreduce`): where every rank needs the whole average (DDP), its tensors are summed
by all-reduces and every rank decodes the sum. TAGC's (:class:`SummedSketch`) is below; the plain
codecs say in which dtype their columns add up (:attr:`Codec.summed_dtype`).

The same calls serve the eager pipeline and the traced halves of a compiled model: the same values, bytes and
NaN/Inf behaviour (the policy, every codec alike: docs/design.md §6).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from tagc.config import TAGCConfig
from tagc.hooks.core import nonfinite
from tagc.hooks.core.allreduce import AllReduceForm, Collectives, Shift, ring
from tagc.hooks.core.stats import ExchangeStats
from tagc.hooks.core.transport import backend_of, gather_from_owners, op_scale, scale_into
from tagc.kernels.dispatch import code_index, decode, union_index
from tagc.sketch import SketchLayout
from tagc.sketch.codec import UnrecoveredError
from tagc.sketch.index import merge_index
from tagc.sketch.kept_list import finite  # the one NaN/Inf check; the codecs import it from here
from tagc.sketch.positions import bitmap_blocks, coded_row_bytes, low_bits
from tagc.sketch.sparsify import capacity

if TYPE_CHECKING:
    from tagc.hooks.core.segment import Segment

VALUE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float8": torch.float8_e4m3fn}
"""What ``value_dtype`` may be for the sparse codecs (their values or sketch cells on the wire): a name, or the
torch dtype; ``float16`` and ``float8`` travel with a power-of-two float32 scale per :data:`SCALE_BLOCK` values
(:func:`pack_values`; their bits and bytes: docs/design.md §7, the lean wire)."""
SCALE_BLOCK = 1024
"""Values sharing one scale (``float16``, ``float8``)."""
_SCALED_TOP = {torch.float16: 15, torch.float8_e4m3fn: 8}
"""Scaled dtypes -> ``t``: a block whose absmax is below ``2**e`` is divided by ``2**(e - t)``, so its
values stay below ``2**t``, within the dtype's finite range (float16: 65,504; e4m3: 448)."""
_SMALLEST_NORMAL_EXPONENT = -126
"""float32's smallest normal is ``2**-126``: no scale goes below it."""
POSITIONS = ("bitmap", "coded")
"""How TAGC sends each rank's support: the 1-bit (or 4-bit) index, or Elias-Fano coded
(:mod:`tagc.sketch.positions`)."""


def resolve_value_dtype(value_dtype) -> torch.dtype:
    """``value_dtype`` (a name of :data:`VALUE_DTYPES` or the torch dtype) as a torch dtype, or a clear error."""
    dtype = VALUE_DTYPES.get(value_dtype) if isinstance(value_dtype, str) else value_dtype
    if dtype not in VALUE_DTYPES.values():
        raise ValueError(f"value_dtype must be one of {tuple(VALUE_DTYPES)} (or the torch dtype), got {value_dtype!r}")
    return dtype


def value_wires(columns: int, dtype: torch.dtype) -> tuple["Wire", ...]:
    """The wire tensors of ``columns`` values per rank row in ``dtype`` (float16, float8: and their
    scales; float8 travels as its bytes, uint8, which every backend carries)."""
    if dtype in _SCALED_TOP:
        stored = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
        return Wire(columns, stored), Wire(-(-columns // SCALE_BLOCK), torch.float32)
    return (Wire(columns, dtype),)


def pack_values(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """float32 ``[R, C]`` -> the wire tensors of :func:`value_wires`. float16, float8: each block of
    :data:`SCALE_BLOCK` divided by a power of two (:data:`_SCALED_TOP`; exact), then rounded to the
    nearest value of the dtype (11 significant bits, or 4); a block of float32 denormals gets the
    scale ``2**-126`` and comes back within a denormal's step of itself. A block holding a NaN/Inf
    gets a NaN scale (float8 has no Inf), so it unpacks as NaN."""
    if dtype not in _SCALED_TOP:
        return (values.to(dtype),)
    rows, columns = values.shape
    blocks = -(-columns // SCALE_BLOCK)
    padded = torch.nn.functional.pad(values, (0, blocks * SCALE_BLOCK - columns)).view(rows, blocks, SCALE_BLOCK)
    absmax = padded.abs().amax(dim=2)
    _, exponent = torch.frexp(absmax)
    # at least float32's smallest normal: a block of denormals would otherwise get a scale of 0 (and come back NaN)
    shift = (exponent - _SCALED_TOP[dtype]).clamp_(min=_SMALLEST_NORMAL_EXPONENT)
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), shift)
    if dtype == torch.float16:
        return (padded / scale[..., None]).to(torch.float16).view(rows, -1)[:, :columns], scale
    scale = torch.where(torch.isfinite(absmax), scale, torch.nan)
    codes = (padded / scale[..., None]).to(dtype).view(torch.uint8).view(rows, -1)[:, :columns]
    return codes, scale


def unpack_values(wires: Sequence[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`pack_values` (float32 ``[R, C]``)."""
    if len(wires) == 1:
        return wires[0].float()
    scaled, scale = wires
    if scaled.dtype == torch.uint8:
        scaled = scaled.contiguous().view(torch.float8_e4m3fn)
    rows, columns = scaled.shape
    blocks = scale.shape[1]
    padded = torch.nn.functional.pad(scaled.float(), (0, blocks * SCALE_BLOCK - columns))
    padded = padded.view(rows, blocks, SCALE_BLOCK)
    return (padded * scale[..., None]).view(rows, -1)[:, :columns]


def check_wire_options(positions: str, value_dtype, allowed: tuple[str, ...]) -> torch.dtype:
    """Clear errors for the wire options the sparse codecs (``tagc``, ``topk``) share; the value dtype."""
    if positions not in allowed:
        raise ValueError(f"positions must be one of {allowed}, got {positions!r}")
    return resolve_value_dtype(value_dtype)


def with_ratio(codec: "Codec", ratio: float) -> "Codec":
    """A shallow copy of ``codec`` with ``config.ratio`` replaced: its dicts (residuals and the
    like) are the same objects, so every ratio of one codec keeps one error-feedback state."""
    clone = copy.copy(codec)
    clone.config = codec.config.replace(ratio=ratio)
    return clone


@dataclasses.dataclass(frozen=True)
class Wire:
    """One tensor a part sends: ``columns`` per rank row, of ``dtype``."""

    columns: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.columns * self.dtype.itemsize


class Codec:
    """The interface every codec implements (see the module docstring)."""

    name: str = ""
    compresses: bool = False
    """Whether the hook's ``select`` policy routes columns to this codec (the plain codec takes the rest)."""
    rounds: int = 1
    """Exchange rounds per part: round 0 sends :meth:`encode`'s tensors, round ``k`` :meth:`next_round`'s."""
    whole_segments: bool = False
    """Whether a part must hold whole segments (one part per bucket, described by :meth:`prepare`)."""
    uses_ratio: bool = False
    """Whether the codec has a compression ratio (:meth:`at_ratio`): per-parameter ratios."""
    error_feedback: bool = False
    """Whether the codec keeps what it did not send (a residual): the codecs a dense warm-up serves."""
    summed_rows: bool = False
    """Whether :meth:`decode` only sums the rows it receives (one wire tensor, float32 accumulation), so
    the transport may sum them on the wire instead: NCCL's reduce-scatter (:mod:`tagc.hooks.core.transport`)
    hands decode the one summed row."""
    summed_dtype: Optional[torch.dtype] = None
    """For a codec of the plain columns: the dtype an all-reduce may sum its columns in, where a codec's
    all-reduce form carries them beside its own (:meth:`all_reduce_form`); ``None``: its wire does not add
    up (blockwise scales)."""
    feedback: str = "classic"
    """The error feedback: ``"classic"`` (the codec's own, or none) or ``"ef21"``
    (:mod:`tagc.hooks.codecs.feedback`)."""
    feedback_at: Optional[str] = None
    """Where the codec's error feedback makes a part's residual final, for EF21 to shift it
    (:mod:`tagc.hooks.codecs.feedback`): ``"encode"`` (``r = x - sent`` once :meth:`encode` returns; EF21 calls
    :meth:`subtract_input`), ``"decode"`` (EF21 calls :meth:`decode_shifted`); ``None``: no residual EF21 knows."""
    batchable: bool = False
    """Whether :meth:`encode_batch` and :meth:`decode_batch` take several parts of one size in one call (a plan
    batches such parts: :attr:`tagc.hooks.core.plan.BucketPlan.batches`)."""

    @property
    def wire_codec(self) -> "Codec":
        """The codec whose tensors cross the wire: this one, or the one a wrapper (EF21) wraps."""
        return self

    def prepare(self, key: str, segments: Sequence["Segment"], world: int) -> None:
        """For ``whole_segments`` codecs, once per part when a bucket is planned: the part's
        segments, their ``start`` relative to the part's columns."""

    def next_round(self, round: int, received: Sequence[torch.Tensor], key: str,
                   group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
        """Round ``round``'s wire tensors (row ``j`` to rank ``j``) from what round ``round - 1``
        received (row ``j`` from rank ``j``). Only for ``rounds > 1``."""
        raise NotImplementedError

    def wire(self, numel: int, world: int, dtype: torch.dtype) -> tuple[Wire, ...]:
        raise NotImplementedError

    def encode(self, grad: torch.Tensor, key: str, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def decode(self, received: Sequence[torch.Tensor], numel: int, key: str, group: Optional[dist.ProcessGroup],
               stats: ExchangeStats) -> torch.Tensor:
        raise NotImplementedError

    def encode_batch(self, grad: torch.Tensor, keys: Sequence[str],
                     group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
        """:meth:`encode` of the parts ``keys`` of one size at once: ``grad`` is ``[N, P * n]``, the parts side by
        side; each wire tensor holds every part's, side by side (``[N, P * columns]``), as :meth:`encode` would
        send them. Only a :attr:`batchable` codec takes more than one part."""
        (key,) = keys
        return self.encode(grad, key, group)

    def decode_batch(self, received: Sequence[torch.Tensor], numel: int, keys: Sequence[str],
                     group: Optional[dist.ProcessGroup], stats: ExchangeStats) -> torch.Tensor:
        """:meth:`decode` of what :meth:`encode_batch` sent: every part's ``numel`` summed values, side by side."""
        (key,) = keys
        return self.decode(received, numel, key, group, stats)

    def overlappable(self) -> bool:
        """Whether :meth:`decode` is free of collectives, so it may run whenever its bytes arrived."""
        return True

    def traceable(self) -> bool:
        """Whether encode/decode keep the wire shapes of :meth:`wire` (a compiled graph can hold them);
        a codec with ``rounds > 1`` is not."""
        return self.rounds == 1

    def at_ratio(self, ratio: float) -> "Codec":
        """This codec at another compression ratio, sharing its state (the residuals): per-parameter
        ratios (:mod:`tagc.hooks.core.plan`). A codec without a ratio is itself."""
        return self

    def all_reduce_form(self, parts: Sequence, plain: Sequence, plain_codec: "Codec") -> Optional[AllReduceForm]:
        """This codec's all-reduce form of a bucket (:mod:`tagc.hooks.core.allreduce`), or ``None`` (the default): none,
        or none under these settings. ``parts``: the bucket's compressed parts (:class:`tagc.hooks.core.plan.Part`, each
        with this codec at its ratio), ``plain``: its plain parts, sent through ``plain_codec``. Decided from the
        settings alone, the same on every rank."""
        return None

    def summed_shift(self, key: str, numel: int) -> Shift:
        """The error feedback of part ``key`` (``numel`` columns) in an all-reduce form: the codec's own (nothing
        to shift); EF21's keeps its ``H`` there."""
        return Shift()

    def residual_keys(self, key: str) -> list[str]:
        """The residual entries of part ``key`` (EF21 fades them): the part's own."""
        return [key]

    def subtract_input(self, key: str, taken: torch.Tensor) -> None:
        """``feedback_at == "encode"``: take this step's input ``taken`` off what the codec keeps of part ``key``
        after its encode (EF21 turns ``r = x - sent`` into ``-(h + sent)`` so)."""
        raise NotImplementedError

    def decode_shifted(self, received: Sequence[torch.Tensor], numel: int, key: str,
                       group: Optional[dist.ProcessGroup], stats: ExchangeStats) -> tuple[torch.Tensor, torch.Tensor]:
        """``feedback_at == "decode"``: :meth:`decode`, leaving each residual it makes as its value before this
        step minus what was sent (EF21's shift), where the sum is finite; ``(values, shifted)``, ``shifted`` whether
        each of the ``numel`` columns is one whose sum EF21 adds to its ``H`` (the others go as decoded)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class Stacks:
    """Per-part tensors of ``store`` (a codec's state dict, keyed by part) that a batch of parts uses as one: each
    part's entry is a view of one tensor per batch, so the checkpoint keeps its keys and shapes. Entries that are not
    (yet) views of it, a loaded checkpoint's, are copied into a new one once and the keys re-pointed."""

    def __init__(self, store: dict[str, torch.Tensor]) -> None:
        self.store = store
        self.held: dict[tuple[str, ...], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def stack(self, keys: Sequence[str], shape: Sequence[int], dim: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """The tensor of ``shape`` whose slices along ``dim`` are the entries ``keys`` (zeros where there is none;
        ``dtype``, or the existing entries')."""
        keys = tuple(keys)
        whole, views = self.held.get(keys, (None, ()))
        if whole is not None and all(self.store.get(key) is view for key, view in zip(keys, views)):
            return whole
        old = [self.store.get(key) for key in keys]
        if len(keys) == 1 and old[0] is not None and old[0].is_contiguous():  # one part: its own tensor, as it is
            whole, views = old[0].unsqueeze(dim), (old[0],)
        else:
            dtype = next((entry.dtype for entry in old if entry is not None), dtype)
            whole = torch.zeros(shape, dtype=dtype, device=device)
            for i, entry in enumerate(old):
                if entry is not None:
                    whole.select(dim, i).copy_(entry)
            views = whole.unbind(dim)
            self.store.update(zip(keys, views))
        self.held[keys] = (whole, views)
        return whole


class ResidualCodec(Codec):
    """A codec with error feedback whose state is one residual per part: ``[N, n]`` (the part's rows), in
    ``residual_dtype``, zeros until the part is first encoded. ``residuals`` is one dict for the codec's lifetime
    (:meth:`load_state_dict` updates it in place), so copies at other ratios (:func:`with_ratio`) see the state."""

    error_feedback = True
    feedback_at = "encode"

    def __init__(self, residual_dtype: torch.dtype = torch.float32) -> None:
        self.residual_dtype = residual_dtype
        self.residuals: dict[str, torch.Tensor] = {}
        self.stacks = Stacks(self.residuals)
        """The residuals of the parts :meth:`encode_batch` takes together (:meth:`residual_batch`)."""

    def residual(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """Part ``key``'s residual; zeros of ``grad``'s shape, on its device, the first time."""
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = torch.zeros(grad.shape, dtype=self.residual_dtype, device=grad.device)
        return residual

    def residual_batch(self, keys: Sequence[str], grad: torch.Tensor) -> torch.Tensor:
        """The residuals of the parts ``keys`` (``grad``: ``[N, P * n]``) as one ``[N, P, n]`` tensor, each part's
        entry of :attr:`residuals` a view of it (:class:`Stacks`)."""
        shape = (grad.shape[0], len(keys), grad.shape[1] // len(keys))
        return self.stacks.stack(keys, shape, 1, self.residual_dtype, grad.device)

    def subtract_input(self, key: str, taken: torch.Tensor) -> None:
        self.residuals[key].sub_(taken)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the residuals with copies of ``state``'s, in the same dict (see the class docstring)."""
        self.residuals.clear()
        self.residuals.update({key: value.clone() for key, value in state.items()})
        self.stacks.held.clear()


class PlainCodec(Codec):
    """The columns as they are (the reduce dtype), summed in float32 at the owner: a fair
    reduce-scatter, ``(N-1)/N`` of the buffer per rank, no state. On NCCL the transport sums them
    with NCCL's own reduce-scatter (in the reduce dtype, as FSDP does) and decode gets one row."""

    name = "plain"
    summed_rows = True
    summed_dtype = torch.float32

    def wire(self, numel: int, world: int, dtype: torch.dtype) -> tuple[Wire, ...]:
        return (Wire(numel, dtype),)

    def encode(self, grad, key, group):
        return (grad,)

    def decode(self, received, numel, key, group, stats):
        return received[0].sum(dim=0, dtype=torch.float32)


def raise_on_every_rank(error: Optional[UnrecoveredError], group, device: torch.device) -> None:
    """``fallback="error"``: every rank of ``group`` raises when any owner could not decode its part
    (``error`` on the owner that failed, None elsewhere), so no rank goes on to a collective the
    others never reach. One int32 MAX all-reduce on the exchange's device, read on the host."""
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if bool(failed):
        raise UnrecoveredError("TAGC decode could not recover positions on another rank of this group "
                               "(fallback='error'; that rank's error names the part): lower the density, raise "
                               "the table size (smaller ratio), or use fallback='estimate'/'raw'")


class TAGCCodec(ResidualCodec):
    """Error feedback, threshold, exact index and count sketch; index merge and peeling at the owner.

    State: one residual ``[N, n]`` per part (``residual_dtype``), keyed by the bucket's
    parameters and the part, never by call order.
    """

    name = "tagc"
    compresses = True
    uses_ratio = True

    def __init__(self, config: TAGCConfig, residual_dtype: torch.dtype = torch.float32, positions: str = "bitmap",
                 value_dtype="float32") -> None:
        value_dtype = check_wire_options(positions, value_dtype, POSITIONS)
        if positions == "coded" and config.index_bits != 1:
            raise ValueError("positions='coded' codes each rank's support (a set): use index_bits=1")
        if value_dtype == torch.float8_e4m3fn:
            warnings.warn("value_dtype='float8' for codec 'tagc': a sketch cell sums values of very different sizes, "
                          "and peeling passes each cell's 4-bit rounding on to every value recovered through it, "
                          "where error feedback cannot return it (it is in no rank's residual). Prefer "
                          "value_dtype='float16'; float8 suits 'topk', whose rounding goes back into the residual "
                          "(docs/quality-diagnosis.md, tenth screen)", stacklevel=3)
        super().__init__(residual_dtype)
        self.config = config
        self.positions = positions
        self.value_dtype = value_dtype
        self._overflow: dict[str, torch.Tensor] = {}  # entries the rows' capacity held back, per part
        self._accumulated: dict[str, torch.Tensor] = {}  # fallback="raw": grad + residual until decode
        self.layout = functools.lru_cache(maxsize=4096)(self._layout)  # per instance: no hook kept alive by a cache

    def _layout(self, numel: int) -> SketchLayout:
        return SketchLayout(numel, self.config.ratio, self.config.lane, self.config.seed)

    def _capacity(self, numel: int, world: int) -> tuple[int, int]:
        """Coded positions: ``(cap, low)``, the entries a row may keep and the code's low-part width."""
        density = self.config.density(world)
        return capacity(numel, density), low_bits(density)

    def wire(self, numel, world, dtype):
        layout = self.layout(numel)
        if self.positions == "coded":
            index = Wire(coded_row_bytes(numel, *self._capacity(numel, world)), torch.uint8)
        else:
            index = Wire(-(-numel * self.config.index_bits // 8), torch.uint8)
        return (index, *value_wires(layout.table_numel, self.value_dtype))

    def overlappable(self) -> bool:
        # the raw re-send, and the agreement on an "error", are collectives: they run where every rank runs them
        return self.config.fallback == "estimate"

    def traceable(self) -> bool:
        return self.config.fallback == "estimate"  # the raw re-send has data-dependent sizes; "error" raises

    @property
    def batchable(self) -> bool:
        return self.config.fallback == "estimate"  # "raw" and "error" decode part by part, with collectives

    def encode(self, grad, key, group):
        return self.encode_batch(grad, (key,), group)

    def encode_batch(self, grad, keys, group):
        # rows [N * P, n] (row j * P + p: part p's row for rank j): every kernel works row by row, so each part is
        # encoded exactly as alone
        world, parts = grad.shape[0], len(keys)
        numel = grad.shape[1] // parts
        layout = self.layout(numel)
        residual = self.residual_batch(keys, grad)
        # NaN/Inf on the device (no host read): a non-finite part keeps the residual, sends NaN
        # (tagc.hooks.core.nonfinite)
        ok, grad = nonfinite.zero_unless_finite(grad.reshape(world, parts, numel))
        if self.config.fallback == "raw":
            self._accumulated.update(zip(keys, residual.to(torch.float32, copy=True).add_(grad).unbind(1)))
        cap, low = self._capacity(numel, world)  # no row keeps more: the coded wire holds it
        index, table, held = nonfinite.compress_(ok, grad, residual, self.config.density(world), layout,
                                                 self.config.index_bits, cap)
        self._overflow[keys[0]] = held
        if self.positions == "coded":
            index = code_index(index, numel, cap, low)
        return tuple(wire.reshape(world, -1).contiguous() for wire in (index, *pack_values(table, self.value_dtype)))

    def _union(self, indexes: torch.Tensor, numel: int, parts: int, key: str, stats: ExchangeStats) -> torch.Tensor:
        """Every rank's support merged, per part (``[P, index bytes]``): the union of the coded rows, or the
        bitmaps' OR / sum."""
        stats.count("overflow", self._overflow.pop(key, 0))  # counted by the rank that held them back
        world = indexes.shape[0]
        if self.positions == "coded":
            cap, low = self._capacity(numel, world)
            rows = indexes.reshape(world * parts, -1)
            stats.count("bitmap_blocks", bitmap_blocks(rows, numel, low))
            return union_index(rows.contiguous(), numel, cap, low, parts).view(parts, -1)
        bits = self.config.index_bits
        return functools.reduce(lambda a, b: merge_index(a, b, bits), indexes.unbind(0)).view(parts, -1)

    def decode_batch(self, received, numel, keys, group, stats):
        indexes, *cells = received
        world, parts = indexes.shape[0], len(keys)
        summed = unpack_values([c.reshape(world * parts, -1) for c in cells]).view(world, parts, -1).sum(dim=0)
        layout = self.layout(numel)
        union = self._union(indexes, numel, parts, keys[0], stats)
        if self.config.fallback == "estimate":  # no host read: flags and counts stay on the device
            return nonfinite.decode_(summed, union, layout, self.config.index_bits, "estimate", stats)
        return self._decode_on_host(summed[0], union[0], indexes, numel, keys[0], group, stats)

    def decode(self, received, numel, key, group, stats):
        return self.decode_batch(received, numel, (key,), group, stats)

    def _decode_on_host(self, summed: torch.Tensor, union: torch.Tensor, indexes: torch.Tensor, numel: int, key: str,
                        group, stats: ExchangeStats) -> torch.Tensor:
        """One part's decode under ``fallback="raw"`` or ``"error"``."""
        layout = self.layout(numel)
        bits = self.config.index_bits
        # "raw" (data-dependent re-send sizes) and "error" (raises) read on the host: not sync-free
        ok = finite(summed)
        if not bool(ok):
            stats.count_nonfinite(ok)
            self._accumulated.pop(key, None)
            values = torch.full((numel,), float("nan"), dtype=torch.float32, device=summed.device)
            if self.config.fallback == "raw":  # every rank takes part in the re-send round, asking nothing
                gather_from_owners(torch.zeros(0, dtype=torch.int64, device=summed.device),
                                   torch.zeros(indexes.shape[0], 0, device=summed.device), group)
            else:
                raise_on_every_rank(None, group, summed.device)
            return values
        try:
            values, decoded = decode(summed, union, layout, bits, fallback=self.config.fallback)
        except UnrecoveredError as error:
            raise_on_every_rank(error, group, summed.device)
        if self.config.fallback == "error":
            raise_on_every_rank(None, group, summed.device)
        stats.support += int(decoded.support)
        stats.peeled += int(decoded.peeled)
        stats.unpeeled += int(decoded.unpeeled)
        stats.estimated += int(decoded.estimated)
        if self.config.fallback == "raw":  # every rank takes part, also with nothing to ask for
            wanted = decoded.raw_positions
            if wanted is None:
                wanted = torch.zeros(0, dtype=torch.int64, device=summed.device)
            sent_values = self._accumulated.pop(key) - self.residuals[key]
            raw_values, sent = gather_from_owners(wanted, sent_values, group)
            values[wanted] = raw_values
            stats.wire_bytes += sent
            stats.raw += int(decoded.raw)
        return values

    def subtract_input(self, key: str, taken: torch.Tensor) -> None:
        super().subtract_input(key, taken)
        accumulated = self._accumulated.get(key)  # fallback="raw": g + r until decode, re-sent from
        if accumulated is not None:
            accumulated.sub_(taken)

    def at_ratio(self, ratio: float) -> "TAGCCodec":
        if ratio == self.config.ratio:
            return self
        clone = with_ratio(self, ratio)
        clone.layout = functools.lru_cache(maxsize=4096)(clone._layout)  # the clone's own ratio
        return clone

    def all_reduce_form(self, parts, plain, plain_codec) -> Optional["SummedSketch"]:
        """:class:`SummedSketch` where every part's wire is TAGC's paper wire (bitmap positions, float32 cells,
        ``fallback="estimate"``), under its own feedback or EF21's, and the plain columns add up in float32."""
        codecs = [part.codec.wire_codec for part in parts]
        if not all(isinstance(codec, TAGCCodec) for codec in codecs) or plain_codec.summed_dtype != torch.float32:
            return None
        if any(codec.positions != "bitmap" or codec.value_dtype != torch.float32 or codec.config.fallback != "estimate"
               for codec in codecs):
            return None
        return SummedSketch(list(parts), list(plain), codecs)


class SummedSketch(AllReduceForm):
    """TAGC's all-reduce form: each rank compresses every part whole (the threshold planned for ``N`` ranks); the
    count-sketch tables and the plain columns are summed by one ``all_reduce(SUM)`` (sketches add); the 1-bit index
    is merged by ``all_reduce(BOR)`` on gloo (NCCL has no bitwise reduction: an all-gather and OR there), the 4-bit
    rank counts by ``all_reduce(SUM)`` of the packed nibbles (exact: at most 15 ranks, so no nibble carries). Every
    rank decodes the whole bucket.

    Each part's error feedback is its codec's :meth:`Codec.summed_shift`: TAGC's own residual, or EF21's shift (a
    part compresses ``g - h_i``, its residual becomes the next ``-h_i``, and the decoded sum of the changes is added
    to ``H``, which every rank keeps for the whole part: :class:`tagc.hooks.codecs.feedback.SummedShift`).

    Bytes each rank sends: ``ring(4 T + 4 p) + ring(I)``, ``T`` the sketch cells, ``p`` the plain columns, ``I =
    ceil(n bits / 8)`` the index bytes of the ``n`` compressed elements (``(N-1) I`` where the index is
    all-gathered)."""

    def __init__(self, parts: list, plain: list, codecs: list[TAGCCodec]) -> None:
        self.parts, self.plain, self.codecs = parts, plain, codecs
        self.bits = codecs[0].config.index_bits

    def planned_bytes(self, group, device) -> int:
        world = dist.get_world_size(group)
        plain = sum(p.numel for p in self.plain)
        cells = sum(codec.layout(p.numel).table_numel for p, codec in zip(self.parts, self.codecs))
        index = sum(-(-p.numel * codec.config.index_bits // 8) for p, codec in zip(self.parts, self.codecs))
        gathered = _index_gathered(self.bits, group, device)
        return ring(4 * (cells + plain), world) + ((world - 1) * index if gathered else ring(index, world))

    def start(self, buffer: torch.Tensor, collectives: Collectives) -> None:
        device, world, stats = buffer.device, collectives.world, collectives.stats
        indexes, tables, shifts = [], [], []
        for part, codec in zip(self.parts, self.codecs):
            shift = part.codec.summed_shift(part.key, part.numel)
            grad = shift.feed(part.take(buffer).view(1, part.numel))
            residual = codec.residual(part.key, grad)
            shift.hold(residual)
            ok, grad = nonfinite.zero_unless_finite(grad)
            cap, _ = codec._capacity(part.numel, world)
            index, table, held = nonfinite.compress_(ok, grad, residual, codec.config.density(world),
                                                     codec.layout(part.numel), codec.config.index_bits, cap)
            shift.sent(grad)  # EF21: -(h_i + sent), zero where the part is not finite (as EF21's encode)
            shifts.append(shift)
            stats.count("overflow", held)
            indexes.append(index.reshape(-1))
            tables.append(table.reshape(-1).float())
        values = torch.cat([p.take(buffer).float() for p in self.plain] + tables)
        collectives.release()
        launched = [collectives.all_reduce(values)]
        merge = self._merge_indexes(torch.cat(indexes), collectives, launched)

        def decode(_: torch.futures.Future) -> torch.Tensor:
            for done in launched:
                done.wait()  # raises a collective's error; on CUDA, orders this stream after the collective
            merged = merge()
            summed = torch.empty(buffer.numel(), dtype=torch.float32, device=device)
            at = 0
            for part in self.plain:
                part.put(summed, values[at : at + part.numel])
                at += part.numel
            index_at = 0
            for part, codec, shift in zip(self.parts, self.codecs, shifts):
                layout = codec.layout(part.numel)
                table = values[at : at + layout.table_numel]
                index_bytes = -(-part.numel * self.bits // 8)
                union = merged[index_at : index_at + index_bytes]
                decoded = nonfinite.decode_(table, union, layout, self.bits, "estimate", stats)
                part.put(summed, shift.decoded(decoded))
                at += layout.table_numel
                index_at += index_bytes
            scale_into(buffer, summed, op_scale(dist.ReduceOp.AVG, world))
            return buffer

        collectives.flight.future = collectives.decoded(launched, decode, device)

    def _merge_indexes(self, index: torch.Tensor, collectives: Collectives,
                       launched: list[torch.futures.Future]) -> Callable[[], torch.Tensor]:
        """Launch the merge of every rank's index bytes (OR of the 1-bit bitmaps, sum of the 4-bit counts), adding
        its future to ``launched``; returns what gives the merged index once it is done."""
        if self.bits == 4:
            launched.append(collectives.all_reduce(index))  # packed nibbles add without carrying: at most 15 ranks
            return lambda: index
        if not _index_gathered(self.bits, collectives.group, index.device):
            launched.append(collectives.all_reduce(index, dist.ReduceOp.BOR))
            return lambda: index
        gathered, future = collectives.all_gather(index)
        launched.append(future)

        def merge() -> torch.Tensor:
            rows = gathered.view(collectives.world, -1)
            merged = rows[0]
            for row in rows[1:]:  # one OR per rank, not per element
                merged = merge_index(merged, row, 1)
            return merged

        return merge


def _index_gathered(bits: int, group, device: torch.device) -> bool:
    """Whether the 1-bit index is merged by all-gather and OR (no bitwise all-reduce on the backend)."""
    return bits == 1 and backend_of(group, device) != "gloo"

