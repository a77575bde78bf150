"""The compare's rows (:class:`Row`: one timed run, the summary fields the reports read, the compare's own, and the
figures :func:`add_method_columns` works out against the baselines; the summary's other fields in :attr:`Row.extra`),
and their JSON (``--json``: :func:`write_rows`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

NOT_WRITTEN = ("curve", "steady_iter_ms", "extra")
"""Fields ``--json`` leaves out (the run log has the curves and step times; ``extra`` goes flat)."""

RUN_ATTEMPTS = 3
"""Every run a compare makes is started again if a rank dies (twice at most): see :func:`gpt2_bench.launch.run`."""


@dataclasses.dataclass
class Row:
    """One timed run of a compare: what it ran, what it measured, and its figures against the baselines."""

    method: str
    algorithm: str
    """``fsdp`` (uncompressed) or the codec."""
    compressed: str
    """``none``, ``all``, ``non-attn`` (``-`` for a row that is neither)."""
    iter_ms: float
    """Median steady step (ms); over several rounds, of the steady steps pooled over them."""
    val_loss: float

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
    """The parameters' all-gather dtype; ``None`` under DDP (it gathers none) or in rows written before it."""
    preset: str | None = None
    dense_steps: int | None = None
    rounds: int | None = None
    iter_ms_per_round: list[float] | None = None

    # the figures, against the share's plain method (and its bf16 baseline)
    speedup: float | None = None
    speedup_total: float | None = None
    """Plain's whole run (every step, dense ones included) over this one's (the main job's)."""
    speedup_vs_fsdp_bf16: float | None = None
    bytes_model: float | None = None
    """The speed-up if this run differed from plain only in its bytes on the link (:func:`bytes_model_ms`)."""
    bytes_model_ms: float | None = None
    bits_per_param: float | None = None
    val_loss_delta: float | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_summary(cls, summary: dict, **fields: Any) -> Row:
        """A row from a run's summary (:func:`gpt2_bench.launch.summarise`) and the compare's own ``fields``."""
        return cls.from_json({**summary, **fields})

    @classmethod
    def from_json(cls, data: dict) -> Row:
        """A row from its JSON object (``--json``); unknown keys go to :attr:`extra`."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {key: value for key, value in data.items() if key in known}
        extra = {key: value for key, value in data.items() if key not in known}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"a compare row needs {', '.join(missing)}; got the keys {', '.join(data)}")
        return cls(**values, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The row's JSON object: every field but :data:`NOT_WRITTEN`, and the summary's other fields."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in NOT_WRITTEN}
        return {**self.extra, **own}


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """A table cell: ``value`` in ``spec`` (and ``suffix``), ``-`` where there is none."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def write_rows(rows: list[Row], path: str | Path) -> None:
    """``rows`` as a JSON list at ``path`` (``--json``), its folder made if needed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([row.to_json() for row in rows], indent=2) + "\n")


def bytes_model_ms(plain_iter_ms: float, plain_wire: float | None, wire: float | None,
                   rate_bps: int | None) -> float | None:
    """The step time if a run differed from plain FSDP only in its bytes on the link (per rank and step):
    ``plain_iter - (plain_wire - wire) / rate``; ``None`` unshaped."""
    if rate_bps is None or plain_wire is None or wire is None:
        return None
    return plain_iter_ms - (plain_wire - wire) * 8 / rate_bps * 1e3


def bits_per_param(row: Row) -> float | None:
    """Wire bits per gradient element per rank and step (plain fp32 on 2 ranks: 16)."""
    return None if row.wire_bytes_per_step is None else row.wire_bytes_per_step * 8 / row.n_params


def add_method_columns(rows: list[Row], rate_bps: int | None, plain_method: str = "fsdp",
                       bf16_method: str = "fsdp-bf16") -> list[Row]:
    """Set on one share's rows (and return them): speed-ups against ``plain_method`` and ``bf16_method``, the
    bytes model, bits per parameter and the val loss against ``plain_method``'s."""
    by_method = {row.method: row for row in rows}
    plain, bf16 = by_method.get(plain_method), by_method.get(bf16_method)
    for row in rows:
        wire = row.wire_bytes_per_step
        row.bits_per_param = bits_per_param(row)
        row.speedup = plain.iter_ms / row.iter_ms if plain else None
        row.speedup_vs_fsdp_bf16 = bf16.iter_ms / row.iter_ms if bf16 else None
        model_ms = None if plain is None else bytes_model_ms(plain.iter_ms, plain.wire_bytes_per_step, wire, rate_bps)
        row.bytes_model = None if model_ms is None or model_ms <= 0 else plain.iter_ms / model_ms
        row.bytes_model_ms = model_ms
        row.val_loss_delta = None if plain is None else row.val_loss / plain.val_loss - 1
    return rows
