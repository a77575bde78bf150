"""The compare's rows as typed records, their JSON, and the figures worked out from them.

A :class:`Row` is one timed run in a compare's table: the fields of the run's summary
(:func:`gpt2_bench.launch.summarise`) the reports read, the compare's own (method, share, link,
rounds, ...) and the figures worked out against the plain and bf16 baselines
(:func:`add_method_columns`: speed-ups, the bytes model, bits per parameter, the val loss against plain's; and
:func:`winner`). Each figure has one name, which is also its JSON key. The summary's other fields ride along in
:attr:`Row.extra`, so ``--json`` writes everything a run reported.

``--json`` writes rows with :func:`write_rows`; ``--timed-from`` and ``--flat-from`` read them
back with :meth:`Row.from_json`, which also reads rows written before the records: their alias
columns (``bytes_model_speedup``, ``val_loss_vs_fsdp``) name the same figures as ``bytes_model``
and ``val_loss_delta``. A :class:`Loss` is a method's val loss from another compare's rows
(``--loss-from``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OLD_NAMES = {"bytes_model_speedup": "bytes_model", "val_loss_vs_fsdp": "val_loss_delta"}
"""Keys of rows written before the records -> the field that holds the same figure."""

NOT_WRITTEN = ("curve", "steady_iter_ms", "extra")
"""Fields ``--json`` leaves out: the curves and the per-step times are the run log's (``extra`` is
written flat, beside the fields)."""

RUN_ATTEMPTS = 3
"""Every run a compare makes is started again if a rank dies (twice at most): see :func:`gpt2_bench.launch.run`."""


def pooled_median(values: list[float]) -> float:
    """The median of steady step times pooled over rounds (the upper middle of an even count; NaN for none)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


@dataclasses.dataclass
class Row:
    """One timed run of a compare: what it ran, what it measured, and its figures against the baselines."""

    method: str
    """The method's name (:data:`gpt2_bench.methods.METHODS`, a layout's, or the main job's ``fsdp-no-overlap``)."""
    algorithm: str
    """``fsdp`` (uncompressed) or the codec."""
    compressed: str
    """Which layers the codec compressed: ``none``, ``all``, ``non-attn`` (``-`` for a row that is neither)."""
    iter_ms: float
    """Median steady step (ms); over several rounds, the median of the steady steps pooled over them."""
    val_loss: float
    """The run's final val loss (or, once ``--loss-from`` gives one, that one)."""

    # what the run's summary reports
    train_s: float | None = None
    steps: int | None = None
    n_params: int | None = None
    grad_mb: float | None = None
    codec_ms: float | None = None
    exchange_ms_per_mb: float | None = None
    wire_bytes_per_rank: float | None = None
    wire_bytes_per_step: float | None = None
    wire_ms: float | None = None
    exposed_ms: float | None = None
    peel_success: float | None = None
    units: dict[str, dict] | None = None
    curve: list[dict] = dataclasses.field(default_factory=list)
    steady_iter_ms: list[float] | None = None

    # where and how it was timed
    link: str | None = None
    share: float | None = None
    link_info: dict | None = None
    layout: str | None = None
    param_dtype: str | None = None
    """The parameters' all-gather dtype (``fp32``, ``bf16``, ``int8``) where the run gathers them (flat FSDP,
    HSDP); ``None`` under DDP (it gathers none), or where the row does not say (rows written before it)."""
    preset: str | None = None
    dense_steps: int | None = None
    rounds: int | None = None
    iter_ms_per_round: list[float] | None = None

    # the figures, against the share's plain method (and its bf16 baseline)
    speedup: float | None = None
    """Plain's median step over this one's."""
    speedup_total: float | None = None
    """Plain's whole run (every step, dense ones included) over this one's (the main job's)."""
    speedup_vs_fsdp_bf16: float | None = None
    """The bf16 baseline's median step over this one's (``fsdp-bf16``; a layout's own bf16 method there)."""
    bytes_model: float | None = None
    """The speed-up if this run differed from plain only in its bytes on the link."""
    bytes_model_ms: float | None = None
    """That step time (ms)."""
    bits_per_param: float | None = None
    """Wire bits per gradient element per rank and step."""
    val_loss_delta: float | None = None
    """Val loss against plain's, relative (``None`` when the two runs' lengths differ)."""
    val_loss_steps: int | None = None
    """The length of the run the val loss comes from, where it is another run's (``--loss-from``)."""

    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The run summary's other fields, carried to the JSON as they came."""

    @classmethod
    def from_summary(cls, summary: dict, **fields: Any) -> Row:
        """A row from a run's summary (:func:`gpt2_bench.launch.summarise`) and the compare's own ``fields``."""
        return cls.from_json({**summary, **fields})

    @classmethod
    def from_json(cls, data: dict) -> Row:
        """A row from its JSON object (``--json``), old alias keys included; unknown keys go to :attr:`extra`."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            name = OLD_NAMES.get(key, key)
            if name in known:
                if key == name or name not in data:  # the field's own key wins over an alias
                    values[name] = value
            else:
                extra[key] = value
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"a compare row needs {', '.join(missing)}; got the keys {', '.join(data)}")
        return cls(**values, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The row's JSON object: every field but :data:`NOT_WRITTEN`, and the summary's other fields."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in NOT_WRITTEN}
        return {**self.extra, **own}


def write_rows(rows: list[Row], path: str | Path) -> None:
    """``rows`` as a JSON list at ``path`` (``--json``), its folder made if needed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([row.to_json() for row in rows], indent=2) + "\n")


def read_json(path: str | Path) -> list[dict]:
    """A compare's ``--json`` file as written: a list of JSON objects."""
    return json.loads(Path(path).read_text())


