"""Model families, their registry, and weight loading (safetensors and GGUF)."""
