"""Tune the fused decode GEMVs on quantized weights (int4: kernels/gemv_w4.py; FP8:
kernels/gemv_fp8.py; each with the RMSNorm / SiLU-and-mul prologues and the residual epilogue)
as they run in a batch-1 decode step, and time the unfused chain the engine runs without them,
side by side.

    python benchmarks/tune_fused_decode_quant.py --formats int4,fp8 --models llama-3.2-3b \\
        [--out-table auto] [--out-jsonl fused-quant.jsonl] [--no-pdl] [--budget-s 150]

A CUDA graph of every layer's four GEMVs on random weights (int4: group 128, symmetric, bf16
scales; FP8: e4m3 with per-channel fp32 scales; each layer its own weights, so nothing stays
in L2), launched with programmatic
dependent launch as the engine does on Hopper. The unfused chain is what a decoder layer ran
before: add + RMSNorm kernel, qkv GEMV, o GEMV, add + RMSNorm kernel, gate_up GEMV,
SiLU-and-mul kernel, down GEMV (the plain GEMV tiles of the table). Rotary embedding and
attention are left out of both. Tiles of the fused chain are chosen per role by one pass of
coordinate descent over the whole chain's time (with PDL a kernel's cost depends on its
neighbours), starting from the plain GEMV's tile (tuned where the table has one).

Writes batch-1 entries "<w4|fp8><norm|res|silu>:1:N:K" into the tuning table
(`gemm_tuning.fused_w4_config` / `fused_fp8_config`; other entries kept), only for a (format,
model) whose fused chain beat the unfused one (the engine fuses quantized layers only where
an entry exists), and one JSONL record per format and model.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import time
from pathlib import Path

import torch

from llmaccel.bench.results import current_commit
from llmaccel.kernels import pdl
from llmaccel.kernels.gemm import pack_int4_rows
from llmaccel.kernels.gemm_tuning import (
    fused_quant_key,
    gemv_fp8_config,
    gemv_w4_config,
    write_table,
)
from llmaccel.kernels.gemv_fp8 import GemvFp8Config, default_gemv_fp8_config, fp8_gemv
from llmaccel.kernels.gemv_w4 import (
    GemvW4Config,
    _valid_block_k,
    default_gemv_w4_config,
    w4a16_gemv,
)
from llmaccel.models.shapes import SHAPES

GROUP = 128
EPS = 1e-5
PREFIX = {"int4": "w4", "fp8": "fp8"}


def _dense_tuner():
    """benchmarks/tune_fused_decode.py as a module (roles, their shapes, the graph timer)."""
    spec = importlib.util.spec_from_file_location(
        "tune_fused_decode", Path(__file__).with_name("tune_fused_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TFD = _dense_tuner()
ROLES, ROLE_KIND = TFD.ROLES, TFD.ROLE_KIND
time_graph_us = TFD.time_graph_us


def candidates(fmt: str, k: int) -> list:
    """Tiles with 2 to 16 weight words (int4: 8 weights; FP8: a 16-byte vector) a thread:
    fewer leaves threads idle, more spills registers."""
    out = []
    if fmt == "int4":
        for bn, bk, nw, vec in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048),
                                                 (1, 2, 4), (2, 4)):
            words = bn * bk / (256 * nw)
            if 2 <= words <= 16 and vec <= words and bk < 2 * k and _valid_block_k(bk, k, GROUP):
                out.append(GemvW4Config(bn, bk, nw, 3, vec))
    else:
        for bn, bk, nw, ns in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048),
                                                (2, 4, 8), (2, 3, 4)):
            vectors = bn * bk / (16 * 32 * nw)
            if 1 <= vectors <= 8 and bk < 2 * k:
                out.append(GemvFp8Config(bn, bk, nw, ns))
    return out


class QuantChain:
    """Every layer's four quantized GEMVs, M = 1."""

    def __init__(self, fmt: str, name: str, dev: torch.device) -> None:
        self.fmt = fmt
        self.shapes = TFD.role_shapes(name)
        self.layers = SHAPES[name]["num_hidden_layers"]
        h = SHAPES[name]["hidden_size"]
        self.q = self.shapes["o"][1]
        g = torch.Generator(device=dev).manual_seed(0)

        def weight(n: int, k: int):
            if fmt == "int4":
                codes = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=g)
                scales = torch.rand(n, k // GROUP, device=dev, generator=g) * 2e-3
                return pack_int4_rows(codes), scales.to(torch.bfloat16)
            w = torch.empty(n, k, device=dev).uniform_(-448, 448, generator=g)
            return w.to(torch.float8_e4m3fn), torch.full((n, 1), 1e-5, device=dev)

        self.w = {r: [weight(n, k) for _ in range(self.layers)]
                  for r, (n, k) in self.shapes.items()}
        self.norm = torch.ones(h, device=dev, dtype=torch.bfloat16)
        self.res = torch.randn(1, h, device=dev, dtype=torch.bfloat16, generator=g)
        self.hidden = torch.randn(1, h, device=dev, dtype=torch.bfloat16, generator=g)

    def gemv(self, role: str, i: int, x, cfg, **fusion):
        w, s = self.w[role][i]
        if self.fmt == "int4":
            return w4a16_gemv(x, w, s, None, GROUP, None, cfg, **fusion)
        return fp8_gemv(x, w, s, None, cfg, **fusion)

    def run_fused(self, cfg: dict) -> None:
        res = self.res
        for i in range(self.layers):
            qkv = self.gemv("qkv", i, res, cfg["qkv"], norm_weight=self.norm, eps=EPS)
            self.gemv("o", i, qkv[:, :self.q], cfg["o"], residual=res)
            gu = self.gemv("gate_up", i, res, cfg["gate_up"], norm_weight=self.norm, eps=EPS)
            self.gemv("down", i, gu, cfg["down"], silu=True, residual=res)

    def run_unfused(self, cfg: dict) -> None:
        from llmaccel.kernels.activation import silu_and_mul
        from llmaccel.kernels.rmsnorm import fused_add_rms_norm

        h, res = self.hidden, self.res
        for i in range(self.layers):
            x, res = fused_add_rms_norm(h, res, self.norm, EPS)
            qkv = self.gemv("qkv", i, x, cfg["qkv"])
            o = self.gemv("o", i, qkv[:, :self.q], cfg["o"])
            x, res = fused_add_rms_norm(o, res, self.norm, EPS)
            h = self.gemv("down", i, silu_and_mul(self.gemv("gate_up", i, x, cfg["gate_up"])),
                          cfg["down"])

    def weight_bytes(self) -> int:
        per_layer = sum(w.numel() * w.element_size() + s.numel() * s.element_size()
                        for w, s in (self.w[r][0] for r in ROLES))
        return per_layer * self.layers


def plain_tile(fmt: str, n: int, k: int, dev: torch.device):
    if fmt == "int4":
        return gemv_w4_config(n, k, GROUP, dev) or default_gemv_w4_config(n, k, GROUP)
    return gemv_fp8_config(n, k, dev) or default_gemv_fp8_config(n, k)


def tune(fmt: str, name: str, dev: torch.device, budget_s: float) -> tuple[dict, dict]:
    chain = QuantChain(fmt, name, dev)
    plain = {r: plain_tile(fmt, *chain.shapes[r], dev) for r in ROLES}
    unfused_us = time_graph_us(lambda: chain.run_unfused(plain))
    cfg = dict(plain)
    start_us = best_us = time_graph_us(lambda: chain.run_fused(cfg))
    print(f"{fmt} {name}: unfused chain {unfused_us:.1f} us; fused, plain tiles "
          f"{start_us:.1f} us", flush=True)
    t0 = time.time()
    for role in ROLES:
        for cand in candidates(fmt, chain.shapes[role][1]):
            if time.time() - t0 > budget_s or cand == cfg[role]:
                continue
            trial = {**cfg, role: cand}
            try:
                us = time_graph_us(lambda trial=trial: chain.run_fused(trial))
            except Exception as e:  # noqa: BLE001 (e.g. out of registers for a large tile)
                print(f"  skip {role} {cand.describe()}: {type(e).__name__}")
                continue
            if us < best_us:
                best_us, cfg = us, trial
                print(f"  {role}: {cand.describe()} -> {us:.1f} us", flush=True)
    entries = {}
    for role in ROLES:
        n, k = chain.shapes[role]
        entries[fused_quant_key(PREFIX[fmt], ROLE_KIND[role], n, k)] = {
            "backend": "triton", "config": cfg[role].__dict__, "chain_us": round(best_us, 2),
            "chain_us_unfused": round(unfused_us, 2), "model": name}
    result = {"unfused_us": unfused_us, "start_us": start_us, "best_us": best_us,
              "bytes": chain.weight_bytes(),
              "roles": [{"role": r, "n": chain.shapes[r][0], "k": chain.shapes[r][1],
                         "kernel": cfg[r].describe(), "plain_kernel": plain[r].describe()}
                        for r in ROLES]}
    chain = None  # free the weights before the next run
    torch.cuda.empty_cache()
    return entries, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="int4,fp8")
    ap.add_argument("--models", default="llama-3.2-3b")
    ap.add_argument("--out-table", default="auto",
                    help="'auto': llmaccel/kernels/configs/<this GPU>.json; 'none': no table")
    ap.add_argument("--out-jsonl", default="fused-quant.jsonl")
    ap.add_argument("--no-pdl", action="store_true", help="tune with plain launches")
    ap.add_argument("--budget-s", type=float, default=150, help="per format and model")
    args = ap.parse_args()
    dev = torch.device("cuda")
    use_pdl = pdl.configure(dev, requested=not args.no_pdl)
    gpu = torch.cuda.get_device_name()
    keep: dict[str, dict] = {}
    records = []
    for fmt in args.formats.split(","):
        for name in args.models.split(","):
            entries, r = tune(fmt, name, dev, args.budget_s)
            if r["best_us"] < r["unfused_us"]:  # the engine fuses only where this holds
                keep.update(entries)
            records.append({
                "workload": "fused-decode-gemv", "model": name, "load_format": "dummy",
                "backend": "llmaccel",
                "config": {"m": 1, "pdl": use_pdl, "quantization": fmt, "roles": r["roles"],
                           "fused_chain_us_plain_tiles": round(r["start_us"], 2),
                           "unfused_chain_us": round(r["unfused_us"], 2)},
                "metric": "chain_us", "value": round(r["best_us"], 2),
                "gbps": round(r["bytes"] / r["best_us"] / 1e3, 1),
                "speedup_vs_unfused": round(r["unfused_us"] / r["best_us"], 3),
                "device": gpu, "torch": torch.__version__,
                "commit": current_commit(),
                "command": f"python benchmarks/tune_fused_decode_quant.py --formats {fmt} "
                           f"--models {name}"})
            print(f"{fmt} {name}: unfused {r['unfused_us']:.1f} us, fused {r['best_us']:.1f} us "
                  f"per step's chain ({r['bytes'] / r['best_us'] / 1e3:,.0f} GB/s fused)",
                  flush=True)
    with open(args.out_jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    if args.out_table != "none":
        print(f"{len(keep)} entries (fused faster) -> {write_table(args.out_table, gpu, keep)}")


if __name__ == "__main__":
    main()
