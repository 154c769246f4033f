"""On-disk cache of results and exports (CSV, JSON). No pickle anywhere."""
