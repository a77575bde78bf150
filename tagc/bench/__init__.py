"""Benchmarks: ``python -m tagc.bench NAME [args...]`` (or ``tagc-bench NAME``); ``--help`` lists them."""
