"""Emulated hosts (testbed.hosts): namespaces made and always removed, shaped veths, byte counters,
and torchrun across them (testbed.launch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from testbed.hosts import EmulatedHosts
from testbed.launch import Launch, RankFailed, torchrun_argv
from testbed.link import LinkError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _can_make_namespaces() -> bool:
    try:
        with EmulatedHosts(2, "none"):
            return True
    except LinkError:
        return False


needs_netns = pytest.mark.skipif(not _can_make_namespaces(), reason="emulated hosts need root (ip netns)")


def _tx_bytes(hosts: EmulatedHosts, host: int) -> int:
    """Bytes host ``host`` has sent to the other hosts so far (its ``eth0`` transmit counter)."""
    shown = subprocess.run(["ip", "-n", hosts.namespace(host), "-j", "-s", "link", "show", "dev", "eth0"],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])


def _ours(hosts: EmulatedHosts) -> list[str]:
    return [name for name in EmulatedHosts.list_netns() if name.startswith(hosts.name + "-")]


def test_bad_host_counts_are_clear_errors():
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match="hosts must be an integer from 2"):
            EmulatedHosts(bad, "1gbit")
    with pytest.raises(ValueError, match="bad link rate"):
        EmulatedHosts(2, "fast")


@needs_netns
def test_hosts_are_made_shaped_and_removed_on_success_and_on_error():
    hosts = EmulatedHosts(3, "100mbit")
    with hosts:
        assert sorted(_ours(hosts)) == sorted([hosts.switch] + [hosts.namespace(h) for h in range(3)])
        qdisc = subprocess.run(
            ["tc", "-n", hosts.namespace(1), "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        port = subprocess.run(
            ["tc", "-n", hosts.switch, "qdisc", "show", "dev", "p1"], capture_output=True, text=True
        ).stdout
        assert "tbf" in port  # the download direction is shaped too
    assert _ours(hosts) == [] and not hosts.exists()
    failing = EmulatedHosts(2, "100mbit")
    with pytest.raises(RuntimeError, match="boom"):
        with failing:
            assert failing.exists()
            raise RuntimeError("boom")
    assert _ours(failing) == []


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_hosts_are_removed_when_the_run_is_interrupted(tmp_path, sig):
    ready = tmp_path / "name"
    code = textwrap.dedent(f"""
        import time
        from testbed.hosts import EmulatedHosts
        with EmulatedHosts(2, "1gbit") as hosts:
            open({str(ready)!r}, "w").write(hosts.name)
            time.sleep(60)
    """)
    # a shell's background job inherits SIGINT ignored, and Python then installs no Ctrl-C handler: reset it
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for _ in range(300):
        if ready.exists() and ready.read_text():
            break
        time.sleep(0.1)
    name = ready.read_text()
    assert any(n.startswith(name + "-") for n in EmulatedHosts.list_netns())
    proc.send_signal(sig)
    assert proc.wait(timeout=30) != 0  # interrupted, not the 60 s sleep run out
    assert not any(n.startswith(name + "-") for n in EmulatedHosts.list_netns())


_SENDER = textwrap.dedent("""
    import socket, sys, time
    role, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, 5000)); s.listen(1)
        c, _ = s.accept(); got = 0
        while got < n:
            got += len(c.recv(1 << 20))
        c.close()
    else:
        for _ in range(100):
            try:
                c = socket.create_connection((addr, 5000)); break
            except OSError:
                time.sleep(0.05)
        t = time.perf_counter()
        c.sendall(b"x" * n); c.shutdown(socket.SHUT_WR); c.recv(1)
        print(time.perf_counter() - t)
""")


@needs_netns
def test_bytes_between_hosts_are_counted_and_paced_at_the_link_rate():
    """4 MB from host 0 to host 1 at 100 Mbit/s: about 0.34 s, and host 0's counter says 4 MB plus
    TCP/IP headers (a few %); traffic within a host (its own address) is not counted."""
    n = 4 << 20
    with EmulatedHosts(2, "100mbit") as hosts:
        before = [_tx_bytes(hosts, h) for h in range(2)]
        server = subprocess.Popen(hosts.wrap(1, [sys.executable, "-c", _SENDER, "server", hosts.address(1), str(n)]))
        client = subprocess.run(hosts.wrap(0, [sys.executable, "-c", _SENDER, "client", hosts.address(1), str(n)]),
                                capture_output=True, text=True, timeout=60)
        server.wait(timeout=60)
        sent = _tx_bytes(hosts, 0) - before[0]
        assert n <= sent <= 1.1 * n
        assert float(client.stdout) >= 0.9 * n * 8 / 100e6
        local = subprocess.Popen(hosts.wrap(0, [sys.executable, "-c", _SENDER, "server", hosts.address(0), str(n)]))
        subprocess.run(
            hosts.wrap(0, [sys.executable, "-c", _SENDER, "client", hosts.address(0), str(n)]),
            capture_output=True,
            timeout=60,
        )
        local.wait(timeout=60)
        assert _tx_bytes(hosts, 0) - before[0] - sent < 0.01 * n  # its own address: over its loopback


_ALL_REDUCE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((4,), float(rank))
    dist.all_reduce(x)
    host = rank // int(os.environ["LOCAL_WORLD_SIZE"])
    open(os.path.join(sys.argv[1], f"rank{rank}"), "w").write(f"{x[0].item()} {host} {os.environ['GROUP_RANK']}")
    if sys.argv[2] == "die" and rank == world - 1:
        os.kill(os.getpid(), 9)
    dist.destroy_process_group()
""")


@pytest.mark.slow
@needs_netns
def test_torchrun_across_emulated_hosts_and_a_dead_rank_is_named(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(_ALL_REDUCE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    for mode in ("ok", "die"):
        with EmulatedHosts(2, "1gbit") as hosts:
            argvs = [torchrun_argv("all_reduce", [str(tmp_path), mode], 2, hosts=2, host=h, rdzv_addr=hosts.address(0),
                                   local_addr=hosts.address(h), run_id=f"test-{mode}") for h in range(2)]
            launch = Launch(argvs, env=env, wrap=hosts.wrap, env_per_host=[hosts.env(h) for h in range(2)])
            if mode == "ok":
                launch.wait(deadline_s=120)
                results = [(tmp_path / f"rank{r}").read_text().split() for r in range(4)]
                assert all(float(value) == 0 + 1 + 2 + 3 for value, _, _ in results)
                assert all(int(host) == int(group) for _, host, group in results)  # a host's ranks are consecutive
                assert sum(_tx_bytes(hosts, h) for h in range(2)) > 0
            else:
                with pytest.raises(RankFailed, match=r"rank 3 failed first \(killed by SIGKILL") as failure:
                    launch.wait(deadline_s=120, grace_s=5)
                assert failure.value.rank == 3
        assert _ours(hosts) == []
