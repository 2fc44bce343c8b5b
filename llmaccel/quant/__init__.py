"""Weight quantization (RTN, GPTQ, AWQ, HQQ, NF4, FP8) and the checkpoint formats
vLLM/transformers read.

Integer algorithms produce a `QuantizedWeight` (unsigned codes, scales, zero points per group);
`formats/` packs it into a checkpoint layout and unpacks third-party checkpoints. NF4 and FP8
have their own weight types and formats (bitsandbytes; compressed-tensors float-quantized).
"""
