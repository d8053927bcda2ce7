"""Pallas kernels for TPU (Mosaic): mixed-rank LoRA over the unified pool and paged attention."""
