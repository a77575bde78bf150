"""Several emulated hosts: plain against TAGC, flat against hierarchical, as torchrun jobs.

``python -m gpt2_bench.compare --hosts 2 --nproc-per-host 2`` runs every method of
:data:`HOST_METHODS` on ``H`` emulated hosts (:class:`testbed.hosts.EmulatedHosts`: a network
namespace each, full-duplex links of ``--link`` into one switch), alternating the order over
``--rounds`` rounds, and reports per method: the step time (median of the steady steps pooled
over rounds), the bytes that crossed between hosts per step (the hosts' NIC counters: the
exchange, the parameter all-gathers, everything) and, of those, the gradient exchange's (the
hook's own count), and the val loss.

* ``fsdp-flat`` / ``tagc-flat``: every rank exchanges with every rank (``--flat``);
* ``fsdp`` / ``tagc``: hierarchical: plain within a host, the codec between hosts (the default
  with several hosts, for the plain codec too: the fair baseline gets every wire trick);
* ``fsdp-hsdp`` / ``tagc-hsdp``: FSDP2 with a 2-D mesh, sharded within a host and replicated
  across hosts: the gradient crosses hosts once, as an all-reduce (TAGC: a compressed
  reduce-scatter, then a dense all-gather), and the parameters never do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.config import TrainConfig
from gpt2_bench.launch import run
from gpt2_bench.methods import on_the_papers_wire, round_order

HOST_METHODS = {
    "fsdp-flat": {"compression": "none", "hierarchy": "flat"},
    "fsdp": {"compression": "none", "hierarchy": "auto"},
    "tagc-flat": {"compression": "all", "codec": "tagc", "hierarchy": "flat"},
    "tagc": {"compression": "all", "codec": "tagc", "hierarchy": "auto"},
    "fsdp-hsdp": {"compression": "none", "hierarchy": "auto", "hsdp": True, "integration": "fsdp2"},
    "tagc-hsdp": {"compression": "all", "codec": "tagc", "hierarchy": "auto", "hsdp": True, "integration": "fsdp2"},
}
"""Method name -> the :class:`TrainConfig` fields it sets (the rest: the command line's; TAGC's on the paper's wire,
:func:`gpt2_bench.methods.on_the_papers_wire`, where no flag says otherwise)."""

RUN_ATTEMPTS = 2
"""A host run is started again once if a rank dies (see :func:`gpt2_bench.launch.run`)."""

HOSTS_DEFAULTS = {"preset": "tiny", "link": "100mbit", "steps": 12, "eval_interval": 12, "compression": "all",
                  "integration": "fsdp2", "dense_steps": 2, "block_size": 64, "out_dir": "bench_out/hosts"}
"""The compare's defaults with ``--hosts``: the tiny preset, all layers compressed, a 100 Mbit/s link per host."""


