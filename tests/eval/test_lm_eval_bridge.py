"""The lm-evaluation-harness bridge (llmaccel/eval/lm_eval_bridge.py, lm_eval_run.py) on a
tiny random Llama with an ASCII byte-level tokenizer: the core functions (no lm_eval needed)
against independent transformers forwards and greedy decoding; with lm_eval installed, the LM
class's three methods on hand-made Instances and an offline `simple_evaluate` of a local
multiple-choice task, whose accuracy is recomputed by hand."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from llmaccel.errors import LLMAccelError
from llmaccel.eval.lm_eval_bridge import (INSTALL_HINT, encode_pair, generate_texts,
                                          prefix_token_id, require_lm_eval,
                                          rolling_loglikelihood, rolling_requests,
                                          sampling_params_for, score_continuations, tok_encode)
from llmaccel.eval.hf_perplexity import hf_perplexity
from tiny_models import make_tiny_model, tiny_configs

MAX_LEN = 64  # the engine's context in these tests (small: exercises left truncation)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _ascii_tokenizer(directory) -> int:
    """A byte-level tokenizer whose vocabulary is <s>, </s> and the printable ASCII bytes plus
    newline, no merges: any id decodes to valid text, so a random model's output text is the
    same however it is detokenized. Saved as an HF tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()
    vocab = {"<s>": 0, "</s>": 1}
    for b in [10, *range(32, 127)]:
        vocab[chars[b]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    return len(vocab)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, tokenizer, directory) of a tiny random Llama."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tiny-lm-eval")
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = _ascii_tokenizer(d)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 0, 1, None
    hf = make_tiny_model(cfg, d, seed=5)
    return hf, AutoTokenizer.from_pretrained(str(d)), d


@pytest.fixture(scope="module")
def llm(tiny):
    from llmaccel.engine.llm import LLM

    return LLM(str(tiny[2]), dtype="float32", device="cpu", max_model_len=MAX_LEN)


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] fp64 log-probabilities of each next token, one plain forward."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), -1)


def _hf_score(hf, ctx: list[int], cont: list[int], max_length: int) -> tuple[float, bool]:
    """Independent reference: the last max_length + 1 tokens of context + continuation through
    transformers; the continuation's summed log-probs and whether each is the argmax."""
    ids = (ctx + cont)[-(max_length + 1):]
    logp = _hf_logprobs(hf, ids)[-len(cont):]
    target = torch.tensor(cont)
    picked = logp.gather(1, target[:, None])[:, 0]
    return float(picked.sum()), bool((logp.argmax(-1) == target).all())


def _hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by hand: a fresh forward per token, up to EOS (id 1)."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(hf(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == 1:
                break
            out.append(nxt)
    return out


# -- tokenization -----------------------------------------------------------------------------
def test_encode_pair_follows_lm_eval_conventions(tiny):
    _, tok, _ = tiny
    ctx, cont = encode_pair(tok, "Question: 2+2 = ", "4")
    # the context's trailing space moves to the continuation
    assert tok.decode(ctx) == "Question: 2+2 =" and tok.decode(cont) == " 4"
    assert ctx + cont == tok_encode(tok, "Question: 2+2 = 4")
    # an empty context is the prefix token (BOS here)
    assert prefix_token_id(tok) == 0
    assert encode_pair(tok, "", "abc") == ([0], tok_encode(tok, "abc"))
    assert encode_pair(tok, "", "<s>abc") == ([0], tok_encode(tok, "abc"))


