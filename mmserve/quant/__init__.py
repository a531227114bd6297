"""Quantized weights: mmserve's packed layout (layout.py), the linear layer over it (linear.py), quantizing a
bf16/fp32 checkpoint on load (quantize.py) and reading the published formats (formats.py, checkpoint.py)."""
