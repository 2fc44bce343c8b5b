"""`LLM`: the offline API (vLLM's): generate for a batch of prompts, chat with a template."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from llmaccel.engine.config import EngineConfig
from llmaccel.engine.llm_engine import LLMEngine
from llmaccel.engine.outputs import RequestOutput
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.engine.stats import EngineStats
from llmaccel.errors import LLMAccelError

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """LLM(model, dtype=..., max_model_len=..., enable_prefix_caching=..., ...): every keyword
    of `EngineConfig`. `model` is a path, hub id, .gguf file or benchmark shape name."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. A request that is rejected (too long, empty, bad ids) comes
        back finished with `error` set; the others still run."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise LLMAccelError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Only finished requests are collected here: skip building outputs every step.
        params = [replace(p, output_kind="final_only") for p in params]
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = str(next(self._ids))
            text, ids = _split_prompt(prompt)
            try:
                self.engine.add_request(request_id, ids if ids is not None else text, p,
                                        prompt_text=text)
                order[request_id] = i
            except LLMAccelError as e:
                results[i] = RequestOutput(request_id, text, ids or [], [], True, error=str(e))
        self._run(order, results, use_tqdm)
        return results  # type: ignore[return-value]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        tok = self.get_tokenizer()
        if tok is None or not getattr(tok, "chat_template", None):
            raise LLMAccelError("chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                          tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, order: dict[str, int], results: list, use_tqdm: bool) -> None:
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"), TimeRemainingColumn(),
                   TextColumn("{task.fields[rate]}"))
        with Progress(*columns, transient=True, disable=not use_tqdm) as bar:
            task = bar.add_task("generating", total=len(order), rate="")
            generated = 0
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(task, advance=1, rate=f"{generated} tokens")


def _as_prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise LLMAccelError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return None, list(prompt)
