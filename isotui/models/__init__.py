"""Model naming, fingerprints (cheap, no torch) and loading (transformers, lazily imported)."""
