"""Encoder: vision tower + media pipeline + embedding cache, in-process (monolithic) or as a service."""
