"""Benchmarks: performance is measured side by side in one run, as ratios, never in timed tests."""
