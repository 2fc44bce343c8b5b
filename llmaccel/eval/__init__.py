"""Measurement of model quality: perplexity (BENCHMARKS.md W6)."""
