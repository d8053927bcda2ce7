"""Pallas kernels: each file holds its kernel, its jnp reference and its public wrapper."""
