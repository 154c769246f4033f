"""Runs a model over samples: batching, device and dtype, masking, accumulators, back-off."""
