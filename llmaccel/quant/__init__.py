"""Weight quantization (RTN, GPTQ, AWQ, FP8) and the checkpoint formats vLLM/transformers read.

Algorithms produce a `QuantizedWeight` (unsigned codes, scales, zero points per group);
`formats/` packs it into a checkpoint layout and unpacks third-party checkpoints.
"""
