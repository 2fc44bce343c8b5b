"""Tune the fused decode GEMVs (kernels/gemm.py prologues/epilogues) as they run in a decode
step: a CUDA graph of every layer's chain (qkv + RMSNorm prologue, o + residual epilogue,
gate_up + RMSNorm prologue, down + SiLU-and-mul prologue + residual epilogue), each layer with
its own weights (so nothing stays in L2), with programmatic dependent launch as the engine runs
it. Tiles are chosen per role by one pass of coordinate descent over the whole chain's time,
since with PDL a kernel's cost depends on its neighbours.

    python benchmarks/tune_fused_decode.py --models llama-3.2-1b,llama-3.2-3b \\
        [--out-table auto] [--out-jsonl fused.jsonl] [--no-pdl]

Writes batch-1 entries "16norm:1:N:K", "16res:1:N:K" and "16silu:1:N:K" into the tuning table
(`kernels/gemm_tuning.py`; other entries are kept) and one JSONL record per (model, role) with
the chain time before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from llmaccel.bench.results import current_commit
from llmaccel.engine.cuda_graph import replay_ms
from llmaccel.kernels import pdl
from llmaccel.kernels.gemm import GemmConfig, pick_config, triton_linear
from llmaccel.kernels.gemm_tuning import fused_key, lookup, write_table
from llmaccel.models.shapes import SHAPES

ROLES = ("qkv", "o", "gate_up", "down")
ROLE_KIND = {"qkv": "norm", "o": "res", "gate_up": "norm", "down": "silu"}


def role_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each role's weight for a benchmark shape."""
    c = SHAPES[name]
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    inter = c["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * hd, h), "o": (h, heads * hd),
            "gate_up": (2 * inter, h), "down": (h, inter)}


def candidates(n: int, k: int) -> list[GemmConfig]:
    """Batch-1 tiles: a few output widths, K tiles up to the whole row (one tile: every weight
    load can be issued before the PDL wait), 4 or 8 warps."""
    whole = 1 << (k - 1).bit_length()
    block_ks = sorted({min(1024, whole), min(2048, whole), whole})
    return [GemmConfig(1, bn, bk, False, w, s)
            for bn, bk, (w, s) in itertools.product((2, 4, 8), block_ks, ((4, 4), (8, 4)))
            if bn * bk <= 128 * 32 * w]  # at most 128 weights a thread: more spills registers


def start_config(role: str, n: int, k: int, dev: torch.device) -> GemmConfig:
    hit = lookup(16, 1, n, k, dev)
    return hit[1] if hit is not None else pick_config(1, n, k, 16, -1)


class Chain:
    """Every layer's four fused GEMVs on random bf16 weights, M = 1."""

    def __init__(self, name: str, dev: torch.device) -> None:
        c = SHAPES[name]
        self.shapes = role_shapes(name)
        self.layers = c["num_hidden_layers"]
        self.h = c["hidden_size"]
        self.q = self.shapes["o"][1]
        g = torch.Generator(device=dev).manual_seed(0)
        self.w = {r: [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5
                      for _ in range(self.layers)] for r, (n, k) in self.shapes.items()}
        self.norm = torch.ones(self.h, device=dev, dtype=torch.bfloat16)
        self.res = torch.randn(1, self.h, device=dev, dtype=torch.bfloat16, generator=g)

    def run(self, cfg: dict[str, GemmConfig]) -> None:
        res = self.res
        for i in range(self.layers):
            qkv = triton_linear(res, self.w["qkv"][i], config=cfg["qkv"],
                                norm_weight=self.norm, eps=1e-5)
            triton_linear(qkv[:, :self.q], self.w["o"][i], config=cfg["o"], residual=res)
            gu = triton_linear(res, self.w["gate_up"][i], config=cfg["gate_up"],
                               norm_weight=self.norm, eps=1e-5)
            triton_linear(gu, self.w["down"][i], config=cfg["down"], silu=True, residual=res)

    def time_us(self, cfg: dict[str, GemmConfig], reps: int = 10) -> float:
        """Microseconds per replay of a graph of the whole chain."""
        return time_graph_us(lambda: self.run(cfg), reps)


def time_graph_us(fn, reps: int = 10) -> float:
    """Microseconds per replay of a CUDA graph of fn() (compiled outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, reps, warmup=3) * 1000


def tune(name: str, dev: torch.device, budget_s: float) -> tuple[dict, list[dict], float, float]:
    chain = Chain(name, dev)
    cfg = {r: start_config(r, *chain.shapes[r], dev) for r in ROLES}
    before = best_us = chain.time_us(cfg)
    print(f"{name}: start {best_us:.1f} us per chain "
          f"({', '.join(f'{r} {c.describe()}' for r, c in cfg.items())})", flush=True)
    t0 = time.time()
    for role in ROLES:
        for cand in candidates(*chain.shapes[role]):
            if time.time() - t0 > budget_s or cand == cfg[role]:
                continue
            trial = {**cfg, role: cand}
            try:
                us = chain.time_us(trial)
            except Exception as e:  # e.g. out of registers/shared memory for a large tile
                print(f"  skip {role} {cand.describe()}: {type(e).__name__}")
                continue
            if us < best_us:
                best_us, cfg = us, trial
                print(f"  {role}: {cand.describe()} -> {us:.1f} us", flush=True)
    entries, records = {}, []
    for role in ROLES:
        n, k = chain.shapes[role]
        entries[fused_key(ROLE_KIND[role], n, k)] = {
            "backend": "triton", "config": cfg[role].__dict__, "chain_us": round(best_us, 2),
            "chain_us_start": round(before, 2), "model": name}
        records.append({"role": role, "n": n, "k": k, "kernel": cfg[role].describe()})
    del chain
    torch.cuda.empty_cache()
    return entries, records, before, best_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.2-3b")
    ap.add_argument("--out-table", default="auto",
                    help="'auto': llmaccel/kernels/configs/<this GPU>.json")
    ap.add_argument("--out-jsonl", default="fused.jsonl")
    ap.add_argument("--no-pdl", action="store_true", help="tune with plain launches")
    ap.add_argument("--budget-s", type=float, default=150, help="per model")
    args = ap.parse_args()
    dev = torch.device("cuda")
    use_pdl = pdl.configure(dev, requested=not args.no_pdl)
    gpu = torch.cuda.get_device_name()
    commit = current_commit()
    entries: dict[str, dict] = {}
    out = []
    for name in args.models.split(","):
        e, roles, before, after = tune(name, dev, args.budget_s)
        entries.update(e)
        layer_bytes = sum(2 * n * k for n, k in role_shapes(name).values())
        total = layer_bytes * SHAPES[name]["num_hidden_layers"]
        out.append({"workload": "fused-decode-gemv", "model": name, "load_format": "dummy",
                    "backend": "llmaccel", "config": {"m": 1, "pdl": use_pdl, "roles": roles,
                                                      "chain_us_start": round(before, 2)},
                    "metric": "chain_us", "value": round(after, 2),
                    "gbps": round(total / after / 1e3, 1), "device": gpu,
                    "torch": torch.__version__, "commit": commit,
                    "command": "python benchmarks/tune_fused_decode.py --models " + name})
        print(f"{name}: {before:.1f} -> {after:.1f} us per step's GEMV chain "
              f"({total / after / 1e3:,.0f} GB/s)", flush=True)
    out_table = write_table(args.out_table, gpu, entries)
    with open(args.out_jsonl, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    print(f"{len(entries)} fused entries -> {out_table}")


if __name__ == "__main__":
    main()
