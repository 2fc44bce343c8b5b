"""Perplexity by the standard sliding-window method (docs/workloads.md W6), through our engine's
model, so every checkpoint format the engine loads (bf16, GPTQ, AWQ, compressed-tensors,
bitsandbytes NF4, FP8) is measured the same way.

The evaluation text is tokenized once as one stream. Windows of `context` tokens start every
`stride` tokens (the last one is cut at the end of the stream); each window's logits score
only the tokens no earlier window scored, so with stride == context every token except the
first of each window is scored once, and with stride < context each scored token has at least
context - stride tokens of history. This is the method of the Hugging Face "perplexity of
fixed-length models" guide, with the loss averaged over scored tokens (not over windows).
PPL = exp(sum of token NLLs / number of scored tokens).

WikiText-2 rows: `joining="hf"` joins the rows of the `datasets` split with "\\n\\n" (the usual
recipe: each non-blank line of wiki.test.raw is a row keeping its "\\n", a blank line is the
row ""); `joining="raw"` is the file's text as is. Results state context, stride and joining.

Backends (`backend`): "llmaccel" runs our engine's model; "hf" runs transformers'
AutoModelForCausalLM and takes its own loss (labels -100 outside the scored tokens), over the same
windows and the same token ids from the same tokenizer: an independent check of our forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from llmaccel.data import JOININGS, find_text, join_rows
from llmaccel.errors import LLMAccelError
from llmaccel.models.attention import AttentionMetadata

# Who computes the NLLs: our engine's model, or transformers' AutoModelForCausalLM with its own
# loss (eval/hf_perplexity.py): an independent check over the same windows and token ids.
BACKENDS = ("llmaccel", "hf")
LOGITS_CHUNK = 512  # rows of logits in memory at once (a 152k vocabulary: 300 MB in fp32)


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float              # mean negative log-likelihood per scored token (nats)
    scored_tokens: int
    total_tokens: int       # tokens in the evaluated stream
    windows: int
    context: int
    stride: int
    data: str
    joining: str
    seconds: float
    backend: str = "llmaccel"  # one of BACKENDS
    quantization: str | None = None  # the scheme applied before measuring (--quantization)
    quantization_config: dict[str, Any] | None = None  # its method, bits, group, format, ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)




def load_eval_text(data: str, joining: str = "hf") -> tuple[str, str]:
    """(text, joining applied) of `data`'s test split (llmaccel.data.find_text): WikiText-2
    rows joined by `joining`; a text file or a dataset's text as it is ("file")."""

    found = find_text(data, "test")
    text = found.read()
    return (join_rows(text, joining), joining) if found.wikitext_rows else (text, "file")


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index) of each window over a stream of num_tokens tokens.
    Token t is scored from the logits at t - 1, inside the window; indices are absolute."""
    if context < 2:
        raise LLMAccelError(f"context must be at least 2 tokens, got {context}")
    if not 1 <= stride <= context:
        raise LLMAccelError(f"stride must be in 1..context ({context}), got {stride}")
    if num_tokens < 2:
        raise LLMAccelError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    out, scored_until = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        first = max(begin + 1, scored_until)
        if first < end:
            out.append((begin, end, first))
        scored_until = end
        if end == num_tokens:
            break
    return out


@torch.inference_mode()
def window_nll(model, ids: torch.Tensor, first: int) -> tuple[float, int]:
    """Sum of NLLs (nats, fp64) of ids[first:] given their prefix in the window, and how many:
    one forward pass of our model over the window (no KV cache)."""
    n = ids.shape[0]
    meta = AttentionMetadata.for_prefill([n], ids.device)
    hidden = model(ids, torch.arange(n, device=ids.device), meta)
    total = 0.0
    for start in range(first - 1, n - 1, LOGITS_CHUNK):
        stop = min(start + LOGITS_CHUNK, n - 1)
        logits = model.compute_logits(hidden[start:stop]).float()
        targets = ids[start + 1:stop + 1]
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, targets[:, None])[:, 0]
        total += float((lse - picked).double().sum())
    return total, n - first


# (window ids, index of its first scored token) -> (sum of NLLs in nats, tokens scored)
WindowNLL = Callable[[torch.Tensor, int], tuple[float, int]]


def sliding_window_perplexity(window_fn: WindowNLL, ids: torch.Tensor, context: int,
                              stride: int | None = None, limit: int | None = None,
                              data: str = "", joining: str = "", progress: bool = False,
                              backend: str = "llmaccel") -> PerplexityResult:
    """The sliding-window loop shared by every backend: `window_fn` scores one window."""
    start_time = time.perf_counter()
    stride = context if stride is None else stride
    spans = windows(ids.shape[0], context, stride)
    if limit is not None:
        if limit < 1:
            raise LLMAccelError(f"limit must be at least 1 window, got {limit}")
        spans = spans[:limit]
    total, count = 0.0, 0
    bar = None
    if progress:
        from llmaccel.progress import progress_bar

        bar = progress_bar()
        bar.start()
        task = bar.add_task("perplexity", total=len(spans))
    try:
        for begin, end, first in spans:
            nll, n = window_fn(ids[begin:end], first - begin)
            total += nll
            count += n
            if bar is not None:
                bar.update(task, advance=1,
                           description=f"perplexity {math.exp(total / count):.3f}")
    finally:
        if bar is not None:
            bar.stop()
    mean = total / count
    return PerplexityResult(ppl=math.exp(mean), nll=mean, scored_tokens=count,
                            total_tokens=int(ids.shape[0]), windows=len(spans), context=context,
                            stride=stride, data=data, joining=joining,
                            seconds=time.perf_counter() - start_time, backend=backend)


def perplexity(model, token_ids: list[int] | torch.Tensor, context: int, stride: int | None = None,
               limit: int | None = None, data: str = "", joining: str = "",
               progress: bool = False) -> PerplexityResult:
    """Perplexity of `model` (our TransformerForCausalLM) on a token stream. `limit`: at most
    this many windows (a quick, partial figure: the result's scored_tokens says how much)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    return sliding_window_perplexity(partial(window_nll, model), ids, context, stride, limit,
                                     data=data, joining=joining, progress=progress,
                                     backend="llmaccel")