# -- loglikelihood ------------------------------------------------------------------------------
def test_score_continuations_equal_an_hf_forward(tiny, llm):
    hf, _, _ = tiny
    g = torch.Generator().manual_seed(3)
    vocab = hf.config.vocab_size

    def rand(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    reqs = [(rand(n), rand(m)) for n, m in [(1, 1), (5, 3), (17, 1), (40, 9), (3, 20), (90, 4),
                                            (200, 30), (8, 8)]]
    # the greedy continuation of a context must report is_greedy
    ctx = rand(12)
    reqs.append((ctx, _hf_greedy(hf, ctx, 6) or [2]))
    want = [_hf_score(hf, c, x, MAX_LEN) for c, x in reqs]
    assert want[-1][1] and not all(w[1] for w in want)
    model = llm.engine.model
    for tokens, size in [(10_000, None), (64, None), (200, 2)]:  # one batch; many; capped
        got = score_continuations(model, reqs, MAX_LEN, max_batch_tokens=tokens,
                                  batch_size=size)
        for (lp, greedy), (lp_ref, greedy_ref) in zip(got, want):
            assert lp == pytest.approx(lp_ref, rel=1e-5, abs=1e-5)
            assert greedy == greedy_ref


def test_score_continuations_reject_unscorable_requests(llm):
    model = llm.engine.model
    with pytest.raises(LLMAccelError, match="at least one token"):
        score_continuations(model, [([1, 2], [])], MAX_LEN)
    with pytest.raises(LLMAccelError, match="needs a context"):
        score_continuations(model, [([], [3])], MAX_LEN)
    with pytest.raises(LLMAccelError, match="does not fit"):
        score_continuations(model, [([2], [3] * (MAX_LEN + 1))], MAX_LEN)


# -- loglikelihood_rolling ----------------------------------------------------------------------
@pytest.mark.parametrize("n,stride", [(1, None), (10, None), (64, None), (65, None), (150, None),
                                      (150, 20), (150, 1)])
def test_rolling_requests_score_every_token_once(n, stride):
    tokens = list(range(100, 100 + n))
    reqs = rolling_requests(tokens, 7, MAX_LEN, stride)
    assert [t for _, cont in reqs for t in cont] == tokens  # each token once, in order
    for ctx, cont in reqs:
        assert len(ctx) + len(cont) <= MAX_LEN + 1 and ctx  # fits: no truncation
        history = MAX_LEN + 1 - (stride or MAX_LEN)
        assert len(ctx) >= min(history, 1 + tokens.index(cont[0]))
    assert reqs[0][0][0] == 7  # the first token is conditioned on the prefix token
    assert rolling_requests([], 7, MAX_LEN) == []


@pytest.mark.parametrize("stride", [None, 16])
def test_rolling_loglikelihood_equals_perplexity_and_hf(tiny, llm, stride):
    hf, _, _ = tiny
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(2, hf.config.vocab_size, (n,), generator=g).tolist()
            for n in (150, 3, 64, 1)]
    got = rolling_loglikelihood(llm.engine.model, docs, 0, MAX_LEN, stride, max_batch_tokens=100)
    for doc, value in zip(docs, got):
        # perplexity.py's windows over [prefix] + doc, context max_length + 1 (transformers'
        # loss: our engine holds only max_length positions)
        res = hf_perplexity(hf, [0, *doc], MAX_LEN + 1, stride or MAX_LEN)
        assert res.scored_tokens == len(doc)
        assert value == pytest.approx(-res.nll * res.scored_tokens, rel=1e-5)
        # and transformers, window by window
        ref = sum(_hf_score(hf, c, x, MAX_LEN)[0] for c, x in
                  rolling_requests(doc, 0, MAX_LEN, stride))
        assert value == pytest.approx(ref, rel=1e-5)


# -- generate_until -----------------------------------------------------------------------------
def test_sampling_params_from_gen_kwargs():
    p, until, n = sampling_params_for({"until": "\n\n", "max_gen_toks": 7})
    assert p.greedy and p.max_tokens == n == 7 and until == ["\n\n"] and p.stop == ["\n\n"]
    p, until, n = sampling_params_for({"until": ["a", ""], "do_sample": False,
                                       "temperature": 0.8, "max_new_tokens": 5})
    assert p.greedy and n == 5 and until == ["a"]
    p, _, n = sampling_params_for({"do_sample": True, "top_p": 0.9, "seed": 3}, 11)
    assert p.temperature == 1.0 and p.top_p == 0.9 and p.seed == 3 and n == 11
    p, until, _ = sampling_params_for({"temperature": 0.5})
    assert p.temperature == 0.5 and until == [] and p.stop is None