def parse_host_methods(text: str) -> tuple[str, ...]:
    """``"fsdp, tagc"`` -> ``("fsdp", "tagc")``; a clear error naming the host methods otherwise."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in HOST_METHODS]
    if unknown or not names:
        raise ValueError(f"unknown host method(s) {unknown or text!r}: choose from {', '.join(HOST_METHODS)}")
    return names


def host_runs(base: TrainConfig, methods: Sequence[str], rounds: int) -> dict[str, list[dict]]:
    """Every method ``rounds`` times, every other round in reverse order; ``{method: [summary per round]}``."""
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for round_index in range(rounds):
        for method in round_order(methods, round_index):
            out = Path(base.out_dir) / f"round-{round_index + 1}"
            fields = HOST_METHODS[method]
            paper = on_the_papers_wire(base) if fields["compression"] != "none" else {}  # TAGC: the paper's wire
            cfg = base.copy_with(**paper, **fields, out_dir=str(out))
            runs[method].append(run(cfg, attempts=RUN_ATTEMPTS))
    return runs


def host_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per method: pooled step time, median bytes between hosts, val loss, ratios to ``fsdp-flat``."""
    rows = []
    for method, results in runs.items():
        steady = [ms for result in results for ms in result["steady_iter_ms"]]
        crossing = [r["inter_host_bytes_per_step"] for r in results if r.get("inter_host_bytes_per_step") is not None]
        exchange = [r["inter_host_wire_bytes_per_step"] for r in results
                    if r.get("inter_host_wire_bytes_per_step") is not None]
        rows.append({"method": method, "iter_ms": statistics.median(steady),
                     "iter_ms_per_round": [r["iter_ms"] for r in results],
                     "inter_host_bytes_per_step": statistics.median(crossing) if crossing else None,
                     "exchange_inter_host_bytes_per_step": statistics.median(exchange) if exchange else None,
                     "val_loss": results[-1]["val_loss"], "link": results[-1]["link"], "hosts": results[-1]["hosts"]})
    reference = next((row for row in rows if row["method"] == "fsdp-flat"), rows[0])
    for row in rows:
        row["speedup"] = reference["iter_ms"] / row["iter_ms"]
        for field in ("inter_host_bytes_per_step", "exchange_inter_host_bytes_per_step"):
            base, value = reference.get(field), row.get(field)
            row[field.replace("_per_step", "_ratio")] = value / base if base and value is not None else None
    return rows


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"1/{1 / value:.1f}" if 0 < value < 1 else f"{value:.2f}"


def format_host_table(rows: list[dict]) -> str:
    """The hosts compare's table: step time, speed-up and bytes between hosts against ``fsdp-flat``'s."""
    lines = [("| method | step ms | speed-up vs fsdp-flat | MB/step between hosts (all) | of fsdp-flat's | "
              "exchange MB/step between hosts | of fsdp-flat's | val loss |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['iter_ms']:.0f} | {row['speedup']:.2f}x | "
                     f"{_mb(row['inter_host_bytes_per_step'])} | "
                     f"{_ratio(row['inter_host_bytes_ratio'])} | {_mb(row['exchange_inter_host_bytes_per_step'])} | "
                     f"{_ratio(row['exchange_inter_host_bytes_ratio'])} | {row['val_loss']:.4f} |")
    return "\n".join(lines)


def hosts_report(base: TrainConfig, methods: Sequence[str], rounds: int) -> tuple[list[dict], str]:
    """Run the methods on emulated hosts; returns the rows and a markdown report (also written to ``hosts.md``)."""
    rows = host_rows(host_runs(base, methods, rounds))
    per_host = base.world // base.hosts
    report = (f"# GPT-2 on {base.hosts} emulated hosts x {per_host} ranks\n\n"
              f"Model preset `{base.preset}`, integration `{base.integration}` (HSDP methods: fsdp2), {base.steps} "
              f"steps of {base.batch_size}x{base.block_size or 'preset'} tokens per rank, TAGC ratio {base.ratio:g} "
              f"with a {base.index_bits}-bit index, dense for the first {base.dense_steps} steps; each host a network "
              f"namespace with a full-duplex {base.link} link into one switch; every run a torchrun job per host. "
              f"{rounds} round(s), every other one in reverse order; step time = median of the steady steps pooled "
              f"over rounds. Bytes between hosts: the hosts' NIC counters over a training step (all traffic); the "
              f"exchange's: the hook's count of the bytes its ranks sent to other hosts.\n\n"
              f"{format_host_table(rows)}\n")
    out = Path(base.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts.md").write_text(report)
    return rows, report


def hosts_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``python -m gpt2_bench.compare --hosts H ...``: the hosts report, printed and written, and ``--json`` rows."""
    try:
        methods = tuple(HOST_METHODS) if args.methods == "paper" else parse_host_methods(args.methods)
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    from gpt2_bench.config import config_from_args

    base = config_from_args(args)
    rows, report = hosts_report(base, methods, args.rounds)
    print(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nreport: {Path(base.out_dir) / 'hosts.md'}", file=sys.stderr)
    return 0
