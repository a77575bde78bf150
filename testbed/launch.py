"""Launch ranks with torchrun and wait for them: :func:`torchrun_argv` builds one host's ``torchrun`` command
(``--standalone``, or a c10d rendezvous at host 0's fixed port in a fresh namespace); :class:`Launch` starts the
commands, echoes their output, and on failure names the rank that failed first (torchrun's "Root Cause" report: a
signal's victim before a rank that exited with an error).
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

__all__ = ["RankFailed", "Launch", "torchrun_argv", "exit_reason", "RDZV_PORT"]

RDZV_PORT = 29400
"""The rendezvous port on host 0 of emulated hosts (a fresh namespace: always free)."""


class RankFailed(RuntimeError):
    """A rank exited with an error or was killed; ``rank`` and ``code`` say which and how."""

    def __init__(self, message: str, rank: Optional[int] = None, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.code = code


def exit_reason(code: int) -> str:
    """``-9`` -> ``"killed by SIGKILL"``, ``1`` -> ``"exit code 1"``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def torchrun_argv(module: str, args: Sequence[str], nproc_per_host: int, *, hosts: int = 1, host: int = 0,
                  rdzv_addr: Optional[str] = None, local_addr: Optional[str] = None,
                  run_id: str = "testbed") -> list[str]:
    """The ``torchrun`` command that runs ``python -m module args`` as ``nproc_per_host`` ranks of host ``host``.

    One host: ``--standalone`` (torchrun picks a free port). Several: every host's torchrun meets
    at ``rdzv_addr:RDZV_PORT`` (host 0), each announcing ``local_addr``, so no host name is ever
    looked up (a namespace has no resolver for them).
    """
    if nproc_per_host < 1 or hosts < 1 or not 0 <= host < hosts:
        raise ValueError(f"bad launch shape: {hosts} hosts x {nproc_per_host} ranks, host {host}")
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_host}", "--max-restarts=0",
            "--monitor-interval=0.1"]
    if hosts == 1:
        argv.append("--standalone")
    else:
        if rdzv_addr is None:
            raise ValueError("several hosts need rdzv_addr (host 0's address)")
        # host 0 serves the rendezvous store: said outright, since torchrun's own test (the endpoint
        # resolves to this machine's host name) fails in a namespace. c10d numbers the hosts by
        # arrival; each host's ranks stay consecutive (rank // nproc_per_host is the host)
        argv += [f"--nnodes={hosts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_addr}:{RDZV_PORT}",
                 f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(host == 0)}"]
        if local_addr:
            argv.append(f"--local-addr={local_addr}")
    return argv + ["-m", module, *args]


_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class _Echo(threading.Thread):
    """Copies a torchrun's stderr to ours as it comes (progress bars redraw with ``\\r``, not
    lines, so it is copied in chunks, each line's start prefixed with the host) and keeps its
    "Root Cause" report (rank, exit code), read line by line on the side."""

    def __init__(self, fd: int, prefix: str) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.prefix = prefix
        self.failures: list[tuple[int, int]] = []
        self.root: list[tuple[int, int]] = []
        """The failures torchrun lists under "Root Cause (first observed failure)"."""
        self._rank: Optional[int] = None
        self._in_root = False

    def run(self) -> None:
        line, at_start = "", True
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may straddle two reads
        while chunk := os.read(self.fd, 1 << 16):
            text = raw = decoder.decode(chunk)
            if self.prefix:  # at each line's start (after a newline), not after a progress bar's \r
                pieces = re.split(r"(?<=\n)", text)
                text = "".join(
                    (self.prefix if at_start or i else "") + piece for i, piece in enumerate(pieces) if piece
                )
                at_start = text.endswith("\n")
            sys.stderr.write(text)
            sys.stderr.flush()
            *complete, line = (line + raw).split("\n")
            for finished in complete:
                self._read(finished)
        self._read(line)
        os.close(self.fd)

    def _read(self, line: str) -> None:
        if "Root Cause" in line:
            self._in_root = True
        elif line.startswith("====="):
            self._in_root = False
        if (match := _ROOT_RANK.match(line)) is not None:
            self._rank = int(match.group(1))
        elif self._rank is not None and (match := _ROOT_CODE.match(line)) is not None:
            (self.root if self._in_root else self.failures).append((self._rank, int(match.group(1))))
            self._rank = None


