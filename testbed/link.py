"""An emulated network link: a private network namespace with a shaped loopback (docs/design.md §10).

``with ShapedLink("1gbit", world=2) as link: subprocess.run(link.wrap(argv))`` runs a command inside a fresh
namespace whose loopback goes through ``tc qdisc ... tbf``, at ``world * rate``. The namespace is always removed
afterwards; if the loopback cannot be shaped, :class:`LinkError` is raised: nothing ever runs silently unshaped.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

__all__ = ["LinkError", "Namespaces", "ShapedLink", "SignalUnwind", "parse_rate", "format_rate", "tbf_params"]

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class LinkError(RuntimeError):
    """The shaped link could not be set up (no namespace permission, no ``tc``, ...)."""


def parse_rate(text: Union[str, int, float]) -> Optional[int]:
    """A link rate in tc's notation -> bits per second; ``"none"`` -> ``None`` (unshaped).

    ``"10gbit"``, ``"1gbit"``, ``"250mbit"``, ``"1.5gbit"``, ``"800kbit"``; ``...bps`` is
    *bytes* per second as in tc (``"125mbps"`` == ``"1gbit"``); a bare number is bit/s.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"link rate must be positive, got {text!r}")
        return int(text)
    if not isinstance(text, str):
        raise ValueError(f"bad link rate {text!r}")
    if text.strip().lower() in ("none", "unshaped", "off"):
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(bit|bps)?\s*", text.lower())
    if not match:
        raise ValueError(f"bad link rate {text!r}: use e.g. 10gbit, 1gbit, 250mbit, 100mbit (or 'none')")
    value = float(match.group(1)) * _UNITS[match.group(2)] * (8 if match.group(3) == "bps" else 1)
    if value < 1:
        raise ValueError(f"link rate must be at least 1 bit/s, got {text!r}")
    return int(round(value))


def format_rate(bps: Optional[int]) -> str:
    """Bits per second -> ``"10gbit"``, ``"250mbit"``, ...; ``None`` -> ``"none"``."""
    if bps is None:
        return "none"
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            value = bps / scale
            return f"{value:g}{unit}" if value == round(value, 3) else f"{value:.3g}{unit}"
    return f"{bps}bit"


def tbf_params(rate_bps: int, world: int = 2) -> dict:
    """tbf settings for ``world`` full-duplex ranks at ``rate_bps`` each on one loopback.

    rate = world * rate; burst ~1 MiB at >= 1 Gbit per rank, ~256 KiB below (accurate shaping
    measured here); a queue limit of ~100 ms at the shaped rate (at least 8 MiB) so TCP on the
    loopback is paced rather than dropped.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    total = rate_bps * world
    burst = (1 << 20) if rate_bps >= 10**9 else (256 << 10)
    limit = max(8 << 20, total // 8 // 10)
    return {"rate_bps": total, "burst_bytes": burst, "limit_bytes": limit}


class SignalUnwind:
    """While installed, SIGTERM and SIGHUP raise ``SystemExit`` (only where no handler was set), so
    a ``with`` block unwinds through its ``__exit__`` and removes what it made, as on Ctrl-C."""

    def __init__(self) -> None:
        self._old: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                old = signal.getsignal(sig)
                if old in (signal.SIG_DFL, None):
                    self._old[sig] = old
                    signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._old.clear()


_ACTIVE: "set[Namespaces]" = set()
_LOCK = threading.Lock()


def _cleanup_all() -> None:
    for namespaces in list(_ACTIVE):
        namespaces.close()


atexit.register(_cleanup_all)


class Namespaces:
    """Network namespaces that are always removed (a context manager): :meth:`close` runs on normal
    exit, on exceptions, on Ctrl-C and SIGTERM/SIGHUP (:class:`SignalUnwind`), and at interpreter
    exit. Subclasses make them in :meth:`_create` and remove them in :meth:`_remove`."""

    what = "network namespaces"
    """For error messages: what could not be emulated."""

    def __init__(self) -> None:
        self._signals = SignalUnwind()
        self._closed = True

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Make the namespaces (raises :class:`LinkError`; nothing is left behind on failure)."""
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LinkError(f"'{tool}' (iproute2) is not installed; cannot emulate {self.what}")
        self._closed = False
        with _LOCK:
            _ACTIVE.add(self)
        self._signals.install()
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove what :meth:`open` made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._remove()
        finally:
            with _LOCK:
                _ACTIVE.discard(self)
            self._signals.restore()

    def _create(self) -> None:
        raise NotImplementedError

    def _remove(self) -> None:
        raise NotImplementedError

    @staticmethod
    def list_netns() -> list[str]:
        """Names from ``ip netns list``."""
        result = _run(["ip", "netns", "list"], check=False)
        return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]

    def _delete_netns(self, name: str) -> None:
        if _run(["ip", "netns", "del", name], check=False).returncode != 0 and name in self.list_netns():
            threading.Event().wait(0.2)  # one retry: a process may still have been leaving the namespace
            _run(["ip", "netns", "del", name], check=False)


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=30)


