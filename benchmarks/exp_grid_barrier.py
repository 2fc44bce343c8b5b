"""What a dependency between two decode-step stages costs: a kernel boundary (the next kernel
launched with PDL, as the engine chains its kernels) against a grid-wide barrier inside one
persistent kernel (every program resident, an atomic arrival counter, a volatile spin on it).

    python benchmarks/exp_grid_barrier.py [--phases 64] [--programs 132,264,528]

Each stage does almost nothing (every program reads and rewrites one value), so the time per
stage is the cost of the dependency itself. A persistent per-layer kernel only pays if its
barrier costs clearly less than a PDL kernel boundary. (On an H100 it did not: 0.86-0.95 us
per boundary against 1.3-3.3 us per barrier, 2026-11-26-grid-barrier-vs-pdl-boundary-h100.txt;
the 2-3.8 us a decode kernel costs beyond its bytes is spent inside it.) An experiment: it
prints a table, it changes nothing in the engine.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from llmaccel.engine.cuda_graph import replay_ms
from llmaccel.kernels import pdl
from llmaccel.kernels.pdl import pdl_enter


@triton.jit
def _stage_kernel(Data, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    tl.store(Data + pid, tl.load(Data + pid) + 1.0)


@triton.jit
def _persistent_kernel(Data, Counter, phases, n_prog):
    pid = tl.program_id(0)
    for p in range(phases):
        tl.store(Data + pid, tl.load(Data + pid) + 1.0)
        # arrive (release: this program's store is visible before its arrival counts), then
        # wait until every program of this phase arrived (acquire on the observing side)
        tl.atomic_add(Counter, 1, sem="release")
        target = (p + 1) * n_prog
        seen = tl.atomic_add(Counter, 0, sem="acquire")
        while seen < target:
            seen = tl.load(Counter, volatile=True)
        tl.atomic_add(Counter, 0, sem="acquire")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", type=int, default=64)
    ap.add_argument("--programs", default="132,264,528")
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    dev = torch.device("cuda")
    use_pdl = pdl.configure(dev, requested=True)
    rows = []
    for n_prog in (int(v) for v in args.programs.split(",")):
        data = torch.zeros(n_prog, device=dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)

        def kernels():
            for _ in range(args.phases):
                _stage_kernel[(n_prog,)](data, USE_PDL=use_pdl, num_warps=args.warps,
                                         **pdl.launch_kwargs())

        def persistent():
            counter.zero_()
            _persistent_kernel[(n_prog,)](data, counter, args.phases, n_prog,
                                          num_warps=args.warps)

        out = {"programs": n_prog, "phases": args.phases, "pdl": use_pdl}
        for name, fn in (("kernel_boundary", kernels), ("grid_barrier", persistent)):
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            before = data.clone()
            ms = min(replay_ms(g, 20, warmup=3) for _ in range(3))
            torch.cuda.synchronize()
            # every stage ran: each replay adds `phases` to every value
            assert bool(((data - before) % args.phases == 0).all()), name
            out[f"{name}_us_per_stage"] = round(ms * 1e3 / args.phases, 3)
        rows.append(out)
        print(json.dumps(out), flush=True)
    print("\n| programs | PDL kernel boundary, us per stage | grid barrier, us per stage |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['programs']} | {r['kernel_boundary_us_per_stage']:.2f} | "
              f"{r['grid_barrier_us_per_stage']:.2f} |")


if __name__ == "__main__":
    main()
