"""The shaped link (testbed.link): rates, tbf parameters, and its private namespace made and removed."""

import subprocess

import pytest

from testbed.link import LinkError, ShapedLink, format_rate, parse_rate, tbf_params


def open_or_skip(link: ShapedLink) -> ShapedLink:
    try:
        link.open()
    except LinkError as err:
        pytest.skip(f"network namespaces / tc not permitted here: {err}")
    return link


# ---------------------------------------------------------------------------- (c) rates


@pytest.mark.parametrize("text, bps", [
    ("10gbit", 10**10), ("1gbit", 10**9), ("100mbit", 10**8), ("250mbit", 250 * 10**6), ("1.5gbit", 15 * 10**8),
    ("800kbit", 800_000), ("125mbps", 10**9), ("10GBit", 10**10), (" 1gbit ", 10**9), ("5000", 5000),
])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["none", "None", "unshaped"])
def test_parse_rate_none_means_unshaped(text):
    assert parse_rate(text) is None


@pytest.mark.parametrize("text", ["", "fast", "10 gigabit", "-1gbit", "0", "1gbit/s", "1e9"])
def test_parse_rate_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_rate(text)


def test_format_rate_round_trips():
    for text in ("10gbit", "1gbit", "100mbit", "250mbit", "1.5gbit"):
        assert format_rate(parse_rate(text)) == text
    assert format_rate(None) == "none"


def test_tbf_is_shared_so_it_gets_world_times_the_rate():
    assert tbf_params(10**9, 2)["rate_bps"] == 2 * 10**9
    assert tbf_params(10**9, 4)["rate_bps"] == 4 * 10**9
    assert tbf_params(10**9, 2)["burst_bytes"] == 1 << 20
    assert tbf_params(10**8, 2)["burst_bytes"] == 256 << 10


# ---------------------------------------------------------------------------- (a) the namespace


def test_link_creates_shapes_and_removes_its_namespace():
    link = open_or_skip(ShapedLink("100mbit", world=2, mode="netns"))
    try:
        assert link.exists() and link.name in ShapedLink.list_netns()
        assert "tbf" in link.qdisc and "200Mbit" in link.qdisc
        out = subprocess.run(link.wrap(["cat", "/proc/net/dev"]), capture_output=True, text=True, timeout=30).stdout
        devices = [line.split(":")[0].strip() for line in out.splitlines() if ":" in line]
        assert devices == ["lo"]  # private: only its own loopback
    finally:
        link.close()
    assert not link.exists() and link.name not in ShapedLink.list_netns()


def test_link_is_removed_after_an_exception_inside():
    probe = open_or_skip(ShapedLink("1gbit", mode="netns"))
    probe.close()
    name = None
    with pytest.raises(ZeroDivisionError):
        with ShapedLink("1gbit", world=2, mode="netns") as link:
            name = link.name
            assert name in ShapedLink.list_netns()
            raise ZeroDivisionError
    assert name is not None and name not in ShapedLink.list_netns()


def test_unshare_fallback_holds_and_releases_its_namespace():
    link = open_or_skip(ShapedLink("1gbit", world=2, mode="unshare"))
    try:
        assert link.kind == "unshare" and link.exists() and "tbf" in link.qdisc
        holder = link._holder
    finally:
        link.close()
    assert holder.poll() is not None and not link.exists()