class Launch:
    """torchrun processes (one per host) in flight; :meth:`wait` returns when all succeeded.

    ``wrap(host, argv)`` prefixes a host's command (e.g. to enter its namespace); ``env`` is every
    process's environment (plus ``env_per_host[host]``). The processes are killed by pid if the
    caller leaves early (an exception, Ctrl-C) or a host fails and the others outlive ``grace_s``.
    """

    def __init__(self, argvs: Sequence[Sequence[str]], env: Optional[Mapping[str, str]] = None,
                 wrap: Optional[Callable[[int, Sequence[str]], list[str]]] = None,
                 env_per_host: Optional[Sequence[Mapping[str, str]]] = None) -> None:
        self.procs: list[subprocess.Popen] = []
        self._echoes: list[_Echo] = []
        base = dict(os.environ if env is None else env)
        try:
            for host, argv in enumerate(argvs):
                full = wrap(host, argv) if wrap is not None else list(argv)
                host_env = {**base, **(env_per_host[host] if env_per_host else {})}
                read_end, write_end = os.pipe()
                try:
                    proc = subprocess.Popen(full, env=host_env, stderr=write_end, start_new_session=True)
                except BaseException:
                    os.close(read_end)
                    raise
                finally:
                    os.close(write_end)
                self.procs.append(proc)
                echo = _Echo(read_end, f"[host {host}] " if len(argvs) > 1 else "")
                echo.start()
                self._echoes.append(echo)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """Kill every process of every host (each torchrun leads its own session: its ranks too)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def failures(self) -> list[tuple[int, int]]:
        """``(rank, exit code)`` of every failed rank torchrun reported: its root causes first (one per
        host; a signal's victim before an error exit), then the ranks it stopped."""
        order = lambda rc: (rc[1] > 0, rc[0])  # noqa: E731
        root = sorted({f for echo in self._echoes for f in echo.root}, key=order)
        rest = sorted({f for echo in self._echoes for f in echo.failures} - set(root), key=order)
        return root + rest

    def wait(self, deadline_s: Optional[float] = None, grace_s: float = 60.0, what: str = "ranks",
             poll_s: float = 0.2) -> None:
        """Wait for every host. A failed host gives the others ``grace_s`` to notice, then all are
        killed and :class:`RankFailed` names the first rank that failed. ``deadline_s`` (seconds from
        now, ``None``: none) bounds the whole wait."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        failed_at: Optional[float] = None
        try:
            while any(proc.poll() is None for proc in self.procs):
                now = time.monotonic()
                if failed_at is None and (
                    any(proc.returncode not in (None, 0) for proc in self.procs)
                    or any(echo.root for echo in self._echoes)
                ):  # a host's torchrun may linger after its report
                    failed_at = now
                if failed_at is not None and now - failed_at > grace_s:
                    break
                if deadline is not None and now > deadline:
                    raise RankFailed(f"{what} did not finish within {deadline_s:.0f} s")
                time.sleep(poll_s)
        finally:
            self.kill()
            for echo in self._echoes:
                echo.join(timeout=5)
        codes = [proc.returncode for proc in self.procs]
        if all(code == 0 for code in codes) and not any(echo.root for echo in self._echoes):
            return
        failures = self.failures()
        if failures:
            rank, code = failures[0]
            others = ", ".join(f"rank {r}: {exit_reason(c)}" for r, c in failures[1:])
            raise RankFailed(f"rank {rank} failed first ({exit_reason(code)}{'; ' + others if others else ''})", rank,
                             code)
        bad = ", ".join(f"host {h}: {exit_reason(c) if c is not None else 'still running'}"
                        for h, c in enumerate(codes) if c != 0)
        raise RankFailed(f"{what} failed ({bad}); see the output above")
