"""mmserve: multimodal LLM serving with encode-prefill-decode disaggregation."""

__version__ = "0.1.0"
