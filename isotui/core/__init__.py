"""Pure numerics: streaming accumulators and isotropy metrics (no I/O, no Textual)."""
