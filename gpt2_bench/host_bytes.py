"""Bytes between hosts per training step: counted on emulated hosts' NICs, and worked out for many hosts.

On emulated hosts the launcher names the inter-host device in :data:`COUNT_DEVICE_ENV`; each host's first rank
appends its transmit counter's growth per step to ``<log>.host<h>`` (:class:`HostCounter`), and the summary adds the
hosts up: everything that crosses counts, not the evaluation. ``python -m gpt2_bench.host_bytes`` works out the bytes
per host and step for 2, 8 and 64 hosts under each layout and codec, from the model's shapes and the codecs' wire
shapes (:func:`per_host_bytes`; the tables and formulas: docs/layout.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.methods import LAYOUTS

COUNT_DEVICE_ENV = "GPT2_BENCH_COUNT_DEVICE"


class HostCounter:
    """One host's transmit counter, read by the host's first rank (:meth:`for_rank` gives ``None`` elsewhere)."""

    def __init__(self, device: str, path: str) -> None:
        self.counter = Path(f"/sys/class/net/{device}/statistics/tx_bytes")
        if not self.counter.exists():
            raise RuntimeError(f"{COUNT_DEVICE_ENV}={device}, but this namespace has no {self.counter}")
        self.out = open(path, "a")  # noqa: SIM115 - open for the run's whole life, closed by close()
        self._at: int | None = None

    @classmethod
    def for_rank(cls, log_path: str) -> HostCounter | None:
        device = os.environ.get(COUNT_DEVICE_ENV)
        if not device or os.environ.get("LOCAL_RANK", "0") != "0":
            return None
        host = int(os.environ.get("GROUP_RANK", os.environ.get("RANK", "0")))  # torchrun: this host's number
        return cls(device, f"{log_path}.host{host}")

    def start(self) -> None:
        self._at = int(self.counter.read_text())

    def stop(self, step: int) -> None:
        self.out.write(json.dumps({"step": step, "tx_bytes": int(self.counter.read_text()) - self._at}) + "\n")
        self.out.flush()

    def close(self) -> None:
        self.out.close()


def inter_host_bytes_per_step(log_path: Path, steps: Sequence[int]) -> float | None:
    """Median over ``steps`` of the bytes all hosts sent to each other in a step (``None``: not counted)."""
    per_step: dict[int, int] = {}
    files = sorted(Path(log_path).parent.glob(Path(log_path).name + ".host*"))
    for path in files:
        host = {}  # a resumed run counts its repeated steps again: the last count of a step holds
        for line in path.read_text().splitlines():
            record = json.loads(line)
            host[record["step"]] = record["tx_bytes"]
        for step, sent in host.items():
            per_step[step] = per_step.get(step, 0) + sent
    wanted = [per_step[s] for s in steps if s in per_step]
    return statistics.median(wanted) if files and wanted else None


# ----------------------------------------------------------------------------- arithmetic to many hosts
#
# What each layout and codec sends between hosts per step, worked out from the model's shapes and the
# codecs' own wire shapes (Codec.wire), not measured: ``python -m gpt2_bench.host_bytes``.

HOST_COUNTS = (2, 8, 64)

def _compare_method(name: str) -> dict:
    """The compare's method ``name`` in this module's terms (what it leaves out takes the arithmetic's defaults)."""
    from gpt2_bench.methods import METHODS

    return {"options" if key == "codec_options" else key: value for key, value in METHODS[name].items()
            if key in ("compression", "codec", "plain", "ratio", "codec_options")}


ARITHMETIC_METHODS: dict[str, dict] = {
    "fp32": {"compression": "none"},
    "bf16": {"compression": "none", "bf16": True},
    "tagc": {"compression": "non-attn", "codec": "tagc"},
    **{name: _compare_method(name)
       for name in ("tagc-lean", "topk-lean", "tagc-int4", "topk-f8", "int4", "powersgd", "powersgd-lean")},
}
"""The compare's methods as the arithmetic sees them: ``bf16`` is each layout's bf16 baseline; ``tagc`` the
paper's selection at ratio 10; the rest the compare's own settings."""


INT8_GATHER_BLOCK = 256
"""Elements per float32 scale of a blockwise int8 parameter gather (ZeRO++'s qwZ; docs/layout.md)."""
PARAM_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / INT8_GATHER_BLOCK}  # the int8 code, a float32 scale per block
"""Bytes per element of flat FSDP's parameter all-gathers, by their dtype."""


