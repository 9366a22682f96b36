"""Benchmarks: load generators, scenarios, peers side by side (never in the engine's hot path)."""