@dataclasses.dataclass
class Loss:
    """A method's val loss from another compare's row (``--loss-from``), and the length of its run."""

    val_loss: float
    steps: int | None = None
    """The length of the run (``None``: unknown, compared with any)."""


def losses_from(path: str) -> dict[str, dict[str, Loss]]:
    """The val losses of another compare's JSON rows (``--json``), ``{layout: {method: loss}}`` (rows without a
    ``layout``: ``flat``): e.g. the small preset's losses for a timing-only sweep of ``gpt2-untied``."""
    found: dict[str, dict[str, Loss]] = {}
    for row in read_json(path):
        if row.get("method") and row.get("val_loss") is not None:
            steps = row.get("val_loss_steps") or row.get("steps")
            found.setdefault(row.get("layout") or "flat", {})[row["method"]] = Loss(row["val_loss"], steps)
    if not found:
        raise ValueError(f"{path} holds no rows with a method and a val_loss (write one with --json)")
    return found


LOSS_TOLERANCE = 0.01
"""A method counts as keeping plain FSDP's loss within this relative val-loss gap."""


def bytes_model_ms(plain_iter_ms: float, plain_wire: float | None, wire: float | None,
                   rate_bps: int | None) -> float | None:
    """The step time if a run differed from plain FSDP only in the bytes it puts on the link:
    ``plain_iter - (plain_wire - wire) / rate`` (wire in bytes per rank and step, the rate per
    rank). What compression can buy when its compute hides under the link; ``None`` unshaped."""
    if rate_bps is None or plain_wire is None or wire is None:
        return None
    return plain_iter_ms - (plain_wire - wire) * 8 / rate_bps * 1e3


def bits_per_param(row: Row) -> float | None:
    """Wire bits per gradient element per rank and step (plain fp32 on 2 ranks: 16)."""
    return None if row.wire_bytes_per_step is None else row.wire_bytes_per_step * 8 / row.n_params


def add_method_columns(rows: list[Row], rate_bps: int | None, losses: dict[str, Loss] | None = None,
                       plain_method: str = "fsdp", bf16_method: str = "fsdp-bf16") -> list[Row]:
    """Speed-ups against ``plain_method`` and ``bf16_method`` (``fsdp``, ``fsdp-bf16``; the DDP layout's
    ``ddp``, ``ddp-bf16``), the bytes model, bits per parameter and the val loss (from ``losses``, ``--loss-from``,
    where given) against ``plain_method``'s, for one share's rows (set on the rows, which are returned)."""
    by_method = {row.method: row for row in rows}
    plain, bf16 = by_method.get(plain_method), by_method.get(bf16_method)
    for row in rows:
        if losses and row.method in losses:
            row.val_loss, row.val_loss_steps = losses[row.method].val_loss, losses[row.method].steps
        wire = row.wire_bytes_per_step
        row.bits_per_param = bits_per_param(row)
        row.speedup = plain.iter_ms / row.iter_ms if plain else None
        row.speedup_vs_fsdp_bf16 = bf16.iter_ms / row.iter_ms if bf16 else None
        model_ms = None if plain is None else bytes_model_ms(plain.iter_ms, plain.wire_bytes_per_step, wire, rate_bps)
        row.bytes_model = None if model_ms is None or model_ms <= 0 else plain.iter_ms / model_ms
        row.bytes_model_ms = model_ms
    given = (losses or {}).get(plain_method)  # plain's loss may come without a timed plain row
    plain_loss = given.val_loss if given else None if plain is None else plain.val_loss
    plain_steps = given.steps if given else None if plain is None else plain.val_loss_steps
    for row in rows:
        comparable = plain_loss is not None and same_run_length(row, plain_steps)
        row.val_loss_delta = row.val_loss / plain_loss - 1 if comparable else None
    return rows


def same_run_length(row: Row, plain_steps: int | None) -> bool:
    """Whether ``row``'s val loss comes from a run as long as fsdp's (unknown lengths count as
    the same): a 300-step loss set against a 2,000-step one would be a gap of training, not of method."""
    return row.val_loss_steps is None or plain_steps is None or row.val_loss_steps == plain_steps


def winner(rows: Sequence[Row]) -> Row | None:
    """The fastest row whose val loss is within :data:`LOSS_TOLERANCE` of ``fsdp``'s."""
    eligible = [row for row in rows if row.val_loss_delta is not None and row.val_loss_delta <= LOSS_TOLERANCE]
    return min(eligible, key=lambda row: row.iter_ms) if eligible else None


def no_worse_loss(other: Row, row: Row) -> bool:
    """``other``'s val loss is no worse than ``row``'s, from runs of the same length."""
    return same_run_length(other, row.val_loss_steps) and other.val_loss <= row.val_loss


def explain_gap(row: Row, other: Row) -> str:
    """``row``'s step time against ``other``'s, split into bytes (the bytes model's difference),
    codec time on the training thread, and the rest; plus the loss difference."""
    total = row.iter_ms - other.iter_ms
    parts = []
    if row.bytes_model_ms is not None and other.bytes_model_ms is not None:
        parts.append(f"bytes {row.bytes_model_ms - other.bytes_model_ms:+.0f} ms")
    codec = (row.codec_ms or 0.0) - (other.codec_ms or 0.0)
    parts.append(f"codec {codec:+.0f} ms")
    loss = ""
    if row.val_loss_delta is not None and other.val_loss_delta is not None:
        loss = f"; val loss {100 * (row.val_loss_delta - other.val_loss_delta):+.2f} points"
    return f"{total:+.0f} ms ({', '.join(parts)}){loss}"
