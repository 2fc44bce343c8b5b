"""Self-distillation data (`--data self[:N]`, llmaccel/train/self_data.py): the requests mix
code and prose from the standard library's source (parsed, not imported) and WikiText-2, none of
them W5's prompts; the target's greedy answers through our engine are what `distill-draft`
trains on, and the text and its facts are kept beside the draft."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_model, save_word_tokenizer, tiny_configs

from llmaccel.errors import LLMAccelError
from llmaccel.train.self_data import (CODE_TASKS, DEFAULT_REQUESTS, PROSE_TASKS,
                                      generate_self_data, parse_self_data, self_data_requests)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.fixture(scope="module", autouse=True)
def _generated_prose(wikitext_dir):
    """The prose requests come from generated WikiText-layout text, here and on a clone
    without WikiText alike."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMACCEL_DATA_DIR", str(wikitext_dir))
        yield


def test_requests_mix_code_and_prose_and_leave_w5_out():
    import spec_bench

    reqs = self_data_requests(60, seed=0)
    assert len(reqs) == 60 and len(set(reqs)) == 60
    code, prose = reqs[0::2], reqs[1::2]
    assert all(r.split("\n\n")[0] in CODE_TASKS for r in code)
    assert all(r.split("\n\n")[0] in PROSE_TASKS for r in prose)
    assert all("def " in r for r in code)
    w5 = [spec_bench.CODE.strip(), spec_bench.PROSE]
    assert not any(text in r for r in reqs for text in w5)
    assert self_data_requests(60, seed=0) == reqs  # the same seed, the same requests
    assert self_data_requests(60, seed=1) != reqs


def test_parse_self_data():
    assert parse_self_data("wikitext2") is None and parse_self_data("selfie.txt") is None
    assert parse_self_data("self") == DEFAULT_REQUESTS and parse_self_data("self:64") == 64
    for bad in ("self:", "self:1", "self:x", "self:-3"):
        if bad == "self:":
            assert parse_self_data(bad) == DEFAULT_REQUESTS
            continue
        with pytest.raises(LLMAccelError, match="self:N takes N >= 2"):
            parse_self_data(bad)


@pytest.fixture(scope="module")
def worded_target(tmp_path_factory):
    """A tiny model whose word-level vocabulary covers some of the requests' words."""
    d = tmp_path_factory.mktemp("self-target")
    words = sorted({w for r in self_data_requests(16) for w in r.split()})[:400]
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = save_word_tokenizer(words, d)
    make_tiny_model(cfg, d, seed=4)
    return d


def test_the_targets_greedy_answers_follow_their_prompts(worded_target):
    from llmaccel import LLM, SamplingParams
    from llmaccel.models.tokenizer import format_prompt

    data = generate_self_data(str(worded_target), 6, max_tokens=12, device="cpu",
                              dtype="float32", progress=False)
    assert data.requests + data.skipped == 6 and data.requests >= 2
    records = data.text.strip().split("\n\n")
    assert data.generated_tokens > 0 and data.facts()["requests"] == data.requests
    # each answer is the target's greedy continuation of its formatted prompt
    llm = LLM(str(worded_target), device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    prompt = format_prompt(tok, self_data_requests(6)[0], None)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert tok.decode(prompt) + out.outputs[0].text in data.text
    assert len(records) >= data.requests


def test_distill_draft_trains_a_head_on_self_data(worded_target, tmp_path):
    from llmaccel.train.distill import distill_draft
    from llmaccel.train.distill_common import DistillConfig

    out = tmp_path / "head"
    cfg = DistillConfig(target=str(worded_target), out=str(out), kind="head", data="self:4",
                        steps=4, batch_size=2, seq_len=32, eval_every=2, device="cpu")
    res = distill_draft(cfg, progress=False)
    summary = json.loads((out / "distill.json").read_text())
    assert summary["self_data"]["requests"] == 4 and summary["self_data"]["file"]
    assert summary["config"]["data"] == "self:4" and res.steps_run >= 2
    text = (out / "self_data.txt").read_text()
    assert len(text.split()) > 4 * 8  # four prompts and their answers
    with pytest.raises(LLMAccelError, match="self:N takes N >= 2"):
        distill_draft(DistillConfig(target=str(worded_target), out=str(tmp_path / "x"),
                                    data="self:1", device="cpu"), progress=False)
    assert not (tmp_path / "x").exists()


def test_head_data_script_writes_each_chunk(worded_target, tmp_path, capsys):
    import head_data

    out = tmp_path / "data.txt"
    assert head_data.main(["--target", str(worded_target), "--n", "4", "--max-tokens", "8",
                           "--chunk", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chunk 1:" in printed and "chunk 2:" in printed and "wrote" in printed
    assert len(out.read_text().split()) > 4 * 8
