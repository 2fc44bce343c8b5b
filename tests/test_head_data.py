"""benchmarks/head_data.py's requests: code and prose in turn, from the standard library's
source (parsed, not imported) and WikiText-2 validation text, none of them W5's prompts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


def test_requests_mix_code_and_prose_and_leave_w5_out():
    import head_data
    import spec_bench

    reqs = head_data.requests(60, seed=0)
    assert len(reqs) == 60 and len(set(reqs)) == 60
    code, prose = reqs[0::2], reqs[1::2]
    assert all(r.split("\n\n")[0] in head_data.CODE_TASKS for r in code)
    assert all(r.split("\n\n")[0] in head_data.PROSE_TASKS for r in prose)
    assert all("def " in r for r in code)
    w5 = [spec_bench.CODE.strip(), spec_bench.PROSE]
    assert not any(text in r for r in reqs for text in w5)
    assert head_data.requests(60, seed=0) == reqs  # the same seed, the same requests
