"""Why the row-norm tail made whole steps slower: per call, in a CUDA graph, an int4 o/down GEMV
with the residual epilogue followed by the separate RMSNorm kernel, against the same GEMV with
the norm in its last program; the compiled kernels' registers and spills with and without the
tail; and whether the 'whole row in one tile' int4 tiles agree with the reference on the GPU
(they gave other greedy tokens in a whole step). A diagnostic, not a benchmark of record.

    python benchmarks/exp_norm_tail_kernel.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def _tune_gemm():
    spec = importlib.util.spec_from_file_location("tune_gemm",
                                                  Path(__file__).with_name("tune_gemm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    from llmaccel.kernels import gemv_w4
    from llmaccel.kernels.gemm import linear_ref
    from llmaccel.kernels.gemm_tuning import gemv_w4_config
    from llmaccel.kernels.gemv_common import RowNormTail
    from llmaccel.kernels.gemv_w4 import GemvW4Config, w4a16_gemv
    from llmaccel.kernels.rmsnorm import rms_norm

    tg = _tune_gemm()
    dev = torch.device("cuda")
    group = 128
    for name, n, k in (("o", 3072, 3072), ("down", 3072, 8192)):
        cfg = gemv_w4_config(n, k, group, dev)
        copies = 64
        ws = tg.make_weights(4, n, k, group, copies, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
        nw = torch.rand(n, device=dev, dtype=torch.bfloat16) + 0.5
        tail = RowNormTail(nw, 1e-5, torch.zeros(1, dtype=torch.int32, device=dev),
                           torch.empty(n, device=dev, dtype=torch.bfloat16))

        def plain(i):
            w4a16_gemv(x, ws[i][0], ws[i][1], None, group, None, cfg, residual=res)

        def separate(i):
            plain(i)
            rms_norm(res, nw, 1e-5)

        def tailed(i):
            w4a16_gemv(x, ws[i][0], ws[i][1], None, group, None, cfg, residual=res,
                       norm_tail=tail)

        t = {f: tg.time_graph(fn, copies, 128) for f, fn in
             (("gemv", plain), ("gemv+rms_norm", separate), ("gemv+tail", tailed))}
        print(f"{name} {n}x{k} {cfg.describe()}: " + " | ".join(
            f"{f} {us:6.2f} us" for f, us in t.items()))
    # registers and spills of every compiled variant (the tail's code could crowd the loop)
    try:
        for dev_cache in gemv_w4._gemv_w4_kernel.device_caches.values():
            for key, kern in dev_cache[0].items():
                tail = "TAIL" in str(key) and "('TAIL', 1)" in str(key)
                print(f"kernel regs {kern.n_regs} spills {kern.n_spills} tail {tail} "
                      f"{str(key)[-160:]}")
    except Exception as e:  # noqa: BLE001 (Triton's cache layout differs between versions)
        print("no register counts:", type(e).__name__, e)
    # the whole-row tiles of exp_step_tiles, eager, against the reference
    for n, k, c in ((3072, 3072, GemvW4Config(4, 4096, 4, 2, 4)),
                    (3072, 8192, GemvW4Config(4, 8192, 8, 2, 4)),
                    (5120, 3072, GemvW4Config(4, 4096, 4, 2, 4))):
        w, s, _ = tg.make_weights(4, n, k, group, 1, dev)[0]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = linear_ref(x.float(), w, 4, s.float(), None, group)
        got = w4a16_gemv(x, w, s, None, group, None, c).float()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        print(f"whole-row tile {c.describe()} on {n}x{k}: max error {err:.3g} of max |y|")


if __name__ == "__main__":
    main()
