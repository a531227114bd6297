"""Multimodal core: items and hashing, media loading, chat messages, embedding splice, cache. Model-specific
preprocessing lives with each model family (mmserve.models)."""
