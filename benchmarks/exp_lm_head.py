"""What a quantized LM head would save at batch 1: the llama-3.2-3b head (128256 x 3072) as one
bf16 product (cuBLAS, and the dense Triton GEMV where the table has a tile), as the W4A16 GEMV
(group 128) and as the FP8 GEMV, each timed over a few tiles in a CUDA graph of calls cycling
past L2. A diagnostic for deciding whether to quantize the head, not a benchmark of record.

    python benchmarks/exp_lm_head.py [--n 128256 --k 3072]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from llmaccel.kernels.gemv_fp8 import GemvFp8Config, fp8_gemv
    from llmaccel.kernels.gemv_w4 import GemvW4Config, w4a16_gemv
    from llmaccel.models.layers.quantization import dense_linear

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=128256)
    ap.add_argument("--k", type=int, default=3072)
    args = ap.parse_args()
    n, k, dev = args.n, args.k, torch.device("cuda")
    import tune_gemm as tg  # run as a script, this folder is on sys.path (never imported)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    rows = [("bf16 F.linear (cuBLAS)", tg.time_graph(
        lambda i: torch.nn.functional.linear(x, dense[i]), 2, 8), 2 * n * k),
            ("bf16 dense_linear (table)", tg.time_graph(
                lambda i: dense_linear(x, dense[i], None, True), 2, 8), 2 * n * k)]
    w4 = tg.make_weights(4, n, k, 128, 4, dev)
    for cfg in (GemvW4Config(16, 256, 1, 3, 4), GemvW4Config(16, 512, 2, 3, 2),
                GemvW4Config(8, 512, 2, 3, 2), GemvW4Config(32, 256, 2, 3, 4)):
        us = tg.time_graph(lambda i, c=cfg: w4a16_gemv(x, w4[i][0], w4[i][1], None, 128,
                                                        None, c), 4, 16)
        rows.append((f"int4-g128 GEMV {cfg.describe()}", us, n * k // 2 + 2 * n * k // 128))
    f8 = [((torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
           torch.rand(n, 1, device=dev) * 0.01) for _ in range(3)]
    for cfg in (GemvFp8Config(4, 1024, 1, 2, prequant=True),
                GemvFp8Config(2, 2048, 1, 2, prequant=True),
                GemvFp8Config(8, 1024, 2, 2, prequant=True)):
        us = tg.time_graph(lambda i, c=cfg: fp8_gemv(x, f8[i][0], f8[i][1], None, c), 3, 12)
        rows.append((f"fp8 GEMV {cfg.describe()}", us, n * k + 4 * n))
    print(f"LM head {n} x {k}, batch 1, {torch.cuda.get_device_name()}")
    for name, us, nbytes in rows:
        print(f"{name:<40} {us:8.1f} us  {nbytes / us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