def _ring(nbytes: float, world: int) -> float:
    """A ring all-reduce's bytes per participant: ``2 (N-1)/N`` of them."""
    return 2 * (world - 1) * nbytes / world


@dataclasses.dataclass(frozen=True)
class GradientPart:
    """One parameter of the model: its shape, and whether the method's ``select`` compresses it."""

    name: str
    shape: tuple
    compressed: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_parts(preset: str, compression: str, min_compress_numel: int = 65536, block_size: int | None = None
                ) -> list[GradientPart]:
    """Every parameter of ``preset`` (on the meta device), compressed where ``compression`` selects it
    (``all``: every parameter; ``non-attn``: the paper's non-attention linears) and it has at least
    ``min_compress_numel`` elements (the engine's floor, here per parameter)."""
    import torch

    from gpt2_bench.model import GPT, GPTConfig
    from tagc.hooks.core.selection import non_attention_linear

    with torch.device("meta"):
        model = GPT(GPTConfig.preset(preset, **({"block_size": block_size} if block_size else {})))
    modules = dict(model.named_modules())
    parts = []
    for name, param in model.named_parameters():
        selected = compression == "all" or (compression == "non-attn"
                                            and non_attention_linear(name, modules[name.rpartition(".")[0]]))
        parts.append(GradientPart(name, tuple(param.shape), selected and param.numel() >= min_compress_numel))
    return parts


def _codecs(method: dict, ratio: float):
    """``(codec of the selected columns or None, codec of the others)`` for a method of :data:`ARITHMETIC_METHODS`."""
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.registry import make_codec
    from tagc.hooks.core.engine import PLAIN_CODECS

    config = TAGCConfig(ratio=method.get("ratio", ratio))
    codec = (None if method["compression"] == "none"
             else make_codec(method["codec"], config, options=method.get("options")))
    plain_name = "bf16" if method.get("bf16") else method.get("plain", "fp32")
    return codec, make_codec(PLAIN_CODECS[plain_name], config)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _powersgd_bytes(parts: Sequence[GradientPart], rank: int, world: int, value_bytes: int,
                    plain_bytes_each: int) -> dict:
    """Our PowerSGD's sums as all-reduces of ``P``, then ``Q`` (plain columns with ``P``): their bytes. The
    selected parameters that are no matrix travel as the codec's shape-less columns, in ``value_bytes``
    (:meth:`tagc.hooks.codecs.powersgd.PowerSGDCodec._plain_dtype`); the others in the plain codec's
    ``plain_bytes_each``."""
    p = q = columns = plain = 0
    for part in parts:
        if part.compressed and len(part.shape) >= 2:
            rows, cols = part.shape[0], part.numel // part.shape[0]
            p, q = p + rows * rank, q + cols * rank
        elif part.compressed:
            columns += part.numel
        else:
            plain += part.numel
    return {"p": p * value_bytes, "q": q * value_bytes, "plain": columns * value_bytes + plain * plain_bytes_each}


