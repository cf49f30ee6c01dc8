"""Model families, their registry, and weight loading (safetensors, GGUF, orbax)."""
