"""Typed messages and channels between processes; msgpack / raw bytes only, never pickle."""
