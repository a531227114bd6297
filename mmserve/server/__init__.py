"""OpenAI-compatible API server: validation, chat template, tokenization, detokenization, streaming."""