def test_generate_texts_equal_hf_greedy_cut_at_stops(tiny, llm):
    hf, tok, _ = tiny
    contexts = ["Once upon a time", "x = 1 + ", "The end.\n", "a" * 100]  # the last: truncated
    steps = 12
    refs = []
    for c in contexts:
        ids = tok_encode(tok, c)[-(MAX_LEN - steps):]
        refs.append(tok.decode(_hf_greedy(hf, ids, steps), skip_special_tokens=True))
    # stops: a character that occurs in each reference (cut there) and one that does not
    stops = [r[len(r) // 2] if r.strip() else "\x7f" for r in refs]
    reqs = [(c, {"until": [s, "\x7f"], "max_gen_toks": steps, "do_sample": False})
            for c, s in zip(contexts, stops)]
    got = generate_texts(llm, tok, reqs, MAX_LEN)
    assert got == [r.split(s)[0] for r, s in zip(refs, stops)]
    # no stop string: max_gen_toks tokens (or EOS)
    full = generate_texts(llm, tok, [(contexts[0], {"until": [], "max_gen_toks": steps})],
                          MAX_LEN)
    assert full == [refs[0]]
    with pytest.raises(LLMAccelError, match="max_gen_toks"):
        generate_texts(llm, tok, [("hi", {"max_gen_toks": MAX_LEN})], MAX_LEN)


# -- without lm_eval ----------------------------------------------------------------------------
def test_missing_lm_eval_names_the_extra(monkeypatch):
    from llmaccel.eval.lm_eval_run import run_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    with pytest.raises(LLMAccelError, match="llmaccel\\[lm-eval\\]") as info:
        require_lm_eval()
    assert INSTALL_HINT in str(info.value)
    with pytest.raises(LLMAccelError, match="llmaccel\\[lm-eval\\]"):
        run_lm_eval(None, ["anything"])


# -- with lm_eval -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(llm):
    pytest.importorskip("lm_eval")
    from llmaccel.eval.lm_eval_bridge import LLMAccelLM

    return LLMAccelLM(llm=llm, batch_size=3, max_batch_tokens=128)


def _instance(kind: str, args: tuple, idx: int = 0):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


def test_lm_class_is_registered_and_an_lm(lm):
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    assert isinstance(lm, LM)
    assert get_model("llmaccel") is type(lm)
    assert lm.max_length == MAX_LEN and lm.prefix_token_id == 0


def test_lm_loglikelihood_on_instances(tiny, lm):
    hf, tok, _ = tiny
    pairs = [("The cat sat on the", " mat"), ("The cat sat on the ", "hat"), ("", "Hello"),
             ("2 + 2 =", " 4"), ("z" * 90, " tail end")]  # the last is truncated on the left
    got = lm.loglikelihood([_instance("loglikelihood", p, i) for i, p in enumerate(pairs)])
    for (c, x), (lp, greedy) in zip(pairs, got):
        ctx, cont = encode_pair(tok, c, x)
        lp_ref, greedy_ref = _hf_score(hf, ctx, cont, MAX_LEN)
        assert lp == pytest.approx(lp_ref, rel=1e-5) and greedy == greedy_ref
    assert isinstance(got[0][0], float) and isinstance(got[0][1], bool)


def test_lm_loglikelihood_rolling_on_instances(tiny, lm):
    hf, tok, _ = tiny
    texts = ["A short document.", "A longer document that needs windows. " * 5]
    got = lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (t,), i)
                                    for i, t in enumerate(texts)])
    for t, value in zip(texts, got):
        ids = tok_encode(tok, t)
        want = sum(_hf_score(hf, c, x, MAX_LEN)[0] for c, x in rolling_requests(ids, 0, MAX_LEN))
        assert value == pytest.approx(want, rel=1e-5)
    assert len(tok_encode(tok, texts[1])) > MAX_LEN  # really several windows


def test_lm_generate_until_on_instances(tiny, lm, llm):
    _, tok, _ = tiny
    args = [("Once upon a time", {"until": ["e"], "max_gen_toks": 10, "do_sample": False}),
            ("Q: why?\nA:", {"until": "\n", "max_gen_toks": 6})]
    got = lm.generate_until([_instance("generate_until", a, i) for i, a in enumerate(args)])
    assert got == generate_texts(llm, tok, args, MAX_LEN)
    assert "e" not in got[0] and "\n" not in got[1]


def _mc_task(tmp_path) -> tuple[str, list[dict]]:
    """A local multiple-choice task (json rows, no download): its folder and rows."""
    rows = [{"question": f"Item {i}: pick one", "choices": ["red", "green", "blue"],
             "answer": i % 3} for i in range(6)]
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(f"""task: llmaccel_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return str(tasks), rows


def test_lm_eval_command_end_to_end_offline(tiny, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    import typer
    from typer.testing import CliRunner

    from llmaccel.cli.eval_lm_eval import eval_lm_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    hf, tok, d = tiny
    include, rows = _mc_task(tmp_path)
    app = typer.Typer()
    app.command()(eval_lm_eval)
    out = tmp_path / "results.json"
    result = CliRunner().invoke(app, [str(d), "--tasks", "llmaccel_tiny_mc", "--include-path",
                                      include, "--device", "cpu", "--dtype", "float32",
                                      "--max-length", str(MAX_LEN), "--batch-size", "4",
                                      "--bootstrap-iters", "0", "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "llmaccel_tiny_mc" in result.output and "acc" in result.output
    acc = json.loads(out.read_text())["results"]["llmaccel_tiny_mc"]["acc,none"]
    # by hand: the choice with the highest log-likelihood given "question" + " " (lm_eval's
    # default target delimiter)
    right = 0
    for r in rows:
        scores = [_hf_score(hf, *encode_pair(tok, r["question"] + " ", c), MAX_LEN)[0]
                  for c in r["choices"]]
        right += int(max(range(3), key=scores.__getitem__) == r["answer"])
    assert acc == pytest.approx(right / len(rows))


def test_lm_eval_command_names_an_unknown_task(tiny, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    from llmaccel.eval.lm_eval_run import run_lm_eval

    class NoTasks:  # lm-eval's full task index takes ~10 s to build; only our check is tested
        def __init__(self, **kwargs):
            pass

        def match_tasks(self, names):
            return []

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", NoTasks)
    with pytest.raises(LLMAccelError, match="unknown lm-eval task"):
        run_lm_eval(str(tiny[2]), ["no_such_task_xyz"], include_path=str(tmp_path))
    with pytest.raises(LLMAccelError, match="does not exist"):
        run_lm_eval(str(tiny[2]), ["x"], include_path=str(tmp_path / "missing"))
