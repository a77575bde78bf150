"""The codecs: the interface and plain and TAGC (:mod:`~tagc.hooks.codecs.codec`), the peers (``topk``, ``sign``,
``quantized``, ``powersgd``), EF21's error feedback (``feedback``) and the registry of names (``registry``, ``spec``).

A codec owns its wire and its exchange forms, all in its own file; nothing outside that file names its class.
Codecs import the engine's ``core`` modules they run on (transport, statistics, the all-reduce form's interface),
never an adapter.
"""
