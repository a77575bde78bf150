"""Dispatch ``python -m tagc.bench NAME [args...]`` to ``tagc.bench.NAME.main(args)``."""

from __future__ import annotations

import importlib
import sys
from typing import Optional

BENCHMARKS = {
    "codec": "the count sketch's peeling success curve",
    "gpu-check": "on a GPU: kernel tests on the device, a one-GPU exchange self-test, times against memcpy",
    "launches": "host work per bucket: aten ops and kernel launches at 1, 8, 64 parts (CPU, Triton interpreter)",
}

USAGE = "usage: python -m tagc.bench NAME [args...]   (or: tagc-bench NAME [args...])\n\nbenchmarks:\n" + "\n".join(
    f"  {name:<10} {what}" for name, what in BENCHMARKS.items()
) + "\n\n`python -m tagc.bench NAME --help` shows a benchmark's options."


def main(argv: Optional[list[str]] = None) -> None:
    """Run the benchmark named by the first argument with the remaining arguments."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        raise SystemExit(f"tagc.bench: unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    status = importlib.import_module(f"tagc.bench.{name.replace('-', '_')}").main(rest)
    if isinstance(status, int) and status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
