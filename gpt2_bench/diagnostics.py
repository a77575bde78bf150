"""Per-step diagnostics of how a gradient codec meets AdamW (the trainer's ``--diagnostics``), and a run's set against
plain's (``python -m gpt2_bench.diagnostics PLAIN RUN``).

What each record holds, and how the screens read it: docs/results.md, "Quality runs that state their noise", and
docs/quality-diagnosis.md. Statistics are sums over ranks (one small ``all_reduce`` per step) and sync the host every
step: a diagnostic run is for diagnosis, not for timing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

GROUPS = ("embedding", "linear", "attention", "other")
COMPRESSED_GROUPS = {"none": (), "non-attn": ("embedding", "linear"), "blocks": ("linear",), "all": GROUPS}
"""The groups a run's ``compression`` setting routes to its codec."""
V_RANGE, V_BIN = (-30.0, 2.0), 0.01
"""The log10 range of the ``exp_avg_sq`` histogram (values outside count at its ends) and its bin width."""
V_BINS = round((V_RANGE[1] - V_RANGE[0]) / V_BIN)
ESTIMATE_FIELDS = ("n", "error_sq", "own_sq", "signal_sq", "dot")
"""Per group, the sums :meth:`StepDiagnostics.after_backward` takes (``own_sq``: ``|g_i - m|^2`` of this rank)."""
AGE_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
AGE_LABELS = ("0", "1", *(f"{a}-{b - 1}" for a, b in zip(AGE_EDGES[1:], AGE_EDGES[2:])), f"{AGE_EDGES[-1]}+")

_WRAPPERS = re.compile(r"(_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\.|parametrizations\.|"
                       r"\.original$)")
_EMBEDDING = re.compile(r"(^|\.)(wte|lm_head)\.weight$")


def parameter_group(name: str, dim: int) -> str:
    """The group (:data:`GROUPS`) of the parameter called ``name`` (wrappers' parts ignored) with ``dim`` dims."""
    from tagc.hooks.core.selection import non_attention_linear

    name = _WRAPPERS.sub("", name)
    if _EMBEDDING.search(name):
        return "embedding"
    if dim >= 2 and non_attention_linear(name) and not re.search(r"(^|\.)wpe\.", name):
        return "linear"
    return "attention" if dim >= 2 and "attn" in name else "other"


