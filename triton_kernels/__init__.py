"""Triton kernels called through jax-triton (GPU only), with the same signatures as their Pallas twins."""
