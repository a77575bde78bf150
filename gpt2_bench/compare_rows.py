"""The compare's rows as typed records, and their JSON.

A :class:`Row` is one timed run in a compare's table: the fields of the run's summary
(:func:`gpt2_bench.launch.summarise`) the reports read, the compare's own (method, share, link,
rounds, ...) and the figures worked out against the plain and bf16 baselines
(:func:`gpt2_bench.compare_figures.add_method_columns`). Each figure has one name, which is also
its JSON key. The summary's other fields ride along in :attr:`Row.extra`, so ``--json`` writes
everything a run reported.

``--json`` writes rows with :func:`write_rows`; ``--timed-from`` and ``--flat-from`` read them
back with :meth:`Row.from_json`, which also reads rows written before the records: their alias
columns (``bytes_model_speedup``, ``val_loss_vs_fsdp``) name the same figures as ``bytes_model``
and ``val_loss_delta``. A :class:`Loss` is a method's val loss from the quality runs or from
another compare's rows (``--loss-from``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

OLD_NAMES = {"bytes_model_speedup": "bytes_model", "val_loss_vs_fsdp": "val_loss_delta"}
"""Keys of rows written before the records -> the field that holds the same figure."""

NOT_WRITTEN = ("curve", "steady_iter_ms", "extra")
"""Fields ``--json`` leaves out: the curves and the per-step times are the run log's (``extra`` is
written flat, beside the fields)."""


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
    """The run's final val loss (or, once a quality run's is set, that one's)."""

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
    timeline: dict | None = None
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
    """The length of the run the val loss comes from, where it is another run's (the quality runs)."""

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
    """A method's val loss and the run it comes from: a quality run, or another compare's row."""

    val_loss: float
    steps: int | None = None
    """The length of the run (``None``: unknown, compared with any)."""
    preset: str | None = None
    curve: list[dict] = dataclasses.field(default_factory=list)
    """The run's loss curve, where known (a quality run's)."""

    @classmethod
    def from_summary(cls, summary: dict) -> Loss:
        """A quality run's loss (its summary, or :func:`gpt2_bench.quality.mean_quality`'s mean over seeds)."""
        return cls(summary["val_loss"], summary.get("steps"), summary.get("preset"), summary.get("curve") or [])


def losses_of(quality: dict[str, dict]) -> dict[str, Loss]:
    """The quality runs' summaries, per method, as :class:`Loss` records."""
    return {method: Loss.from_summary(summary) for method, summary in quality.items()}


def losses_from(path: str) -> dict[str, Loss]:
    """The val losses of another compare's JSON rows (``--json``), per method: e.g. the small
    preset's quality runs for a timing-only sweep of ``gpt2-untied``."""
    found = {}
    for row in read_json(path):
        if row.get("method") and row.get("val_loss") is not None:
            steps = row.get("val_loss_steps") or row.get("steps")
            found[row["method"]] = Loss(row["val_loss"], steps, row.get("preset"))
    if not found:
        raise ValueError(f"{path} holds no rows with a method and a val_loss (write one with --json)")
    return found
