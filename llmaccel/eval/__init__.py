"""Measurement of model quality: perplexity (docs/workloads.md W6)."""
