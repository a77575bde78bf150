"""The exchange engine: the hook, its settings, plans, state, eager and traced paths, transport, statistics.

``core`` may import ``tagc.sketch``, ``tagc.kernels``, ``tagc.config``, ``backward_drain`` and the codec interface
of :mod:`tagc.hooks.codecs`; it imports no adapter (``tests/test_house.py``): an adapter plugs into it, never the
other way round.
"""
