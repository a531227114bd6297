"""Multimodal core: items and hashing, media loading, per-family processors, embedding splice, cache."""
