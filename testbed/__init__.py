"""Experiment tooling, outside the library: emulated links and hosts, the torchrun launcher
and the TAGC paper's reference numbers. ``tagc`` and
``fsdp_integration`` never import it; ``gpt2_bench`` and the tests do."""