def tokenize_eval_text(mc, text: str, tokenizer: str | None = None) -> list[int]:
    """The evaluation text's token ids through the engine's tokenizer (`get_tokenizer`): every
    backend is given these very ids."""
    from llmaccel.models.tokenizer import get_tokenizer

    return list(get_tokenizer(mc, tokenizer)(text).input_ids)


def evaluate_perplexity(model: str, *, data: str = "wikitext2", joining: str = "hf",
                        context: int = 2048, stride: int | None = None, limit: int | None = None,
                        dtype: str = "auto", device: str | None = None,
                        tokenizer: str | None = None, progress: bool = False,
                        backend: str = "llmaccel", quantization: str | None = None,
                        quantized_dir: str | None = None) -> PerplexityResult:
    """Load `model` (any source and checkpoint format the engine reads) and measure it, through
    our engine (backend "llmaccel") or transformers (backend "hf").

    `quantization`: a scheme of docs/workloads.md (rtn-int8, rtn-int4-g128, nf4, hqq-int4,
    gptq-int4-g128, awq-int4-g128, fp8) applied to `model` first, as `llmaccel quantize` does,
    into `quantized_dir` (kept) or a temporary directory (removed); the engine measures it."""
    if backend not in BACKENDS:
        raise LLMAccelError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    text, joined = load_eval_text(data, joining)  # missing data fails before any model loads
    if quantization is not None:
        return _evaluate_quantized(model, quantization, quantized_dir, data=data,
                                   joining=joining, context=context, stride=stride,
                                   limit=limit, dtype=dtype, device=device, tokenizer=tokenizer,
                                   progress=progress, backend=backend)
    if backend == "hf":
        from llmaccel.eval.hf_perplexity import hf_perplexity, load_hf_causal_lm
        from llmaccel.models.config import make_model_config

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        mc = make_model_config(model, dtype=dtype, max_model_len=context, device=dev)
        token_ids = tokenize_eval_text(mc, text, tokenizer)
        hf = load_hf_causal_lm(mc, dev)
        return hf_perplexity(hf, token_ids, context, stride, limit, data=data, joining=joined,
                             progress=progress)
    from llmaccel.models.loader import load_model

    mc, net = load_model(model, dtype=dtype, device=device, max_model_len=context,
                         progress=progress)
    if context > mc.max_model_len:
        raise LLMAccelError(f"context {context} exceeds the model's {mc.max_model_len} positions")
    token_ids = tokenize_eval_text(mc, text, tokenizer)
    return perplexity(net, token_ids, context, stride, limit, data=data, joining=joined,
                      progress=progress)


def _evaluate_quantized(model: str | None, scheme: str, quantized_dir: str | None,
                        **kwargs: Any) -> PerplexityResult:
    import dataclasses
    import tempfile

    from llmaccel.quant.schemes import check_scheme, hf_source, quantize_scheme

    check_scheme(scheme)  # an unknown name fails before any work
    if model is None:
        from llmaccel.models.default_model import default_model_path

        model = str(default_model_path())
    with tempfile.TemporaryDirectory(prefix="llmaccel-ppl-") as tmp:
        src = hf_source(model, Path(tmp))
        out = Path(quantized_dir) if quantized_dir else Path(tmp) / scheme
        done = quantize_scheme(src, scheme, out, device=kwargs["device"], data=kwargs["data"],
                               show_progress=kwargs["progress"])
        res = evaluate_perplexity(str(done.path), **kwargs)
    return dataclasses.replace(res, quantization=scheme, quantization_config=done.config)


__all__ = ["BACKENDS", "JOININGS", "PerplexityResult", "WindowNLL", "evaluate_perplexity",
           "join_rows", "load_eval_text", "perplexity",
           "sliding_window_perplexity", "tokenize_eval_text", "window_nll", "windows"]
