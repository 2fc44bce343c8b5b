"""Deferred text (StopChecker.defers_text): a request that wants only its final output and has
no stop strings is detokenized once, when it finishes, and its text is the same as the
token-by-token text of a streamed request. A tiny random Llama with SmolLM2's byte-level
tokenizer, so random outputs hold multi-byte characters split across tokens."""

import pytest

from llmaccel import SamplingParams
from llmaccel.engine.config import EngineConfig
from llmaccel.engine.llm_engine import LLMEngine
from llmaccel.models.config import make_model_config
from llmaccel.models.tokenizer import get_tokenizer
from tiny_models import make_tiny_model, tiny_configs

PROMPTS = [[1, 2, 3, 4], [500, 600, 700], [42] * 9, [9000, 12, 77, 31000, 5]]


@pytest.fixture(scope="module")
def model_dir(smollm2_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama-bytes")
    tok = get_tokenizer(make_model_config(str(smollm2_gguf)))
    tok.save_pretrained(d)
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = len(tok)
    make_tiny_model(cfg, d, seed=3)
    return d


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), dtype="float32", device="cpu",
                                  num_gpu_blocks=128))


def _run(engine: LLMEngine, kind: str, max_tokens: int = 40) -> dict[str, object]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=kind)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{kind}{i}", p, params)
    done, texts_while_running = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id.removeprefix(kind)] = out
        texts_while_running += [s.text for s in engine.scheduler.running]
    return {"done": done, "running_texts": texts_while_running}


def test_final_only_text_equals_streamed_text(model_dir):
    streamed = _run(_engine(model_dir), "cumulative")
    final = _run(_engine(model_dir), "final_only")
    tok = _engine(model_dir).tokenizer
    assert any(s for s in streamed["running_texts"])  # streamed: text grows step by step
    assert not any(final["running_texts"])  # deferred: none until the end
    multibyte = 0
    for i in map(str, range(len(PROMPTS))):
        a, b = streamed["done"][i].outputs[0], final["done"][i].outputs[0]
        assert a.token_ids == b.token_ids
        assert b.text == a.text and b.text
        full = tok.decode(b.token_ids, skip_special_tokens=True)
        multibyte += any(ord(c) > 127 for c in full)
        # the whole decode, less any incomplete character at the very end
        assert full.startswith(b.text) and set(full[len(b.text):]) <= {"\ufffd"}
    assert multibyte  # the random outputs do exercise split characters


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_final_only_short_outputs(model_dir, max_tokens):
    """Outputs cut anywhere (inside a character too) come out as the streamed ones do."""
    a = _run(_engine(model_dir), "cumulative", max_tokens)["done"]
    b = _run(_engine(model_dir), "final_only", max_tokens)["done"]
    assert [b[k].outputs[0].text for k in sorted(b)] == [a[k].outputs[0].text for k in sorted(a)]


def test_aborted_final_only_request_has_its_text(model_dir):
    engine = _engine(model_dir)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            output_kind="final_only")
    engine.add_request("a", PROMPTS[0], params)
    for _ in range(6):
        engine.step()
    out = engine.abort_request("a").outputs[0]
    assert out.finish_reason == "abort" and len(out.token_ids) >= 5
    streamed = _engine(model_dir)
    streamed.add_request("b", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=len(out.token_ids), ignore_eos=True))
    while streamed.has_unfinished_requests():
        last = streamed.step() or None
        if last and last[-1].finished:
            want = last[-1].outputs[0]
    assert want.token_ids == out.token_ids and out.text == want.text


def test_stop_strings_are_still_found_token_by_token(model_dir):
    """A request with stop strings is not deferred: it stops where the string completes."""
    engine = _engine(model_dir)
    plain = _run(engine, "final_only")["done"]["0"].outputs[0]
    text = plain.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    engine.add_request("s", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], output_kind="final_only"))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]


@pytest.mark.parametrize("min_tokens,stop_ids,ignore_eos,eos", [
    (0, [], False, {2}), (3, [], False, {2}), (3, [], True, {2}), (3, [7], True, {2}),
    (3, [], False, set()), (3, [7], False, set())])
def test_bans_any_is_banned_tokens_nonempty(min_tokens, stop_ids, ignore_eos, eos):
    """The per-step check (`bans_any`) agrees with the list it stands for, before and after
    min_tokens outputs."""
    from llmaccel.engine.sequence import Sequence
    from llmaccel.engine.stop_checker import StopChecker

    checker = StopChecker(eos, 100)
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=stop_ids,
                            ignore_eos=ignore_eos, max_tokens=10)
    seq = Sequence("r", 0, [1, 2], params)
    for n in range(5):
        seq.output_token_ids = [5] * n
        assert checker.bans_any(seq) == bool(checker.banned_tokens(seq)), n
