"""Encoder: a model family's tower + media pipeline + embedding cache, local (beside the engine) or as a service."""