def per_host_bytes(layout: str, method_name: str, hosts: int, parts_by_compression: dict, ranks_per_host: int = 8,
                   ratio: float = 10.0, rank: int = 4, backend: str = "nccl",
                   param_bytes: float = 4) -> tuple[float, str]:
    """Bytes one host sends to the others per step, and how (the form), for ``layout`` on ``hosts`` hosts: ``flat``
    (1 rank per host: two parameter all-gathers of ``param_bytes`` per element, :data:`PARAM_BYTES`, and the
    compressed reduce-scatter), ``ddp`` (1 rank per host: the fewest bytes of the all-reduce, ``rs+ag`` and ``gather``
    forms :mod:`tagc.hooks.adapters.ddp` allows; TAGC's index merged by a bitwise-OR all-reduce on gloo, all-gathered on
    ``nccl``) or ``hsdp`` (``ranks_per_host`` ranks per host, each exchanging its shard across the replicas by
    ``rs+ag`` or ``gather``; PowerSGD sends a piece plain). The formulas: docs/layout.md, "Bytes between hosts at 2,
    8 and 64 hosts". Codec wires are the engine's per parameter (within a few bytes of its plan per bucket)."""
    import torch

    from tagc.hooks.adapters.replicas import replica_gather_dtype

    method = ARITHMETIC_METHODS[method_name]
    parts = parts_by_compression[method["compression"]]
    codec, plain = _codecs(method, ratio)
    n = sum(part.numel for part in parts)
    powersgd = method.get("codec") == "powersgd"
    gathered = 2 if method.get("plain") == "bf16" else 4  # bytes per element of the plain columns
    reduced = replica_gather_dtype(method.get("plain", "fp32"), codec, torch.float32).itemsize  # rs+ag's all-gather
    value_bytes = 2 if method.get("options", {}).get("value_dtype") == "bfloat16" else 4
    sizes = _powersgd_bytes(parts, rank, hosts, value_bytes, gathered) if powersgd else {}

    def pieces_wire(world: int, shard: int = 1) -> tuple[int, int]:
        """(row bytes of every parameter's piece over ``world``, the piece's elements) for shards of ``1/shard``."""
        row = elements = 0
        for part in parts:
            piece = _ceil_div(_ceil_div(part.numel, shard), world)
            wire_codec = codec if part.compressed and codec is not None else plain
            row += sum(wire.row_bytes for wire in wire_codec.wire(piece, world, torch.float32)) if piece else 0
            elements += piece
        return row, elements

    powersgd_rs = (hosts - 1) * (2 * sizes["p"] + 2 * sizes["q"] + sizes["plain"]) / hosts if powersgd else 0
    if layout == "flat":
        exchange = powersgd_rs if powersgd else (hosts - 1) * pieces_wire(hosts)[0]
        return 2 * (hosts - 1) * n * param_bytes / hosts + exchange, "rs"
    if layout == "ddp":
        if method["compression"] == "none":
            return _ring((2 if method.get("bf16") else 4) * n, hosts), "allreduce"
        forms = {}
        if powersgd:  # P with the plain columns, then Q, each summed in its own dtype (fp32 or bf16)
            forms["sketch"] = _ring(sizes["p"] + sizes["plain"], hosts) + _ring(sizes["q"], hosts)
            forms["rs+ag"] = powersgd_rs + (hosts - 1) * sum(-(-part.numel // hosts) for part in parts) * reduced
        elif codec.name == "tagc" and codec.positions == "bitmap" and codec.value_dtype.itemsize == 4 and gathered == 4:
            compressed = [part for part in parts if part.compressed]
            cells = sum(codec.layout(part.numel).table_numel for part in compressed)
            plain_numel = sum(part.numel for part in parts if not part.compressed)
            index = sum(-(-part.numel * codec.config.index_bits // 8) for part in compressed)
            merge = _ring(index, hosts) if backend == "gloo" or codec.config.index_bits == 4 else (hosts - 1) * index
            forms["sketch"] = _ring(4 * (cells + plain_numel), hosts) + merge
        if not powersgd:
            row, elements = pieces_wire(hosts)
            forms["rs+ag"] = (hosts - 1) * (row + elements * reduced)
            forms["gather"] = (hosts - 1) * hosts * row
        form = min(forms, key=forms.get)
        return forms[form], form
    if layout == "hsdp":
        g = ranks_per_host
        if method["compression"] == "none":
            size = 2 if method.get("bf16") else 4
            elements = sum(_ceil_div(_ceil_div(part.numel, g), hosts) for part in parts)
            return g * (hosts - 1) * elements * 2 * size, "rs+ag"
        if powersgd:  # a piece of a shard has no matrix shape: sent plain (tagc.hooks.codecs.powersgd)
            codec = None
            parts = [dataclasses.replace(part, compressed=False) for part in parts]
        row, elements = pieces_wire(hosts, g)
        forms = {"rs+ag": (hosts - 1) * (row + elements * reduced)}
        if codec is not None and codec.traceable():
            forms["gather"] = (hosts - 1) * hosts * row
        form = min(forms, key=forms.get)
        return g * forms[form], form
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def arithmetic_rows(preset: str = "gpt2", hosts: Sequence[int] = HOST_COUNTS, layouts: Sequence[str] = LAYOUTS,
                    ranks_per_host: int = 8, backend: str = "nccl", param_bytes: float = 4,
                    block_size: int | None = None, min_compress_numel: int = 65536) -> list[dict]:
    """One row per layout and method: bytes per host and step at each host count, and the form."""
    parts = {c: model_parts(preset, c, min_compress_numel, block_size) for c in ("none", "all", "non-attn")}
    rows = []
    for layout in layouts:
        for method in ARITHMETIC_METHODS:
            row = {"layout": layout, "method": method, "bytes": {}, "form": {}}
            for h in hosts:
                row["bytes"][h], row["form"][h] = per_host_bytes(layout, method, h, parts, ranks_per_host,
                                                                 backend=backend, param_bytes=param_bytes)
            rows.append(row)
    return rows


def leanest(rows: list[dict], layout: str, hosts: int, exclude: Sequence[str] = ()) -> str:
    """The method of ``layout`` sending the fewest bytes per host at ``hosts`` hosts."""
    candidates = [row for row in rows if row["layout"] == layout and row["method"] not in exclude]
    return min(candidates, key=lambda row: row["bytes"][hosts])["method"]


def format_arithmetic(rows: list[dict], hosts: Sequence[int] = HOST_COUNTS) -> str:
    """The rows as one Markdown table per layout (MB per host and step, the form in brackets), then where
    TAGC is the leanest."""
    lines = []
    for layout in dict.fromkeys(row["layout"] for row in rows):
        lines += [f"**{layout}**", "", "| method | " + " | ".join(f"{h} hosts (MB/host/step)" for h in hosts) + " |",
                  "|---|" + "---:|" * len(hosts)]
        for row in (r for r in rows if r["layout"] == layout):
            cells = [f"{row['bytes'][h] / 1e6:.2f} ({row['form'][h]})" for h in hosts]
            lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
        lines.append("")
        for h in hosts:
            best = leanest(rows, layout, h)
            sparse = leanest(rows, layout, h, exclude=("powersgd", "powersgd-lean"))
            lines.append(f"- {h} hosts: leanest {best}; without PowerSGD, {sparse}.")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gpt2_bench.host_bytes",
                                     description="Bytes per step between hosts for each layout and codec, "
                                                 "by arithmetic.")
    parser.add_argument("--layout", default="all", choices=("all", *LAYOUTS))
    parser.add_argument("--hosts", default=",".join(map(str, HOST_COUNTS)), help="comma-separated host counts")
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--ranks-per-host", type=int, default=8, help="HSDP: GPUs per host (default 8)")
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"),
                        help="how TAGC's 1-bit index merges in DDP: nccl all-gathers it, gloo ORs it in an all-reduce")
    parser.add_argument("--param-dtype", default="fp32", choices=tuple(PARAM_BYTES),
                        help="flat FSDP's parameter all-gathers: fp32 (default), bf16, or int8 (ZeRO++'s qwZ: a "
                             "float32 scale per block of 256)")
    args = parser.parse_args(argv)
    hosts = [int(h) for h in args.hosts.split(",")]
    layouts = LAYOUTS if args.layout == "all" else (args.layout,)
    param_bytes = PARAM_BYTES[args.param_dtype]
    rows = arithmetic_rows(args.preset, hosts, layouts, args.ranks_per_host, args.backend, param_bytes)
    print(f"Preset `{args.preset}`, index merge on {args.backend}, flat parameter gathers in {args.param_dtype} "
          f"({param_bytes:g} bytes per element), "
          f"HSDP with {args.ranks_per_host} ranks per host.\n")
    print(format_arithmetic(rows, hosts))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
