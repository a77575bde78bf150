"""The figures a compare works out from its rows: speed-ups, the bytes model, bits per parameter,
the val loss against plain's, and the winner."""

from __future__ import annotations

from collections.abc import Sequence

from gpt2_bench.compare_rows import Loss, Row

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


def add_method_columns(rows: list[Row], rate_bps: int | None, quality: dict[str, Loss] | None = None,
                       plain_method: str = "fsdp", bf16_method: str = "fsdp-bf16") -> list[Row]:
    """Speed-ups against ``plain_method`` and ``bf16_method`` (``fsdp``, ``fsdp-bf16``; the DDP layout's
    ``ddp``, ``ddp-bf16``), the bytes model, bits per parameter and the val loss (from the quality runs
    when given) against ``plain_method``'s, for one share's rows (set on the rows, which are returned)."""
    by_method = {row.method: row for row in rows}
    plain, bf16 = by_method.get(plain_method), by_method.get(bf16_method)
    for row in rows:
        if quality and row.method in quality:
            loss = quality[row.method]
            row.val_loss, row.curve, row.val_loss_steps = loss.val_loss, list(loss.curve), loss.steps
        wire = row.wire_bytes_per_step
        row.bits_per_param = bits_per_param(row)
        row.speedup = plain.iter_ms / row.iter_ms if plain else None
        row.speedup_vs_fsdp_bf16 = bf16.iter_ms / row.iter_ms if bf16 else None
        model_ms = None if plain is None else bytes_model_ms(plain.iter_ms, plain.wire_bytes_per_step, wire, rate_bps)
        row.bytes_model = None if model_ms is None or model_ms <= 0 else plain.iter_ms / model_ms
        row.bytes_model_ms = model_ms
    plain_loss = (quality[plain_method].val_loss if quality and plain_method in quality
                  else None if plain is None else plain.val_loss)
    plain_steps = (quality[plain_method].steps if quality and plain_method in quality
                   else None if plain is None else plain.val_loss_steps)
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


def val_loss_vs_fsdp(curves: dict[str, list[dict]]) -> dict[str, list[tuple[int, float]]]:
    """Per method (``curves``: method -> its loss curve), ``(step, percent)``: its val loss against
    fsdp's at the same evaluation step (only the steps both evaluated); empty without an ``fsdp`` curve."""
    evals = {method: [c for c in curve if c.get("val_loss") is not None] for method, curve in curves.items()}
    plain = {c["step"]: c["val_loss"] for c in evals.get("fsdp", [])}
    if not plain:
        return {}
    return {method: [(c["step"], 100 * (c["val_loss"] / plain[c["step"]] - 1)) for c in curve if c["step"] in plain]
            for method, curve in evals.items()}
