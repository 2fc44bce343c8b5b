"""llmaccel: analyze, fine-tune, quantize, speculate, serve and measure causal LMs."""

__version__ = "0.1.0"