class ShapedLink(Namespaces):
    """A private network namespace whose loopback is shaped to ``rate`` per rank (context manager).

    Args:
        rate: per-rank full-duplex rate (``"1gbit"``, bits/s, or ``None``/``"none"`` for an
            unshaped private namespace).
        world: number of ranks sharing the loopback (the tbf gets ``world * rate``).
        mode: ``"auto"`` (``ip netns`` if permitted, else ``unshare -rn``), ``"netns"`` or
            ``"unshare"``.
    """

    def __init__(self, rate: Union[str, int, None], world: int = 2, mode: str = "auto") -> None:
        if mode not in ("auto", "netns", "unshare"):
            raise ValueError(f"mode must be 'auto', 'netns' or 'unshare', got {mode!r}")
        self.rate_bps = parse_rate(rate) if rate is not None else None
        self.world = world
        self.mode = mode
        self.name = f"tagc-{os.getpid()}-{secrets.token_hex(3)}"
        self.kind: Optional[str] = None  # "netns" or "unshare" once open
        self.qdisc = ""
        self._holder: Optional[subprocess.Popen] = None
        super().__init__()

    what = "a shaped link"

    # ------------------------------------------------------------------ setup / teardown

    def _create(self) -> None:
        """Create the namespace, bring ``lo`` up and shape it."""
        errors = []
        if self.mode in ("auto", "netns"):
            try:
                self._open_netns()
            except LinkError as err:
                errors.append(str(err))
                if self.mode == "netns":
                    raise
        if self.kind is None:
            try:
                self._open_unshare()
            except LinkError as err:
                errors.append(str(err))
                raise LinkError(
                    "cannot create a network namespace for the shaped link:\n  " + "\n  ".join(errors)
                ) from None
        self._shape()

    def _open_netns(self) -> None:
        result = _run(["ip", "netns", "add", self.name], check=False)
        if result.returncode != 0:
            raise LinkError(f"`ip netns add` not permitted or failed: {result.stderr.strip()}")
        self.kind = "netns"

    def _open_unshare(self) -> None:
        if shutil.which("unshare") is None or shutil.which("nsenter") is None:
            raise LinkError("`unshare`/`nsenter` (util-linux) not available")
        # unshare execs `sleep` inside the new user+network namespace: its pid holds the namespace
        holder = subprocess.Popen(["unshare", "-rn", "sleep", "infinity"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        self._holder = holder
        ours = os.readlink("/proc/self/ns/net")
        for _ in range(500):
            if holder.poll() is not None:
                raise LinkError(f"`unshare -rn` failed: {holder.stderr.read().strip() if holder.stderr else ''}")
            try:  # ready once its uid map is written too: nsenter into an unmapped user namespace is not root
                if (os.readlink(f"/proc/{holder.pid}/ns/net") != ours
                        and Path(f"/proc/{holder.pid}/uid_map").read_text().strip()):
                    self.kind = "unshare"
                    return
            except OSError:
                pass
            threading.Event().wait(0.01)
        raise LinkError("`unshare -rn` did not start its namespace in time")

    def _shape(self) -> None:
        steps = [["ip", "link", "set", "lo", "up"]]
        if self.rate_bps is not None:
            p = tbf_params(self.rate_bps, self.world)
            steps.append(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{p['rate_bps']}bit",
                          "burst", str(p["burst_bytes"]), "limit", str(p["limit_bytes"])])
        for step in steps:
            result = _run(self.wrap(step), check=False)
            if result.returncode != 0:
                raise LinkError(f"cannot shape the loopback in namespace {self.name} ({' '.join(step)}): "
                                f"{result.stderr.strip()}; refusing to run unshaped")
        show = _run(self.wrap(["tc", "qdisc", "show", "dev", "lo"]), check=False)
        self.qdisc = show.stdout.strip()
        if self.rate_bps is not None and "tbf" not in self.qdisc:
            raise LinkError(f"tbf qdisc missing on lo after setup ({self.qdisc!r}); refusing to run unshaped")

    def _remove(self) -> None:
        """Remove the namespace (the commands run inside it are their launcher's to stop)."""
        if self.kind == "netns" or (self.kind is None and self.mode != "unshare"):
            self._delete_netns(self.name)
        if self._holder is not None:
            if self._holder.poll() is None:
                self._holder.kill()
            try:
                self._holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------------ running inside

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside the namespace."""
        if self.kind == "netns":
            return ["ip", "netns", "exec", self.name, *argv]
        if self.kind == "unshare":
            return ["nsenter", "-t", str(self._holder.pid), "-U", "-n", "--preserve-credentials", *argv]
        raise LinkError("the link is not open")

    def exists(self) -> bool:
        """Whether the namespace is currently there."""
        if self.kind == "netns":
            return self.name in self.list_netns()
        if self.kind == "unshare":
            return self._holder is not None and self._holder.poll() is None
        return False
