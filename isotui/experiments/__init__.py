"""One module per experiment; each takes a spec and returns a typed result."""
