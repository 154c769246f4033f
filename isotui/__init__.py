"""isotui: a terminal lab for the geometry (anisotropy) of neural representations."""

__version__ = "0.1.0"
