import pytest

from tagc.config import TAGCConfig
from tagc.sketch import plan_density


def test_defaults_are_valid():
    cfg = TAGCConfig()
    assert cfg.ratio == 10.0 and cfg.index_bits == 1 and cfg.sparsity == "auto" and cfg.fallback == "estimate"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ratio": 1}, "ratio"),
        ({"ratio": 0.5}, "ratio"),
        ({"ratio": float("nan")}, "ratio"),
        ({"ratio": "10"}, "ratio"),
        ({"ratio": 5000}, "ratio"),
        ({"index_bits": 2}, "index_bits must be 1 or 4"),
        ({"index_bits": True}, "index_bits"),
        ({"sparsity": 1.0}, "sparsity"),
        ({"sparsity": -0.1}, "sparsity"),
        ({"sparsity": "most"}, "sparsity"),
        ({"lane": 3}, "lane"),
        ({"lane": 2048}, "lane"),
        ({"seed": -1}, "seed"),
        ({"fallback": "guess"}, "fallback"),
        ({"min_compress_numel": -5}, "min_compress_numel"),
    ],
)
def test_bad_values_raise_with_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TAGCConfig(**kwargs)


def test_density_auto_and_manual():
    assert TAGCConfig(ratio=10).density(4) == pytest.approx(plan_density(10, 4))
    assert TAGCConfig(sparsity=0.9).density(4) == pytest.approx(0.1)
    assert TAGCConfig(sparsity=0.0).density(2) == 1.0


def test_replace_revalidates():
    with pytest.raises(ValueError):
        TAGCConfig().replace(index_bits=3)
    assert TAGCConfig().replace(ratio=5).ratio == 5.0
