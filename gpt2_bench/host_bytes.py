"""Bytes that crossed between emulated hosts, per training step, from the hosts' own NIC counters.

On emulated hosts (:class:`testbed.hosts.EmulatedHosts`) the launcher names the inter-host
device in :data:`COUNT_DEVICE_ENV`. The first rank of each host reads that device's transmit
counter (``/sys/class/net/<dev>/statistics/tx_bytes``: the namespace's own) around each
training step and appends ``{"step", "tx_bytes"}`` to ``<log>.host<h>``; the summary adds the
hosts up. Everything that crosses counts: the gradient exchange, the parameter all-gathers and
a few bytes of control traffic, not the evaluation.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Optional, Sequence

COUNT_DEVICE_ENV = "GPT2_BENCH_COUNT_DEVICE"


class HostCounter:
    """One host's transmit counter, read by the host's first rank (:meth:`for_rank` gives ``None`` elsewhere)."""

    def __init__(self, device: str, path: str) -> None:
        self.counter = Path(f"/sys/class/net/{device}/statistics/tx_bytes")
        if not self.counter.exists():
            raise RuntimeError(f"{COUNT_DEVICE_ENV}={device}, but this namespace has no {self.counter}")
        self.out = open(path, "a")
        self._at: Optional[int] = None

    @classmethod
    def for_rank(cls, log_path: str) -> Optional["HostCounter"]:
        device = os.environ.get(COUNT_DEVICE_ENV)
        if not device or os.environ.get("LOCAL_RANK", "0") != "0":
            return None
        host = int(os.environ.get("GROUP_RANK", os.environ.get("RANK", "0")))  # torchrun: this host's number
        return cls(device, f"{log_path}.host{host}")

    def read(self) -> int:
        return int(self.counter.read_text())

    def start(self) -> None:
        self._at = self.read()

    def stop(self, step: int) -> None:
        self.out.write(json.dumps({"step": step, "tx_bytes": self.read() - self._at}) + "\n")
        self.out.flush()

    def close(self) -> None:
        self.out.close()


def inter_host_bytes_per_step(log_path: Path, steps: Sequence[int]) -> Optional[float]:
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
