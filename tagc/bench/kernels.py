"""Triton kernel benchmark: achieved bandwidth vs a device copy, codec time vs a 10 Gbit link.

``python -m tagc.bench kernels [--sizes 1M,16M,256M] [--ratio 10] [--ranks 2] [--bits 1]
[--dtype fp32|bf16] [--json PATH]``

On CUDA, for every size (elements of one chunk): the threshold select, the fused compress
and the peeling decode, each in milliseconds and GB/s of the bytes it must move, next to a
device-to-device copy of the same bytes; the reference (torch) path on the same device;
and the whole codec (threshold + compress + decode) against the time a 10 Gbit/s link
needs for the uncompressed fp32 bytes. Every size is first cross-checked against the
reference. Without a GPU the kernels run in Triton's interpreter at a tiny size: the
check still means something, **the timings do not**.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Optional

import torch

LINK_BITS_PER_S = 10e9
DEFAULT_SIZES = "1M,4M,16M,64M,256M"
INTERPRETER_SIZES = "4K"
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """``"1M,16M"`` -> element counts (K/M/G are powers of 1024)."""
    sizes = []
    for part in filter(None, re.split(r"[,\s]+", text.strip())):
        match = re.fullmatch(r"(\d+)([KMG]?)", part.upper())
        if not match:
            raise argparse.ArgumentTypeError(f"bad size {part!r} (e.g. 4096, 1M, 256M)")
        sizes.append(int(match.group(1)) * _SUFFIXES[match.group(2)])
    return sizes


def _copy_gbps(nbytes: int, device: str) -> float:
    """GB/s (read + write) of a device-to-device copy moving ``nbytes`` in total."""
    from tagc.kernels.benchutil import time_ms

    half = max(1, nbytes // 2)
    src = torch.empty(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * half / time_ms(lambda: dst.copy_(src)) / 1e6


def run_size(
    numel: int, ratio: float, ranks: int, bits: int, dtype: torch.dtype, device: str, reference: bool
) -> dict[str, Any]:
    """Time every kernel on one chunk of ``numel`` elements; return one result row."""
    from tagc.kernels import dispatch
    from tagc.kernels.benchutil import time_ms
    from tagc.sketch import SketchLayout, plan_density
    from tagc.sketch import compress_ as ref_compress
    from tagc.sketch import decode as ref_decode
    from tagc.sketch.sparsify import sample_size

    layout = SketchLayout(numel, ratio)
    density = plan_density(ratio, ranks)
    triton = {"backend": "triton"}
    grad = torch.randn(1, numel, device=device).to(dtype)
    residual = torch.randn(1, numel, device=device) * 0.01
    # Cross-check this size against the reference once, with the same inputs.
    res_k, res_r = residual.clone(), residual.clone()
    index, table = dispatch.compress_(grad, res_k, density, layout, bits, **triton)
    index_r, _ = ref_compress(grad, res_r, density, layout, bits)
    checked = bool(torch.equal(index, index_r) and torch.equal(res_k, res_r))
    # Decode input: the sum over `ranks` ranks (simulated by scaling one rank's support up).
    union = torch.randn(numel, device=device)
    union[torch.rand(numel, device=device) >= 1 - (1 - density) ** ranks] = 0
    from tagc.sketch import build_index, encode

    dec_table, dec_index = encode(union, layout), build_index(union, bits)
    # A small chunk keeps a stopping set now and then (a property of the code): the check is
    # parity with the reference and exactness wherever peeling settled.
    values, stats = dispatch.decode(dec_table, dec_index, layout, bits, "raw", **triton)
    want, stats_r = ref_decode(dec_table, dec_index, layout, bits, "raw")
    settled = torch.ones(numel, dtype=torch.bool, device=device)
    if stats.raw_positions is not None:
        settled[stats.raw_positions] = False
    checked = (
        checked
        and stats.as_dict() == stats_r.as_dict()
        and bool(torch.allclose(values, want, rtol=1e-5, atol=1e-6))
        and bool(torch.allclose(values[settled], union[settled], rtol=1e-5, atol=1e-6))
    )

    tau = dispatch.row_thresholds(residual, density, grad=grad, **triton)
    elem_in = grad.element_size() + residual.element_size()
    sample = sample_size(numel, density)
    work = residual.clone()
    ms = {
        "threshold": time_ms(lambda: dispatch.row_thresholds(residual, density, grad=grad, **triton)),
        "compress": time_ms(lambda: dispatch.compress_(grad, work, density, layout, bits, tau=tau, **triton)),
        "decode": time_ms(lambda: dispatch.decode_async(dec_table, dec_index, layout, bits, **triton)),
    }
    moved = {
        "threshold": 2 * sample * elem_in,  # two histogram passes over the sample
        # count and compress passes, index out, what was sent written then read once more, the table out
        "compress": numel * (2 * elem_in + residual.element_size()) + numel * bits // 8 + 2 * 4 * numel
        + 4 * layout.table_numel,
        # table in, f64 work, counts and owners, index, state, lists, values out
        "decode": layout.table_numel * (4 + 8 + 4 + 4) + numel * bits // 8 + numel * (1 + 4 + 4),
    }
    row: dict[str, Any] = {
        "numel": numel,
        "lanes": layout.lanes,
        "density": density,
        "checked": checked,
        "unpeeled": stats.unpeeled,
    }
    for name in ms:
        row[f"{name}_ms"] = ms[name]
        row[f"{name}_gbps"] = moved[name] / ms[name] / 1e6
        row[f"{name}_copy_gbps"] = _copy_gbps(moved[name], device)
    row["codec_ms"] = sum(ms.values())
    row["link_ms"] = numel * 4 * 8 / LINK_BITS_PER_S * 1e3
    row["wire_ms"] = numel * (bits + 32 / ratio) / LINK_BITS_PER_S * 1e3
    row["codec_over_link"] = row["codec_ms"] / row["link_ms"]
    if reference:
        row["torch_compress_ms"] = time_ms(lambda: ref_compress(grad, work, density, layout, bits), iters=3)
        row["torch_decode_ms"] = time_ms(lambda: ref_decode(dec_table, dec_index, layout, bits), iters=3)
    return row


def main(argv: Optional[list[str]] = None) -> None:
    """Run the kernel benchmark (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m tagc.bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help=f"chunk sizes (default {DEFAULT_SIZES} on CUDA, {INTERPRETER_SIZES} in the interpreter)",
    )
    parser.add_argument("--ratio", type=float, default=10.0)
    parser.add_argument("--ranks", type=int, default=2, help="ranks whose union the density is planned for")
    parser.add_argument("--bits", type=int, choices=(1, 4), default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="gradient dtype")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
    from tagc.kernels import interpreting, triton_available

    if not triton_available():
        raise SystemExit("tagc.bench kernels: triton is not installed")
    device = "cuda" if cuda else "cpu"
    if not cuda and not interpreting():
        raise SystemExit("tagc.bench kernels: no GPU, and triton was imported without TRITON_INTERPRET=1")
    sizes = args.sizes or parse_sizes(DEFAULT_SIZES if cuda else INTERPRETER_SIZES)
    note = None
    if not cuda:
        note = (
            "NO GPU: kernels ran in the Triton INTERPRETER on the CPU; "
            "the timings below are NOT meaningful (only the checks are)"
        )
        print(f"*** {note} ***", file=sys.stderr)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    header = f"{'numel':>11} {'L':>5} {'check':>5} | {'op':<9} {'ms':>9} {'GB/s':>8} {'copy GB/s':>9} {'of copy':>7}"
    print(header)
    for numel in sizes:
        row = run_size(numel, args.ratio, args.ranks, args.bits, dtype, device, reference=not args.no_reference)
        rows.append(row)
        for i, op in enumerate(("threshold", "compress", "decode")):
            lead = f"{numel:>11} {row['lanes']:>5} {'ok' if row['checked'] else 'FAIL':>5}" if i == 0 else " " * 23
            print(f"{lead} | {op:<9} {row[op + '_ms']:>9.3f} {row[op + '_gbps']:>8.1f} {row[op + '_copy_gbps']:>9.1f} "
                  f"{row[op + '_gbps'] / row[op + '_copy_gbps']:>6.0%}")
        extra = ""
        if "torch_compress_ms" in row:
            extra = (
                f"; torch reference: compress {row['torch_compress_ms']:.3f} ms, decode {row['torch_decode_ms']:.3f} ms"
            )
        print(f"{'':>23} | codec {row['codec_ms']:.3f} ms vs 10 Gbit link {row['link_ms']:.3f} ms for fp32 "
              f"(x{row['codec_over_link']:.2f}; compressed on the wire {row['wire_ms']:.3f} ms){extra}")
    if note:
        print(f"*** {note} ***")
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
            "interpreter": not cuda,
            "note": note,
            "ratio": args.ratio,
            "ranks": args.ranks,
            "bits": args.bits,
            "dtype": args.dtype,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    if not all(r["checked"] for r in rows):
        raise SystemExit("tagc.bench kernels: a kernel disagreed with the reference")


if __name__ == "__main__":
    main()
