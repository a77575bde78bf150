"""The TAGC paper's reference numbers (GPT-2 ~162M, 2 nodes x RTX 3080, 10 Gbit Ethernet): the bar
the benchmarks compare against, in one place."""

LINK_BPS = 10 * 10**9
"""The paper's inter-node link."""

EXCHANGE_SHARE = 0.31
"""Share of the paper's FSDP iteration spent in the gradient exchange, from its own table:
TAGC cut exchange ms/MB from 0.76 to 0.51 (x0.67) and the iteration from 25.2 to 22.6, so
the exchange was 2.6 / (1 - 0.67) = 7.9 of 25.2 units. ``--link scaled`` reproduces it."""

TABLE = [  # GPT-2 ~162M, 2 nodes x RTX 3080, 10 Gbit: iteration (ms) and exchange ms per MB
    {"algorithm": "fsdp", "compressed": "all", "iter": 26.8, "exchange_ms_per_mb": 0.73},
    {"algorithm": "tagc", "compressed": "all", "iter": 28.5, "exchange_ms_per_mb": 0.64},
    {"algorithm": "fsdp", "compressed": "non-attn", "iter": 25.2, "exchange_ms_per_mb": 0.76},
    {"algorithm": "tagc", "compressed": "non-attn", "iter": 22.6, "exchange_ms_per_mb": 0.51},
]
