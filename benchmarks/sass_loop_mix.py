"""Static analysis of the W4A16 GEMM's main loop (`kernels/csrc/gemm_w4.cu`), no GPU needed:
compile tiles for sm_90 with NVRTC, disassemble with cuobjdump, and count the instructions
from the loop's barrier to its last mma, per mma (about 4 keep the tensor pipe busy).

    PATH=<dir with cuobjdump and nvdisasm>:$PATH python benchmarks/sass_loop_mix.py [--lean]

(cuobjdump / nvdisasm: `pip download nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, unzip.)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from nvrtc_helpers import _nvrtc  # noqa: E402

from llmaccel.kernels import cuda_rtc  # noqa: E402
from llmaccel.kernels import gemm_w4_cuda as g  # noqa: E402

TILES = (g.SHORT, g.TALL[1], g.TALL[0], g.DECODE_NARROW, g.GemmW4Config(4, 1, 2, 8, 4, 3),
         g.GemmW4Config(2, 1, 2, 8, 4, 4), g.GemmW4Config(4, 1, 1, 8, 4, 4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lean", action="store_true")
    args = ap.parse_args()
    lib = _nvrtc()
    if lib is None:
        raise SystemExit("no NVRTC library (pip install nvidia-cuda-nvrtc)")
    cuda_rtc._libs = lambda: (lib, None)
    src, hdr = g._source()
    print("| tile | loop instructions | mmas | per mma | most common |")
    print("|---|---|---|---|---|")
    for c in TILES:
        d = {"WM": c.wm, "WN": c.wn, "MT": c.mt, "NTW": c.ntw, "CPS": c.cps,
             "STAGES": c.stages, "X_BF16": 1, "SCALE_KIND": 2, "HAS_ZEROS": 1, "HAS_BIAS": 0,
             "GROUP_CHUNKS": 4, "LEAN": int(args.lean)}
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cuda_rtc.compile_cubin(src, "gemm_w4", "sm_90", d, hdr))
            f.flush()
            sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True,
                                  text=True, check=True).stdout
        lines = [x for x in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", x)]
        ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", x).split()[0] for x in lines]
        start = next(i for i, o in enumerate(ops) if o.startswith("BAR.SYNC"))
        end = max(i for i, o in enumerate(ops) if o.startswith("HMMA"))
        body = ops[start:end + 1]
        mmas = sum(o.startswith("HMMA") for o in body)
        top = Counter(o.split(".")[0] for o in body).most_common(5)
        print(f"| {c.describe()} | {len(body)} | {mmas} | {len(body) / mmas:.2f} | "
              f"{', '.join(f'{k} {v}' for k, v in top)} |")


if __name__ == "__main__":
    main()
