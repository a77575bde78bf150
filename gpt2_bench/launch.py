"""Start a training run's ranks under torchrun, on one loopback or on emulated hosts, and summarise its log.

:func:`run` writes the run's settings, starts ``python -m gpt2_bench.train --worker`` as ``world`` ranks (one
``torchrun``; one per emulated host with ``hosts > 1``, :mod:`testbed.hosts`), waits, and returns :func:`summarise`'s
record. ``link`` shapes the ranks' loopback (:mod:`testbed.link`) or the links between hosts; ``"scaled"`` picks the
rate that keeps the paper's compute-to-communication ratio (:func:`scaled_link`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

from gpt2_bench.config import TrainConfig, param_gather
from gpt2_bench.host_bytes import COUNT_DEVICE_ENV, inter_host_bytes_per_step
from testbed.hosts import EmulatedHosts
from testbed.launch import Launch, RankFailed, torchrun_argv
from testbed.link import ShapedLink, format_rate
from testbed.paper import LINK_BPS

__all__ = ["run", "summarise", "scaled_link", "RankFailed", "median"]


def median(values: list[float]) -> float:
    """The median of step times (the upper middle of an even count; NaN for none)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def summarise(cfg: TrainConfig, log_path: Path, link: str) -> dict:
    """A run's record from its log: settings, the median steady step, the exchange's figures, losses, the curve."""
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step" in r]
    summary = next(r for r in records if r.get("summary"))
    first_steady = max(1, len(steps) // 5, cfg.dense_steps + 1 if cfg.compression != "none" else 0)
    steady = steps[min(len(steps) - 1, first_steady) :]  # drop warm-up steps and the dense warm-up
    total = summary.get("hook_total") or {}
    hooked = lambda key: median([r[key] for r in steady if key in r]) if total else None  # noqa: E731
    coded = cfg.compression != "none"
    return {
        "name": cfg.run_name, "integration": cfg.integration, "compiled": cfg.compile,
        "algorithm": cfg.codec if coded else "fsdp", "codec": cfg.codec if coded else None,
        "reduce_dtype": cfg.reduce_dtype, "param_dtype": param_gather(cfg), "compressed": cfg.compression,
        "transport": cfg.transport, "ratio": cfg.ratio if coded else None,
        "index_bits": cfg.index_bits if coded else None, "link": link, "steps": len(steps),
        "tokens": steps[-1]["tokens"] if steps else 0, "iter_ms": median([r["iter_ms"] for r in steady]),
        "steady_iter_ms": [r["iter_ms"] for r in steady],
        "codec_ms": median([r.get("compress_ms", 0.0) + r.get("decode_ms", 0.0) for r in steady]) if total else None,
        "train_s": sum(r["iter_ms"] for r in steps) / 1e3,  # every step, warm-up and dense steps included
        "exchange_ms_per_mb": hooked("exchange_ms_per_mb"),
        "wire_bytes_per_rank": (total.get("wire_bytes", 0) / max(1, len(steps))) if total else None,
        "plain_bytes_per_rank": (total.get("plain_equivalent_bytes", 0) / max(1, len(steps))) if total else None,
        "wire_bytes_per_step": hooked("wire_bytes"),  # steady steps
        "overlap": cfg.overlap, "exposed_ms": hooked("exposed_ms"), "wire_ms": hooked("wire_ms"),
        "units": _unit_medians(steady), "val_loss": summary["val_loss"],
        "resumed_from_step": summary.get("first_step") or None, "stopped_at": summary.get("stopped_at"),
        "peel_success": total.get("peel_success") if coded else None, "n_params": summary["n_params"],
        "grad_mb": summary["grad_mb"], "log": str(log_path),
        "curve": [{k: r[k] for k in ("step", "loss", "elapsed_s", "val_loss") if k in r} for r in steps],
        "hosts": cfg.hosts, "hierarchy": cfg.hierarchy if cfg.hosts > 1 else None, "hsdp": cfg.hsdp,
        "inter_host_bytes_per_step": (inter_host_bytes_per_step(log_path, [r["step"] for r in steady])
                                      if cfg.hosts > 1 else None),
        "inter_host_wire_bytes_per_step": hooked("inter_host_bytes"),
    }


def _unit_medians(steps: list[dict]) -> dict:
    """Per unit, the median over ``steps`` of its wire ms, exposed ms and bytes."""
    names = {name for r in steps for name in r.get("units", {})}
    return {name: {field: statistics.median(r["units"][name][field] for r in steps if name in r.get("units", {}))
                   for field in ("wire_ms", "exposed_ms", "bytes")} for name in sorted(names)}


def run(cfg: TrainConfig, data_dir: Optional[str] = None, link: Optional[str] = None, attempts: int = 1) -> dict:
    """Train ``cfg`` with ``cfg.world`` subprocess ranks; returns the run's summary. A run whose rank dies
    (:class:`RankFailed`) is started again, ``attempts`` times in all, from its newest checkpoint if it writes them
    (a rare crash, docs/known-issues.md, "A rare heap abort on gloo", then costs minutes, not a sweep)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return _run_once(cfg, data_dir, link)
        except RankFailed as error:
            if attempt == attempts:
                raise
            again = "from its newest checkpoint" if cfg.checkpoint_dir else "from scratch"
            print(f"{cfg.run_name}: {error}\n{cfg.run_name}: starting again {again} (attempt {attempt + 1} of "
                  f"{attempts})", file=sys.stderr)
            cfg = dataclasses.replace(cfg, resume=bool(cfg.checkpoint_dir), fault_step=None)  # a fault drill fires once
    raise AssertionError("unreachable")


def _run_once(cfg: TrainConfig, data_dir: Optional[str], link: Optional[str]) -> dict:
    from gpt2_bench.data import prepare

    data_dir = data_dir or str(prepare(cfg.dataset, cfg.cache_dir))
    link = link or cfg.link
    if link == "scaled":
        link = scaled_link(cfg, data_dir)["rate"]
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"{cfg.run_name}.jsonl"
    for stale in ([] if cfg.resume else out.glob(f"{cfg.run_name}.jsonl.host*")):
        stale.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(cfg.to_json())
        args = ["--worker", "--config", str(config_path), "--data-dir", data_dir, "--log-file", str(log_path)]
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "TORCH_CPP_LOG_LEVEL": "ERROR"}
        per_host = cfg.world // cfg.hosts
        if cfg.hosts > 1:
            with EmulatedHosts(cfg.hosts, link) as hosts:
                print(f"[{cfg.run_name}] {hosts.describe()}", file=sys.stderr, flush=True)
                argvs = [torchrun_argv("gpt2_bench.train", args, per_host, hosts=cfg.hosts, host=h,
                                       rdzv_addr=hosts.address(0), local_addr=hosts.address(h), run_id=cfg.run_name)
                         for h in range(cfg.hosts)]
                launch = Launch(argvs, env={**env, COUNT_DEVICE_ENV: "eth0"}, wrap=hosts.wrap,
                                env_per_host=[hosts.env(h) for h in range(cfg.hosts)])
                _wait(launch, cfg)
        elif link == "none":
            _wait(Launch([torchrun_argv("gpt2_bench.train", args, cfg.world)], env=env), cfg)
        else:
            with ShapedLink(link, world=cfg.world) as shaped:
                _wait(Launch([torchrun_argv("gpt2_bench.train", args, cfg.world)], env=env,
                             wrap=lambda host, argv: shaped.wrap(argv)), cfg)
    return summarise(cfg, log_path, link)


def _wait(launch: Launch, cfg: TrainConfig) -> None:
    """Wait for the ranks. When one fails, torchrun stops the others (the other hosts' ranks notice within the group
    timeout); the error names the first rank that failed and the newest complete checkpoint. With ``max_time_s`` the
    ranks stop themselves; a backstop kills them a group timeout later."""
    deadline = None if cfg.max_time_s is None else cfg.max_time_s + cfg.group_timeout_s + 120
    try:
        launch.wait(deadline_s=deadline, grace_s=cfg.group_timeout_s, what="training ranks")
    except RankFailed as failure:
        resume = "no checkpoints were asked for (--checkpoint-dir, --checkpoint-every)"
        if cfg.checkpoint_dir:
            from gpt2_bench import checkpoint

            newest = checkpoint.latest(cfg.checkpoint_dir)
            resume = (f"newest complete checkpoint: {newest}; rerun with --resume to continue from it" if newest
                      else f"no complete checkpoint in {cfg.checkpoint_dir} yet")
        where = f"training {failure}; see its traceback above" if failure.rank is not None else str(failure)
        raise RankFailed(f"{where}. {resume}", failure.rank, failure.code) from None


def scaled_link(cfg: TrainConfig, data_dir: str, steps: int = 6) -> dict:
    """The link rate at which this machine's plain exchange (or, past what it can take, the link-bound time) takes
    ``cfg.link_share`` of a non-overlapped plain step, from two short calibration runs: docs/design.md §10."""
    share = cfg.link_share
    probe = dataclasses.replace(cfg, compression="none", transport="fair", steps=steps, eval_interval=10**6,
                                reduce_dtype=None, link="none", name=f"calibrate-{cfg.preset}", overlap=False,
                                checkpoint_every=0, resume=False)  # the share of a non-overlapped step

    def measure(rate: str) -> tuple[float, float, float]:
        result = run(probe, data_dir, link=rate)
        return (result["iter_ms"] / 1e3, result["exchange_ms_per_mb"] * result["grad_mb"] / 1e3,
                result["wire_bytes_per_rank"])

    step_s, exchange_s, wire_bytes = measure("none")
    compute_s = max(1e-3, step_s - exchange_s)
    guess_bps = max(10**6, int(wire_bytes * 8 / (compute_s * share / (1 - share))))
    shaped_step_s, shaped_exchange_s, _ = measure(format_rate(guess_bps))
    slowed = max(0.0, shaped_step_s - compute_s) * guess_bps  # C: link-bound seconds x bit/s
    exchange = shaped_exchange_s * guess_bps  # V
    if exchange > share * slowed:
        share_of = "exchange"
        rate_bps = max(10**6, int((exchange - share * slowed) / (share * compute_s)))
    else:
        # the all-gathers cross the link too, so the exchange alone never takes this share: give it to the link's time
        share_of = "link"
        rate_bps = max(10**6, int(slowed * (1 - share) / (share * compute_s)))
    exchange_share = exchange / rate_bps / (compute_s + slowed / rate_bps)
    info = {"rate": format_rate(rate_bps), "rate_bps": rate_bps, "cpu_step_ms": step_s * 1e3,
            "rest_ms": compute_s * 1e3, "exchange_share": share, "share_of": share_of,
            "modelled_exchange_share": exchange_share, "slowdown": LINK_BPS / rate_bps, "nominal": "10gbit",
            "first_guess": format_rate(guess_bps), "first_guess_share": shaped_exchange_s / shaped_step_s}
    what = ("the plain exchange takes" if share_of == "exchange" else
            f"the link-bound time (exchange and all-gathers; the exchange alone cannot: {exchange_share:.0%}) takes")
    print(f"scaled link: a step here computes for {compute_s * 1e3:.0f} ms; at {info['first_guess']} the plain "
          f"exchange took {info['first_guess_share']:.0%} of a step; {what} {share:.0%} at {info['rate']} "
          f"(10gbit / {info['slowdown']:.0f})", file=sys.stderr)
    return info
