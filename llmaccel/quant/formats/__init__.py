"""Checkpoint layouts: pack a `QuantizedWeight` as vLLM/transformers expect it, and unpack one.

Each format module has `pack_*`, `unpack_*` and the `quantization_config` dict for config.json.
"""
