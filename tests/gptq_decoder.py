"""GPTQ checkpoint decoder for the tests, written from the format's definition (not our
unpacker): python ints and shifts over the packed int32 words."""

import torch


def decode_gptq(t: dict[str, torch.Tensor], bits: int, zero_offset: int = 1) -> torch.Tensor:
    """W[o, i] = (code - (stored_zero + zero_offset)) * scales[g_idx[i], o], as vLLM's GPTQ
    kernels and transformers/GPTQModel compute it (v1: zero_offset 1, v2: 0). float64."""
    pf, mask = 32 // bits, (1 << bits) - 1
    qweight, qzeros = t["qweight"].tolist(), t["qzeros"].tolist()
    scales, g_idx = t["scales"].double().tolist(), t["g_idx"].tolist()
    in_features, out_features = len(qweight) * pf, len(qweight[0])
    w = torch.empty(out_features, in_features, dtype=torch.float64)
    for i in range(in_features):
        row, field = divmod(i, pf)
        g = g_idx[i]
        for o in range(out_features):
            code = ((qweight[row][o] & 0xFFFFFFFF) >> (bits * field)) & mask
            zword = qzeros[g][o // pf] & 0xFFFFFFFF
            zero = ((zword >> (bits * (o % pf))) & mask) + zero_offset
            w[o, i] = (code - zero) * scales[g][o]
    return w
