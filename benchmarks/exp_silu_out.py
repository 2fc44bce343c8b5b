"""Experiment (not a benchmark of record): the int4 gate_up GEMV on the llama-3.2-3b shape,
plain then silu_and_mul, against the same GEMV with SiLU-and-mul in its epilogue (silu_out),
each call in a CUDA graph of many, weights cycled past L2, PDL as in the engine."""
import importlib.util
from pathlib import Path

import torch

from llmaccel.kernels import pdl
from llmaccel.kernels.activation import silu_and_mul
from llmaccel.kernels.gemm_tuning import gemv_w4_config
from llmaccel.kernels.gemv_w4 import GemvW4Config, w4a16_gemv

spec = importlib.util.spec_from_file_location("tg", Path(__file__).with_name("tune_gemm.py"))
tg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tg)
dev = torch.device("cuda")
pdl.configure(dev, requested=True)
n, k, group = 16384, 3072, 128
copies = 12
ws = tg.make_weights(4, n, k, group, copies, dev)
x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
cfg0 = gemv_w4_config(n, k, group, dev)
print("table tile", cfg0 and cfg0.describe())
for cfg in [cfg0, GemvW4Config(16, 256, 1, 3, 4), GemvW4Config(16, 512, 2, 3, 2),
            GemvW4Config(32, 256, 2, 3, 4), GemvW4Config(8, 512, 1, 3, 2)]:
    if cfg is None:
        continue
    plain = tg.time_graph(lambda i: w4a16_gemv(x, ws[i][0], ws[i][1], None, group, config=cfg),
                          copies, 48)
    pair = tg.time_graph(lambda i: silu_and_mul(
        w4a16_gemv(x, ws[i][0], ws[i][1], None, group, config=cfg)), copies, 48)
    fused = tg.time_graph(lambda i: w4a16_gemv(x, ws[i][0], ws[i][1], None, group, config=cfg,
                                               silu_out=True), copies, 48)
    print(f"{cfg.describe():<18} gemv {plain:6.2f} us | gemv + silu_and_mul {pair:6.2f} us | "
          f"silu_out {fused:6.2f} us")