def _local(tensor):
    """A DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class StaleAges:
    """Steps since each element of the codec's residuals was last sent: its residual zero after the step (classic
    feedback), or (``changed=True``, EF21) changed other than by fading by ``decay`` (a number or a callable)."""

    def __init__(self, changed: bool = False, decay: Union[float, Callable[[], float]] = 1.0) -> None:
        self.ages: dict[tuple[str, int], Any] = {}
        self.changed = changed
        self._decay = decay
        self.previous: dict[tuple[str, int], Any] = {}  # changed=True: each residual as the last step left it

    @property
    def decay(self) -> float:
        """The fading of the step just made."""
        return self._decay() if callable(self._decay) else self._decay

    def update(self, residuals: dict) -> Any:
        """Advance every age by one step, zero those sent, and return the counts per bin (:data:`AGE_LABELS`,
        float64, on the residuals' device; no residual gives zeros)."""
        import torch

        counts = torch.zeros(len(AGE_LABELS), dtype=torch.float64)
        for key, parts in residuals.items():
            for index, residual in enumerate(parts):
                age = self.ages.get((key, index))
                if age is None or age.shape != residual.shape or age.device != residual.device:
                    age = self.ages[(key, index)] = torch.zeros(residual.shape, dtype=torch.int32,
                                                                device=residual.device)
                age.add_(1).masked_fill_(self._sent((key, index), residual), 0)
                edges = torch.tensor(AGE_EDGES, dtype=torch.int32, device=age.device)
                bins = torch.bucketize(age.reshape(-1), edges, right=True)
                counts = counts.to(age.device) + torch.bincount(bins, minlength=len(AGE_LABELS)).double()
        return counts

    def _sent(self, key: tuple[str, int], residual: Any) -> Any:
        if not self.changed:
            return residual == 0
        before, self.previous[key] = self.previous.get(key), residual.detach().clone()
        if before is None or before.shape != residual.shape:
            return residual != 0  # the first step: a shift that is not zero moved from h = 0
        decay = self.decay
        return residual != (before if decay == 1.0 else before * decay)  # as EF21Codec.fade rounds it


def quantiles_from_histogram(counts: Sequence[float], low: float, width: float, qs: Sequence[float]) -> list[float]:
    """The ``qs`` quantiles of values binned in ``counts`` (bin ``i`` covers ``[low + i*width, low + (i+1)*width)``),
    linear within a bin; NaN for an empty histogram."""
    total = sum(counts)
    if total <= 0:
        return [math.nan for _ in qs]
    out = []
    for q in qs:
        target, seen = q * total, 0.0
        for i, count in enumerate(counts):
            if count > 0 and seen + count >= target:
                out.append(low + (i + (target - seen) / count) * width)
                break
            seen += count
        else:
            out.append(low + len(counts) * width)
    return out


class StepDiagnostics:
    """One rank's per-step diagnostics; rank 0 writes them. On every rank (collectives): :meth:`after_backward`
    before clipping, :meth:`before_step` and :meth:`after_step` around ``optimizer.step()``. ``replicated`` (DDP):
    every rank holds the whole averaged gradient, which the ``estimate`` needs."""

    def __init__(self, model, optimizer, hook, path: Optional[str], compression: str, grad_clip: float,
                 header: Optional[dict] = None, replicated: bool = False) -> None:
        from tagc.hooks.core.engine import TAGCHook

        self.optimizer, self.hook, self.grad_clip = optimizer, hook, grad_clip
        engine = getattr(hook, "hook", hook)  # the trainer's DDP counter holds the tagc.hook(...) it installed
        self._engine = engine if replicated and isinstance(engine, TAGCHook) else None  # None: no estimate
        self._own: dict[int, Any] = {}  # id(parameter) -> this rank's own gradient of this step
        self._estimate = None
        self._before: list = []
        self.params = [(parameter_group(name, p.dim()), p) for name, p in model.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("diagnostics found no trainable parameters")
        self._handles = [p.register_post_accumulate_grad_hook(self._keep_own) for group, p in self.params
                         if self._engine is not None and group in COMPRESSED_GROUPS[compression]]
        codec = getattr(hook, "codec", None)
        ef21 = getattr(codec, "feedback", "classic") == "ef21"
        self.ages = StaleAges(changed=ef21, decay=(lambda: codec.decay) if ef21 else 1.0)  # set_feedback_decay moves it
        self.log = open(path, "a" if header is None else "w") if path else None  # noqa: SIM115 - closed by close()
        if self.log is not None and header is not None:
            numel = {group: sum(p.numel() for g, p in self.params if g == group) for group in GROUPS}
            self.log.write(json.dumps({"header": True, **header, "compression": compression,
                                       "compressed_groups": list(COMPRESSED_GROUPS[compression]),
                                       "grad_clip": grad_clip, "numel": numel, "age_bins": list(AGE_LABELS),
                                       "v_bin": V_BIN}) + "\n")
            self.log.flush()

    def _keep_own(self, parameter) -> None:
        """This rank's own gradient, as autograd accumulates it (before DDP's reducer averages it)."""
        self._own[id(parameter)] = parameter.grad.detach().clone()

    def after_backward(self) -> None:
        """The ``estimate``: each ``.grad`` (decoded) against the exact mean of the kept gradients. A no-op where
        nothing was kept or the hook compressed nothing (its dense warm-up, DDP's own first step)."""
        import torch
        import torch.distributed as dist

        self._estimate = None
        kept, self._own = self._own, {}
        engine = self._engine
        if not kept or not (engine.codec.compresses and not engine.state.dense
                            and engine.state.current.compressed_buckets > 0):
            return
        chosen = [(group, p, kept[id(p)]) for group, p in self.params if id(p) in kept and p.grad is not None]
        if not chosen:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        own = torch.cat([gradient.reshape(-1).double() for _, _, gradient in chosen])
        mean = own.clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        sums = torch.zeros(len(GROUPS), len(ESTIMATE_FIELDS), dtype=torch.float64, device=own.device)
        at = 0
        for group, p, _ in chosen:
            m, g = mean[at : at + p.numel()], own[at : at + p.numel()]
            d = _local(p.grad).detach().reshape(-1).double()
            at += p.numel()
            sums[GROUPS.index(group)] += torch.stack([
                torch.tensor(float(p.numel()), dtype=torch.float64, device=own.device),
                (d - m).square().sum(), (g - m).square().sum(), m.square().sum(), (d * m).sum(),
            ])
        self._estimate = sums

    def before_step(self) -> None:
        """Keep this rank's parameter shards as they are before the optimizer moves them."""
        self._before = [_local(p).detach().clone() for _, p in self.params]

    def after_step(self, step: int, lr: float, grad_norm, dense: bool) -> Optional[dict]:
        """Measure the step just taken (``grad_norm``: what ``clip_grad_norm_`` returned; ``dense``: the hook sent
        this step uncompressed, so no element aged); rank 0 writes and returns it."""
        import torch
        import torch.distributed as dist

        device = _local(self.params[0][1]).device
        width = 4 + V_BINS  # n, sum delta^2, sum v, sum log v, then the log10 v histogram
        stats = torch.zeros(len(GROUPS), width, dtype=torch.float64, device=device)
        for (group, p), before in zip(self.params, self._before):
            row = stats[GROUPS.index(group)]
            delta = (_local(p).detach().double() - before.double()).reshape(-1)
            row[0] += delta.numel()
            row[1] += delta.square().sum()
            v = self.optimizer.state.get(p, {}).get("exp_avg_sq")
            if v is not None:
                v = _local(v).detach().double().reshape(-1)
                row[2] += v.sum()
                log_v = v.clamp_min(10.0 ** V_RANGE[0]).log10().clamp(V_RANGE[0], V_RANGE[1] - V_BIN / 2)
                row[3] += log_v.sum()
                row[4:] += torch.histc(log_v, bins=V_BINS, min=V_RANGE[0], max=V_RANGE[1])
        self._before = []
        ages = self.ages.update(self.hook.residuals) if self.hook is not None and not dense else None
        ages = torch.zeros(len(AGE_LABELS), dtype=torch.float64) if ages is None else ages
        estimate = self._estimate if self._estimate is not None else torch.zeros(
            len(GROUPS), len(ESTIMATE_FIELDS), dtype=torch.float64, device=device)
        self._estimate = None
        vector = torch.cat([stats.reshape(-1), ages.to(device), estimate.to(device).reshape(-1)])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(vector)
        if self.log is None:
            return None
        stats = vector[: stats.numel()].reshape(len(GROUPS), width).cpu()
        age_counts = vector[stats.numel() : stats.numel() + len(AGE_LABELS)].cpu().tolist()
        estimate = vector[stats.numel() + len(AGE_LABELS) :].reshape(len(GROUPS), len(ESTIMATE_FIELDS)).cpu()
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        norm = float(norm) if norm is not None else math.nan
        record: dict[str, Any] = {"step": step, "lr": lr, "grad_norm": norm,
                                  "clipped": bool(self.grad_clip) and norm > self.grad_clip, "groups": {}}
        for index, group in enumerate(GROUPS):
            n, sq, v_sum, log_sum = stats[index, :4].tolist()
            if n:
                p50, p90 = (10.0**x for x in quantiles_from_histogram(stats[index, 4:].tolist(), V_RANGE[0], V_BIN,
                                                                       (0.5, 0.9)))
                record["groups"][group] = {"n": int(n), "update_rms": math.sqrt(sq / n) / lr if lr else math.nan,
                                           "v_mean": v_sum / n, "v_geomean": 10.0 ** (log_sum / n), "v_p50": p50,
                                           "v_p90": p90}
        estimates = {group: summary for index, group in enumerate(GROUPS)
                     if (summary := estimate_summary(estimate[index].tolist(), world)) is not None}
        if estimates:
            record["estimate"] = estimates
        total = sum(age_counts)
        if total:
            record["staleness"] = {"counts": age_counts, "elements": int(total), "sent": age_counts[0] / total}
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        return record

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.log is not None:
            self.log.close()


def estimate_summary(sums: Sequence[float], world: int) -> Optional[dict]:
    """One group's ``estimate`` from :data:`ESTIMATE_FIELDS` summed over ``world`` ranks (all but ``own_sq`` alike on
    every rank); ``None`` where the group was not measured."""
    n, error_sq, own_sq, signal_sq, dot = sums
    if not n:
        return None
    error_sq, signal_sq, dot = (value / world for value in (error_sq, signal_sq, dot))
    noise_sq = own_sq / (world * (world - 1)) if world > 1 else math.nan
    return {"n": int(n / world), "error_sq": error_sq, "noise_sq": noise_sq, "signal_sq": signal_sq,
            "error_to_noise": error_sq / noise_sq if noise_sq else math.nan,
            "gain": dot / signal_sq if signal_sq else math.nan}


# ----------------------------------------------------------------------------- two runs side by side


def diagnostics_path(path: str | Path) -> Path:
    """A run's diagnostics log: ``path`` itself, or ``<run>.diagnostics.jsonl`` beside a run's ``<run>.jsonl``."""
    path = Path(path)
    candidate = path.with_name(path.name.removesuffix(".jsonl") + ".diagnostics.jsonl")
    return path if path.name.endswith(".diagnostics.jsonl") or not candidate.exists() else candidate


def read_diagnostics(path: str | Path) -> tuple[dict, dict[int, dict]]:
    """``(header, {step: record})`` of a diagnostics log (the last record of a step wins: a resumed run)."""
    path = diagnostics_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no diagnostics log at {path}: train with --diagnostics")
    header: dict = {}
    records: dict[int, dict] = {}
    for record in (json.loads(line) for line in path.read_text().splitlines() if line.strip()):
        if record.get("header"):
            header = record
        elif "step" in record:
            records[record["step"]] = record
    return header, records


def _pooled(record: dict, groups: Sequence[str]) -> dict:
    """The groups pooled over their elements (the estimate's sums of squares added)."""
    chosen = [record["groups"][g] for g in groups if g in record.get("groups", {})]
    n = sum(g["n"] for g in chosen)
    pooled = {} if not n else {
        "update_rms": math.sqrt(sum(g["update_rms"] ** 2 * g["n"] for g in chosen) / n),
        "v_mean": sum(g["v_mean"] * g["n"] for g in chosen) / n,
        "v_geomean": 10.0 ** (sum(math.log10(g["v_geomean"]) * g["n"] for g in chosen) / n)}
    estimates = [record["estimate"][g] for g in groups if g in record.get("estimate", {})]
    if estimates:
        noise, signal = sum(e["noise_sq"] for e in estimates), sum(e["signal_sq"] for e in estimates)
        pooled["error_to_noise"] = sum(e["error_sq"] for e in estimates) / noise if noise else math.nan
        pooled["gain"] = sum(e["gain"] * e["signal_sq"] for e in estimates) / signal if signal else math.nan
    return pooled


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or not b or math.isnan(a) or math.isnan(b) else a / b


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def compare_runs(plain_path: str | Path, run_path: str | Path, windows: int = 10) -> dict:
    """A run's diagnostics against plain's at the steps both logged, on the run's compressed groups (all when it
    compresses none): per step, averaged over ``windows`` spans, and the staleness histogram summed."""
    plain_header, plain = read_diagnostics(plain_path)
    run_header, run = read_diagnostics(run_path)
    groups = tuple(run_header.get("compressed_groups") or ()) or GROUPS
    steps = sorted(set(plain) & set(run))
    if not steps:
        raise ValueError(f"{plain_path} and {run_path} share no logged step")
    per_step = []
    for step in steps:
        a, b = plain[step], run[step]
        pooled_a, pooled_b = _pooled(a, groups), _pooled(b, groups)
        per_step.append({
            "step": step, "plain_clipped": a["clipped"], "run_clipped": b["clipped"],
            "grad_norm_ratio": _ratio(b["grad_norm"], a["grad_norm"]),
            **{f"{key}_ratio": _ratio(pooled_b.get(key), pooled_a.get(key))
               for key in ("update_rms", "v_mean", "v_geomean")},
            "groups": {g: {f"{key}_ratio": _ratio(b["groups"][g][key], a["groups"][g][key])
                           for key in ("update_rms", "v_p50", "v_p90")}
                       for g in groups if g in a.get("groups", {}) and g in b.get("groups", {})},
            "staleness": b.get("staleness"),
            "run_error_to_noise": pooled_b.get("error_to_noise"), "run_gain": pooled_b.get("gain"),
        })
    size = max(1, math.ceil(len(per_step) / windows))
    spans = []
    for start in range(0, len(per_step), size):
        chunk = per_step[start : start + size]
        stale = [r["staleness"] for r in chunk if r["staleness"]]
        spans.append({
            "first": chunk[0]["step"], "last": chunk[-1]["step"], "steps": len(chunk),
            "plain_clip_fraction": sum(r["plain_clipped"] for r in chunk) / len(chunk),
            "run_clip_fraction": sum(r["run_clipped"] for r in chunk) / len(chunk),
            **{key: _mean([r[key] for r in chunk]) for key in ("grad_norm_ratio", "update_rms_ratio", "v_mean_ratio",
                                                                "v_geomean_ratio", "run_error_to_noise", "run_gain")},
            "sent": _mean([s["sent"] for s in stale]),
            "stale_8_plus": _mean([sum(s["counts"][4:]) / s["elements"] for s in stale]),
        })
    histogram = [0.0] * len(AGE_LABELS)
    for row in per_step:
        if row["staleness"]:
            histogram = [h + c for h, c in zip(histogram, row["staleness"]["counts"])]
    return {"plain": plain_header, "run": run_header, "groups": list(groups), "per_step": per_step, "windows": spans,
            "staleness_histogram": histogram}


def format_comparison(result: dict) -> str:
    """:func:`compare_runs`' result as Markdown."""
    fmt = lambda value, spec="{:.3f}": "-" if value is None else spec.format(value)  # noqa: E731
    plain, run = result["plain"].get("run", "plain"), result["run"].get("run", "run")
    lines = [
        f"# Diagnostics: `{run}` against `{plain}`", "",
        f"Ratios are the run's over plain's at the same step, on the run's compressed groups "
        f"({', '.join(result['groups'])}; pooled over their elements), averaged over each span's steps. "
        f"`update RMS`: RMS of the parameter change over the learning rate (AdamW's update); `v`: Adam's "
        f"exp_avg_sq. `sent`: share of the residual's elements sent in a step; `age 8+`: share last sent 8 or "
        f"more steps before. `error/noise` and `gain` (DDP runs only): the run's decoded gradient against the exact "
        f"mean of the ranks' gradients, its squared error over the mean's minibatch noise and the share of the mean "
        f"that gets through.", "",
        "| steps | clip plain | clip run | grad norm | update RMS | v mean | v geomean | sent | age 8+ "
        "| error/noise | gain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for span in result["windows"]:
        lines.append(
            f"| {span['first']}-{span['last']} | {span['plain_clip_fraction']:.0%} | {span['run_clip_fraction']:.0%} | "
            f"{fmt(span['grad_norm_ratio'])} | {fmt(span['update_rms_ratio'])} | {fmt(span['v_mean_ratio'])} | "
            f"{fmt(span['v_geomean_ratio'])} | {fmt(span['sent'], '{:.1%}')} | {fmt(span['stale_8_plus'], '{:.1%}')} | "
            f"{fmt(span['run_error_to_noise'])} | {fmt(span['run_gain'])} |")
    lines += ["", "Per group, over all shared steps:", "", "| group | update RMS | v p50 | v p90 |",
              "|---|---:|---:|---:|"]
    for group in result["groups"]:
        values = [row["groups"][group] for row in result["per_step"] if row["groups"].get(group)]
        if values:
            lines.append(f"| {group} | " + " | ".join(fmt(_mean([v[f"{key}_ratio"] for v in values]))
                                                   for key in ("update_rms", "v_p50", "v_p90")) + " |")
    total = sum(result["staleness_histogram"])
    if total:
        lines += ["", "Steps since an element was last sent (all compressed steps, every rank's residuals):", "",
                  "| age | " + " | ".join(AGE_LABELS) + " |", "|---|" + "---:|" * len(AGE_LABELS),
                  "| share | " + " | ".join(f"{c / total:.1%}" for c in result["staleness_histogram"]) + " |"]
    else:
        lines += ["", "No staleness: the run logged no residual (plain, a dense-only run, or a codec without error "
                  "feedback)."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m gpt2_bench.diagnostics PLAIN RUN [--out DIR]``: the comparison as Markdown."""
    p = argparse.ArgumentParser(prog="python -m gpt2_bench.diagnostics", description=__doc__.split("\n\n")[0])
    p.add_argument("plain", help="plain training's run log (<run>.jsonl) or its <run>.diagnostics.jsonl")
    p.add_argument("run", help="the run to set against it (same settings but the codec)")
    p.add_argument("--out", default=None, help="folder for the report (default: the run's folder)")
    p.add_argument("--windows", type=int, default=10, help="spans of steps in the table (default %(default)s)")
    args = p.parse_args(argv)
    try:
        result = compare_runs(args.plain, args.run, args.windows)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else diagnostics_path(args.run).parent
    out.mkdir(parents=True, exist_ok=True)
    stem = f"diagnostics-{result['run'].get('run', 'run')}-vs-{result['plain'].get('run', 'plain')}"
    report = format_comparison(result)
    (out / f"{stem}.md").write_text(report)
    print(report)
    print(f"report: {out / f'{stem}.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
