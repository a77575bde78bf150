"""The shaped-link helper and the gradient-exchange benchmark (python -m testbed.exchange)."""

import json
import math
import os
import signal
import subprocess

import pytest

from testbed import exchange
from testbed.link import LinkError, ShapedLink, format_rate, parse_rate, tbf_params


@pytest.fixture(autouse=True)
def keep_sigterm_default():
    """``exchange.main`` turns SIGTERM into a clean exit for its own process; run inside pytest,
    the handler must not outlive the test (a later SIGTERM would surface as some other test's failure)."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


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
        (proc,) = link.launch([["cat", "/proc/net/dev"]], stdout=subprocess.PIPE, text=True)
        devices = [line.split(":")[0].strip() for line in proc.communicate(timeout=30)[0].splitlines() if ":" in line]
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


# ---------------------------------------------------------------------------- (b) the benchmark


def check_rows(rows, links):
    assert {r["link"] for r in rows} == set(links)
    methods = {r["method"] for r in rows}
    assert {"fair fp32", "fair bf16", "tagc r10", "tagc r10 lean"} <= methods
    for row in rows:
        for key in exchange.REQUIRED_KEYS:
            assert key in row, key
        for key in ("ms_per_mb", "wire_bytes_per_rank", "ratio_to_fair_baseline"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["method"], key, row[key])
        if row["method"].startswith("tagc"):
            assert 0 < row["peel_success"] <= 1
            assert abs(row["wire_bytes_per_rank"] - row["formula_wire_bytes"]) <= 0.05 * row["formula_wire_bytes"]
            assert row["wire_bytes_per_rank"] < row["plain_fp32_bytes_per_rank"] / 5
    fair = [r for r in rows if r["method"] == "fair fp32"]
    assert all(r["ratio_to_fair_baseline"] == 1.0 for r in fair)


@pytest.mark.slow  # 9 s: a whole benchmark run; the rows' arithmetic is checked by the tests above
def test_quick_unshaped_run_writes_json_rows(tmp_path):
    path = tmp_path / "rows.json"
    _quick_run(path, "none", "128K")
    rows = json.loads(path.read_text())
    check_rows(rows, ["none"])
    assert all(r["lo_bytes_per_rank"] is None for r in rows)  # not in a private namespace: not counted
    check_codec_rows(rows)


CODECS = "bf16,fp8,int4,sign,topk,powersgd"


def _quick_run(path, link: str, size: str) -> None:
    """The quick exchange benchmark of every peer codec at one size on ``link``, its rows written to ``path``."""
    exchange.main(["--quick", "--link", link, "--sizes", size, "--json", str(path), "--no-progress",
                   "--timeout", "120", "--codecs", CODECS])


def check_codec_rows(rows):
    """Every peer codec ran, and (one-round codecs) counted exactly the bytes its wire shapes give."""
    codec_rows = {r["method"]: r for r in rows if r["kind"] == "codec"}
    assert set(codec_rows) == {f"codec {name}" for name in CODECS.split(",")} | {"codec topk lean"}
    for row in codec_rows.values():
        assert 0 < row["wire_bytes_per_rank"] < row["plain_fp32_bytes_per_rank"]
        assert row["bits_per_param"] == 8 * row["wire_bytes_per_rank"] / row["numel"]
        if row["formula_wire_bytes"] is not None:
            assert row["wire_bytes_per_rank"] == row["formula_wire_bytes"], row["method"]
    assert codec_rows["codec powersgd"]["formula_wire_bytes"] is None  # several rounds: counted only
    assert codec_rows["codec topk lean"]["bits_per_param"] < 0.55 * codec_rows["codec topk"]["bits_per_param"]
    tagc_rows = {r["method"]: r for r in rows if r["kind"] == "tagc"}
    lean, bitmap = tagc_rows["tagc r10 lean"], tagc_rows["tagc r10"]
    assert lean["wire_bytes_per_rank"] == lean["formula_wire_bytes"]  # the hook's planned wire, counted
    assert lean["bits_per_param"] <= 1.1 < bitmap["bits_per_param"]  # the lean wire's target at N = 2
    assert codec_rows["codec topk lean"]["bits_per_param"] <= 0.45


@pytest.mark.slow
def test_quick_shaped_run_is_really_shaped(tmp_path):
    open_or_skip(ShapedLink("100mbit")).close()
    path = tmp_path / "rows.json"
    _quick_run(path, "100mbit", "512K")
    rows = json.loads(path.read_text())
    check_rows(rows, ["100mbit"])
    check_codec_rows(rows)
    fair = next(r for r in rows if r["method"] == "fair fp32")
    wire_s = 8 * fair["wire_bytes_per_rank"] / 1e8
    assert fair["median_s"] >= 0.8 * wire_s  # 2 MB at 100 Mbit: ~170 ms; unshaped it is a few ms
    for row in (
        rows
    ):  # the loopback's own counter agrees with the counted bytes (headers and timing traffic aside), every codec
        assert row["lo_bytes_per_rank"] == pytest.approx(row["wire_bytes_per_rank"], rel=0.1, abs=20_000)
    assert not [n for n in ShapedLink.list_netns() if n.startswith(f"tagc-{os.getpid()}-")]


def test_bucket_layout_is_fsdp2_like():
    segments, chunk = exchange.bucket("mlp", 2)
    assert chunk == 768 * 3072 and [s[2] for s in segments] == [768 * 3072 // 2] * 2
    segments, chunk = exchange.bucket("1000", 3)
    assert segments == [("w.weight", 0, 334)] and chunk == 334
    with pytest.raises(ValueError):
        exchange.bucket("huge", 2)
