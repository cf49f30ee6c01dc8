"""Host-side engine core: plain Python + numpy. Nothing here may import jax."""
