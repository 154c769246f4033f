"""isotui's version: recorded in every result and cache entry, so that the experiments read it
from here, below them, rather than from the package that exposes the API above them."""

__version__ = "0.1.0"
