"""Emulated hosts: one network namespace per host, joined through a switch by shaped veth pairs.

``with EmulatedHosts(2, "1gbit") as hosts: ...`` makes namespaces ``<name>-h0``, ``<name>-h1`` and a switch
``<name>-sw``; host ``i`` has ``eth0`` at ``198.18.0.(i+1)/24``, shaped both ways. How, and why the hosts' ``eth0``
counters count exactly what crossed between hosts: docs/design.md §11, "Emulated hosts". Everything is removed on
exit, also on failure (``ip netns``: root). Rates and tbf sizes: :mod:`testbed.link`.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from typing import Sequence, Union

from testbed.link import LinkError, Namespaces, format_rate, parse_rate, tbf_params

__all__ = ["EmulatedHosts", "SUBNET"]

SUBNET = "198.18.0"
"""Host ``i`` is ``198.18.0.(i+1)``; the range is reserved for benchmarks (RFC 2544)."""

def _ip(*args: str, check: bool = True, tool: str = "ip", note: str = "") -> subprocess.CompletedProcess:
    """``tool *args`` (``ip`` or ``tc``), with ``LinkError`` when it fails (``check``), ``note`` added."""
    result = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise LinkError(f"`{tool} {' '.join(args)}` failed: {result.stderr.strip()}{note}")
    return result


class EmulatedHosts(Namespaces):
    """``hosts`` namespaces, each with a full-duplex link of ``rate`` into one switch (context manager).

    Args:
        hosts: how many hosts (>= 2).
        rate: each host's link rate (``"1gbit"``, bits/s, or ``"none"`` for unshaped veths).
    """

    def __init__(self, hosts: int, rate: Union[str, int, None]) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 2 <= hosts <= 200:
            raise ValueError(f"hosts must be an integer from 2 to 200, got {hosts!r}")
        self.hosts = hosts
        self.rate_bps = parse_rate(rate) if rate is not None else None
        self.name = f"tagc{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.namespaces: list[str] = []
        super().__init__()

    what = "hosts"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def namespace(self, host: int) -> str:
        return f"{self.name}-h{host}"

    @staticmethod
    def address(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    # ------------------------------------------------------------------ setup / teardown

    def _create(self) -> None:
        """Create the switch and the hosts, address and shape every veth."""
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in range(self.hosts):
            self._add_host(host)

    def _add_namespace(self, name: str) -> None:
        result = _ip("netns", "add", name, check=False)
        if result.returncode != 0:
            raise LinkError(f"`ip netns add {name}` not permitted or failed: {result.stderr.strip()} (emulated hosts "
                            "need root)")
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, host: int) -> None:
        ns, port = self.namespace(host), f"p{host}"
        self._add_namespace(ns)
        # made inside the host, its peer inside the switch: nothing ever sits in this machine's namespace
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        if self.rate_bps is not None:
            p = tbf_params(self.rate_bps, world=1)
            shape = ["root", "tbf", "rate", f"{p['rate_bps']}bit", "burst", str(p["burst_bytes"]), "limit",
                     str(p["limit_bytes"])]
            for where, device in ((ns, "eth0"), (self.switch, port)):  # the host's upload, its download
                _ip("-n", where, "qdisc", "add", "dev", device, *shape, tool="tc", note="; refusing to run unshaped")

    def _remove(self) -> None:
        """Remove every namespace (their veths go with them)."""
        for name in reversed(self.namespaces):
            self._delete_netns(name)
        self.namespaces = []

    def exists(self) -> bool:
        """Whether any of this set's namespaces is still there."""
        present = set(self.list_netns())
        return any(name.startswith(self.name + "-") for name in present)

    # ------------------------------------------------------------------ running inside, counting

    def wrap(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run on host ``host``."""
        if self._closed:
            raise LinkError("the hosts are not set up")
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def env(self, host: int) -> dict[str, str]:
        """Environment for host ``host``'s ranks: gloo binds ``eth0``, so it reaches the other hosts."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                "TORCH_CPP_LOG_LEVEL": "ERROR"}  # a namespace resolves no host names: c10d would warn per socket

    def describe(self) -> str:
        rate = ("unshaped" if self.rate_bps is None
                else f"{format_rate(self.rate_bps)} full duplex per host (tbf both ways)")
        return f"{self.hosts} emulated hosts ({SUBNET}.1-{self.hosts}), one switch, {rate} ({self.name})"
