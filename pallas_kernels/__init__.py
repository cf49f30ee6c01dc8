"""Attention and KV-cache kernels: a plain-jnp reference for each, Pallas backends by platform."""
