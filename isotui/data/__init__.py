"""Sources of samples: deterministic given their spec, fingerprinted by the content they yield."""
