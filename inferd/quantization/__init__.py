"""Weight quantization: formats, GGUF block mapping, the --quantization policy."""
