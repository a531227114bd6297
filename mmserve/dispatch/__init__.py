"""Dispatch of multimodal items to encoder services: encoder registry and routing policies."""
