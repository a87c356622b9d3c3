"""The formats the runtime reads: GGUF files, engine directories, their manifest, quantized layouts,
the int8 KV codec."""
