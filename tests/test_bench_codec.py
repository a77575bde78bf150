"""Smoke test of ``python -m tagc.bench codec --quick``."""

import argparse
import json
import math

import pytest

from tagc.bench.__main__ import main as bench_main
from tagc.bench.codec import main, parse_sizes


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_codec_quick(tmp_path, capsys):
    out = tmp_path / "codec.json"
    main(["--quick", "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result) >= {"peeling", "peeling_thresholds"}
    assert result["peeling"]
    for row in result["peeling"]:
        assert _positive(row["load"]) and _positive(row["trials"]) and _positive(row["recovered"])
        assert 0.0 <= row["success"] <= 1.0 and 0.0 <= row["peel_only"] <= row["success"]
    low = min(result["peeling"], key=lambda r: r["load"])
    assert low["success"] == 1.0  # load 0.5 always peels

    assert "measured threshold" in capsys.readouterr().out


def test_parse_sizes():
    assert parse_sizes("1M,64k,1000") == [1 << 20, 64 << 10, 1000]
    with pytest.raises(argparse.ArgumentTypeError, match="bad size"):
        parse_sizes("1X")


def test_dispatch_unknown_name():
    with pytest.raises(SystemExit, match="codec"):
        bench_main(["nope"])
