"""mmserve: multimodal LLM serving with encode-prefill-decode disaggregation."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import mmserve` (the CLI) must not pay for torch and transformers.
    if name == "LLM":
        from mmserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mmserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from mmserve import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
