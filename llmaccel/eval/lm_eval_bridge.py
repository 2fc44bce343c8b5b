"""lm-evaluation-harness over our engine: `LLMAccelLM`, lm_eval's `LM` interface, registered as
model "llmaccel" (`lm_eval --model llmaccel --model_args pretrained=PATH,...` once this module is
imported, or `llmaccel eval lm-eval`).

lm_eval is an optional dependency (`pip install 'llmaccel[lm-eval]'`), imported only when the LM
class is first asked for. The work is done by the module-level functions below, which take token
ids and our model and need no lm_eval, so they are tested without it:

- `score_continuations`: for each (context ids, continuation ids), the sum of the
  continuation's log-probabilities given the context and whether greedy decoding would produce
  it; requests are packed into batches of whole sequences (one varlen forward of our model, no KV
  cache, as perplexity.py's window_nll does) and too-long inputs lose their left end (lm_eval's
  convention: the last max_length tokens before the final one).
- `rolling_requests`: a document as perplexity.py's windows over [prefix token] + its tokens
  (every token scored exactly once), each window one (context, continuation) request.
- `generate_texts`: generation through `LLM.generate` with stop strings and max_gen_toks;
  greedy unless do_sample.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from llmaccel.errors import LLMAccelError
from llmaccel.eval.perplexity import LOGITS_CHUNK, windows
from llmaccel.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'llmaccel[lm-eval]'"
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's default
DEFAULT_MAX_BATCH_TOKENS = 8192  # tokens per scoring forward (logits only where scored)
_GEN_KWARGS_USED = {"until", "do_sample", "temperature", "top_p", "top_k", "seed",
                    "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"}


def require_lm_eval():
    """The lm_eval module, or an LLMAccelError saying how to install it."""
    try:
        import lm_eval
    except ImportError as e:
        raise LLMAccelError(f"lm-evaluation-harness is not installed ({e}); install it with: "
                            f"{INSTALL_HINT}") from None
    return lm_eval


# -- tokenization (lm_eval's TemplateLM conventions) ------------------------------------------
def prefix_token_id(tok) -> int:
    """What an empty context and a rolling document are conditioned on: BOS, else EOS (as
    lm_eval's HF model)."""
    for value in (tok.bos_token_id, tok.eos_token_id):
        if value is not None:
            return int(value)
    raise LLMAccelError("the tokenizer has neither a BOS nor an EOS token to condition on")


def tok_encode(tok, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """Token ids of `text`: the tokenizer's own special-token rule, unless told, and never a
    second BOS before text that already starts with it."""
    kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    bos = tok.bos_token
    if add_special_tokens is None and bos and text.startswith(bos):
        kwargs["add_special_tokens"] = False
    return list(tok(text, **kwargs).input_ids)


def encode_pair(tok, context: str, continuation: str,
                add_special_tokens: bool | None = None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm_eval tokenizes them: trailing spaces of the context
    move to the continuation, the whole text is encoded once and split at the context's length
    (so merges across the boundary count for the continuation); an empty context becomes the
    prefix token."""
    if not context:
        cont = tok_encode(tok, continuation, add_special_tokens=False)
        prefix = prefix_token_id(tok)
        if cont and cont[0] == prefix:  # the continuation already starts with it
            return cont[:1], cont[1:]
        return [prefix], cont
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok_encode(tok, context + continuation, add_special_tokens)
    ctx = tok_encode(tok, context, add_special_tokens)
    return ctx, whole[len(ctx):]


# -- scoring ------------------------------------------------------------------------------------
def _model_input(context: Sequence[int], continuation: Sequence[int],
                 max_length: int) -> list[int]:
    """The ids our model reads for one request: context + continuation without its last token
    (only a target), cut from the left to max_length."""
    if not continuation:
        raise LLMAccelError("a continuation to score must have at least one token")
    if not context:
        raise LLMAccelError("the first continuation token needs a context (use the prefix "
                            "token for an empty one)")
    if len(continuation) > max_length:
        raise LLMAccelError(f"continuation of {len(continuation)} tokens does not fit in "
                            f"max_length {max_length}")
    return (list(context) + list(continuation))[-(max_length + 1):][:-1]


def _batches(lengths: list[int], max_batch_tokens: int, batch_size: int | None) -> list[list[int]]:
    """Request indices in batches: longest first (a batch that does not fit fails at once, and
    similar lengths share a batch), each within max_batch_tokens (a longer request alone) and
    batch_size requests."""
    out: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if (not out or tokens + lengths[i] > max_batch_tokens
                or (batch_size is not None and len(out[-1]) >= batch_size)):
            out.append([])
            tokens = 0
        out[-1].append(i)
        tokens += lengths[i]
    return out


@torch.inference_mode()
def score_continuations(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                        max_length: int, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                        batch_size: int | None = None) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context) in nats, is it the greedy continuation) for each
    (context ids, continuation ids), with our TransformerForCausalLM `model`."""
    device = next(model.parameters()).device
    inputs = [_model_input(c, x, max_length) for c, x in requests]
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for batch in _batches([len(x) for x in inputs], max_batch_tokens, batch_size):
        lens = [len(inputs[i]) for i in batch]
        flat = torch.tensor([t for i in batch for t in inputs[i]], dtype=torch.long,
                            device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        hidden = model(flat, positions, AttentionMetadata.for_prefill(lens, device))
        # Logits only at rows that predict a continuation token: a 150k vocabulary's logits
        # over every row of a batch would dwarf the activations.
        rows, targets, owner = [], [], []
        start = 0
        for i, n in zip(batch, lens):
            cont = list(requests[i][1])
            rows.extend(range(start + n - len(cont), start + n))
            targets.extend(cont)
            owner.extend([i] * len(cont))
            start += n
        rows_t = torch.tensor(rows, device=device)
        targets_t = torch.tensor(targets, device=device)
        logprob = torch.empty(len(rows), dtype=torch.float64, device=device)
        greedy = torch.empty(len(rows), dtype=torch.bool, device=device)
        for s in range(0, len(rows), LOGITS_CHUNK):
            logits = model.compute_logits(hidden[rows_t[s:s + LOGITS_CHUNK]]).float()
            tgt = targets_t[s:s + LOGITS_CHUNK]
            picked = logits.gather(1, tgt[:, None])[:, 0]
            logprob[s:s + LOGITS_CHUNK] = (picked - torch.logsumexp(logits, -1)).double()
            greedy[s:s + LOGITS_CHUNK] = logits.argmax(-1) == tgt
        logprob_l, greedy_l = logprob.tolist(), greedy.tolist()
        sums: dict[int, float] = {}
        all_greedy: dict[int, bool] = {}
        for j, i in enumerate(owner):
            sums[i] = sums.get(i, 0.0) + logprob_l[j]
            all_greedy[i] = all_greedy.get(i, True) and greedy_l[j]
        for i in batch:
            results[i] = (sums[i], all_greedy[i])
    return results  # type: ignore[return-value]


def rolling_requests(token_ids: Sequence[int], prefix_id: int, max_length: int,
                     stride: int | None = None) -> list[tuple[list[int], list[int]]]:
    """A document's (context, continuation) requests for its full log-likelihood: perplexity.py's
    windows over [prefix] + tokens, of max_length + 1 tokens (max_length model positions: the
    last token is only a target). The default stride max_length scores every document token
    exactly once with at least one token of history (lm_eval's disjoint windows); a smaller
    stride gives each scored token at least max_length + 1 - stride tokens of history."""
    if not token_ids:
        return []
    stride = max_length if stride is None else stride
    stream = [prefix_id, *token_ids]
    return [(stream[b:f], stream[f:e]) for b, e, f in windows(len(stream), max_length + 1, stride)]


def rolling_loglikelihood(model, documents: Sequence[Sequence[int]], prefix_id: int,
                          max_length: int, stride: int | None = None,
                          max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                          batch_size: int | None = None) -> list[float]:
    """Each document's log-likelihood (nats): the sum over its rolling windows, all documents'
    windows batched together."""
    pairs, owner = [], []
    for d, ids in enumerate(documents):
        reqs = rolling_requests(ids, prefix_id, max_length, stride)
        pairs += reqs
        owner += [d] * len(reqs)
    scores = score_continuations(model, pairs, max_length, max_batch_tokens, batch_size)
    totals = [0.0] * len(documents)
    for d, (logprob, _) in zip(owner, scores):
        totals[d] += logprob
    return totals


# -- generation ---------------------------------------------------------------------------------
def sampling_params_for(gen_kwargs: dict[str, Any],
                        default_max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
    """(SamplingParams, stop strings, max_gen_toks) of lm_eval's gen_kwargs: `until` -> stop
    strings, max_gen_toks (or an alias) -> max_tokens, greedy unless do_sample (then the given
    temperature, 1.0 if none), top_p / top_k / seed passed on."""
    from llmaccel.engine.sampling_params import SamplingParams

    kwargs = dict(gen_kwargs or {})
    until = kwargs.get("until")
    until = [until] if isinstance(until, str) else list(until or [])
    until = [s for s in until if s]
    max_gen_toks = next((int(kwargs[k]) for k in ("max_gen_toks", "max_new_tokens",
                                                   "max_tokens", "max_completion_tokens")
                         if kwargs.get(k) is not None), default_max_gen_toks)
    temperature = float(kwargs.get("temperature") or 0.0)
    do_sample = kwargs.get("do_sample")
    if do_sample is None:
        do_sample = temperature > 0
    if not do_sample:
        temperature = 0.0
    elif temperature == 0.0:
        temperature = 1.0  # sampling asked for without a temperature: transformers' default
    ignored = sorted(set(kwargs) - _GEN_KWARGS_USED)
    if ignored:
        logger.warning("generation kwargs not supported by llmaccel, ignored: %s", ignored)
    params = SamplingParams(
        max_tokens=max_gen_toks, stop=until or None, temperature=temperature,
        top_p=float(kwargs.get("top_p") or 1.0) if do_sample else 1.0,
        top_k=int(kwargs.get("top_k") or -1) if do_sample else -1,
        seed=None if kwargs.get("seed") is None else int(kwargs["seed"]))
    return params, until, max_gen_toks


def generate_texts(llm, tok, requests: Sequence[tuple[str, dict[str, Any]]], max_length: int,
                   default_max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                   add_special_tokens: bool | None = None) -> list[str]:
    """The continuation text of each (context, gen_kwargs), up to (not including) the first
    stop string, through `llm` (our LLM) in one batch. Contexts longer than max_length -
    max_gen_toks lose their left end (lm_eval's convention)."""
    prompts, params, stops = [], [], []
    for context, gen_kwargs in requests:
        p, until, max_gen_toks = sampling_params_for(gen_kwargs, default_max_gen_toks)
        if max_gen_toks >= max_length:
            raise LLMAccelError(f"max_gen_toks {max_gen_toks} must be below the model's "
                                f"max_length {max_length}")
        ids = tok_encode(tok, context, add_special_tokens)[-(max_length - max_gen_toks):]
        if not ids:  # an empty context: condition on the prefix token, as loglikelihood does
            ids = [prefix_token_id(tok)]
        prompts.append({"prompt_token_ids": ids})
        params.append(p)
        stops.append(until)
    outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
    texts = []
    for out, until in zip(outputs, stops):
        if out.error:
            raise LLMAccelError(f"generation failed: {out.error}")
        text = out.outputs[0].text
        for stop in until:  # the engine already stops there; this keeps the contract explicit
            text = text.split(stop)[0]
        texts.append(text)
    return texts


# -- the lm_eval LM class -----------------------------------------------------------------------
_LM_CLASS: type | None = None


def lm_eval_model_class() -> type:
    """`LLMAccelLM`, defined (and registered with lm_eval as "llmaccel") on first use."""
    global _LM_CLASS
    if _LM_CLASS is None:
        _LM_CLASS = _define_lm_class()
    return _LM_CLASS


def __getattr__(name: str):  # PEP 562: `from llmaccel.eval.lm_eval_bridge import LLMAccelLM`
    if name == "LLMAccelLM":
        return lm_eval_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _int_or_none(value: Any) -> int | None:
    """lm_eval passes batch sizes as ints or strings ("auto", "16")."""
    if value is None or (isinstance(value, str) and not value.isdigit()):
        return None
    return int(value)


def _define_lm_class() -> type:
    require_lm_eval()
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    @register_model("llmaccel")
    class LLMAccelLM(LM):
        """lm_eval's LM over our engine: one `LLM` (its model scores, its scheduler generates).

        pretrained: a path, .gguf file or hub id (None: the default model). batch_size: requests
        per scoring forward (None or "auto": only max_batch_tokens bounds it). max_length: the
        context (default: the model's). rolling_stride: see `rolling_requests`. Other keywords
        go to `LLM` (EngineConfig), e.g. gpu_memory_utilization, enforce_eager.
        """

        def __init__(self, pretrained: str | None = None, dtype: str = "auto",
                     device: str | None = None, batch_size: int | str | None = 16,
                     max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                     max_length: int | None = None,
                     max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                     rolling_stride: int | None = None, tokenizer: str | None = None,
                     add_bos_token: bool | None = None, llm=None,
                     max_batch_size: Any = None, **engine_kwargs: Any) -> None:
            super().__init__()
            if llm is None:
                from llmaccel.engine.llm import LLM

                # The scoring forwards need room beside the KV pool on a GPU.
                engine_kwargs.setdefault("gpu_memory_utilization", 0.6)
                llm = LLM(pretrained, dtype=dtype, device=device,
                          max_model_len=_int_or_none(max_length), tokenizer=tokenizer,
                          **engine_kwargs)
            self.llm = llm
            self.tokenizer = llm.get_tokenizer()
            if self.tokenizer is None:
                raise LLMAccelError("lm-eval needs the model's tokenizer (pass tokenizer=...)")
            self.model = llm.engine.model
            self.max_length = int(llm.engine.max_model_len)
            self.batch_size = _int_or_none(batch_size)
            self.max_batch_tokens = int(max_batch_tokens)
            self.max_gen_toks = int(max_gen_toks)
            self.rolling_stride = _int_or_none(rolling_stride)
            self.add_bos_token = add_bos_token
            self._device = llm.engine.device

        @property
        def prefix_token_id(self) -> int:
            return prefix_token_id(self.tokenizer)

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.tokenizer, "name_or_path", "llmaccel")).replace("/", "__")

        def apply_chat_template(self, chat_history: list[dict[str, str]],
                                add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            if chat_template is False or chat_template is None:
                return None
            return getattr(self.tokenizer, "chat_template", None)

        def loglikelihood(self, requests, disable_tqdm: bool = False
                          ) -> list[tuple[float, bool]]:
            pairs = [encode_pair(self.tokenizer, c, x, self.add_bos_token)
                     for c, x in (r.args for r in requests)]
            out = score_continuations(self.model, pairs, self.max_length,
                                      self.max_batch_tokens, self.batch_size)
            for r, res in zip(requests, out):
                self.cache_hook.add_partial("loglikelihood", r.args, res)
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            docs = [tok_encode(self.tokenizer, r.args[0], self.add_bos_token) for r in requests]
            out = rolling_loglikelihood(self.model, docs, self.prefix_token_id, self.max_length,
                                        self.rolling_stride, self.max_batch_tokens,
                                        self.batch_size)
            for r, res in zip(requests, out):
                self.cache_hook.add_partial("loglikelihood_rolling", r.args, res)
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            out = generate_texts(self.llm, self.tokenizer, [r.args for r in requests],
                                 self.max_length, self.max_gen_toks, self.add_bos_token)
            for r, res in zip(requests, out):
                self.cache_hook.add_partial("generate_until", r.args, res)
            return out

    return LLMAccelLM


__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "DEFAULT_MAX_GEN_TOKS", "INSTALL_HINT", "encode_pair",
           "generate_texts", "lm_eval_model_class", "prefix_token_id", "require_lm_eval",
           "rolling_loglikelihood", "rolling_requests", "sampling_params_for",
           "score_continuations", "tok_encode"]
