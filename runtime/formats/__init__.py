"""The formats the runtime reads: engine directories, their manifest, quantized layouts, the int8 KV codec."""
