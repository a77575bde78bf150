"""TAGC: compressed gradient reduce-scatter for sharded training over slow networks."""

from tagc.config import TAGCConfig

__version__ = "0.1.0"
__all__ = ["TAGCConfig", "__version__"]
