"""`SpeculativeConfig`: which proposer drafts tokens for the target model, and how many.

Names follow vLLM's `speculative_config` (`method`, `model`, `num_speculative_tokens`,
`prompt_lookup_min` / `prompt_lookup_max` for n-gram lookup, `disable_by_batch_size`), so a
config carries over; the adaptive settings are ours (see `spec/adaptive.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmaccel.errors import LLMAccelError

METHODS = ("draft", "ngram", "head")
# The most verify rows of one sequence with tree drafts (engine/model_runner.DECODE_ROWS_MAX:
# a step that gives a sequence more tokens runs the prefill kernel, which has no tree mask).
MAX_TREE_ROWS = 16


class SpeculativeConfigError(LLMAccelError, ValueError):
    """A speculative-decoding setting that cannot work, named in the message."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # draft: a model with the target's tokenizer (HF id, local dir or GGUF); head: a trained
    # draft head's directory. None for ngram.
    model: str | None = None
    num_speculative_tokens: int = 4  # k: the most tokens proposed per step
    prompt_lookup_min: int = 1  # n-gram: shortest suffix looked up in the context
    prompt_lookup_max: int = 4  # n-gram: longest suffix looked up (tried first)
    # Adaptive speculation: per-request k from recent acceptance (spec/adaptive.py) ...
    adaptive: bool = True
    # ... and a draft model stops drafting once its top probability falls below this (0: off).
    draft_confidence_threshold: float = 0.0
    # With this many running requests or more, steps run as plain decoding and no speculative
    # work is done for them at all (no drafts, no n-gram indexing, no switch measurements):
    # a measured crossover, configured (None: no fixed limit).
    disable_by_batch_size: int | None = None
    # Below that, where the engine measured its step costs (GPU, CUDA graphs), the automatic
    # switch (spec/switch.py) turns speculation off at batch sizes where it measures slower
    # than plain decoding; False: speculate at every step below disable_by_batch_size.
    auto_disable: bool = True
    # Draft step cost relative to a target step, for the adaptive k (None: measured at run time).
    draft_cost_ratio: float | None = None
    draft_quantization: str | None = None  # the draft model's quantization, if any
    # head: score only the first N tokens of its draft_vocab.json (None: all it lists, or the
    # whole vocabulary when it has none; 0: the whole vocabulary). vLLM's EAGLE-3 name.
    draft_vocab_size: int | None = None
    # draft / head: where n-gram lookup in the context (prompt_lookup_min..max) finds a match,
    # draft from it and not from the model that round (copying prompts: code rewrites, quotes,
    # where lookup is accepted often and costs nothing to draft); the model drafts the rest.
    # Such rounds draft after verification (no overlapped drafting: the lookup needs the
    # accepted tokens).
    ngram_first: bool = False
    # ngram_first: the most tokens a lookup drafts in a round (None: as the model,
    # num_speculative_tokens). A matched span of a copied text is usually accepted far past the
    # model's k, and at small batches a verify step with a few more rows costs about the same
    # (its graph is padded to 8 rows at k = 4 anyway). HF transformers' name for prompt lookup.
    prompt_lookup_num_tokens: int | None = None
    # head: candidates per draft depth (SGLang's speculative_eagle_topk). The top-1 continues
    # the chain; the other topk - 1 are verified as leaves beside it (spec/tree.py), for greedy
    # requests. 1: a plain chain. A verify step runs 1 + k * topk rows per sequence (at most
    # MAX_TREE_ROWS, the decode rows a step gives one sequence).
    draft_topk: int = 1
    # draft / head: launch the next round's drafts while the verify step runs (spec/overlap.py;
    # greedy rounds of a steady batch). False drafts after verification, every round.
    draft_overlap: bool = True
    # draft / head: with CUDA graphs, a round's k - 1 chained draft steps replay as one graph.
    draft_chain: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS,
             f"method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (self.num_speculative_tokens >= 1,
             f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"),
            (self.prompt_lookup_min >= 1,
             f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}"),
            (self.prompt_lookup_max >= self.prompt_lookup_min,
             (f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
             f"({self.prompt_lookup_min})")),
            (0.0 <= self.draft_confidence_threshold < 1.0,
             (f"draft_confidence_threshold must be in [0, 1), got "
             f"{self.draft_confidence_threshold}")),
            (self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
             f"disable_by_batch_size must be >= 1 or None, got {self.disable_by_batch_size}"),
            (self.draft_cost_ratio is None or self.draft_cost_ratio >= 0.0,
             f"draft_cost_ratio must be >= 0, got {self.draft_cost_ratio}"),
            (self.draft_vocab_size is None or self.draft_vocab_size >= 0,
             f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}"),
            (self.draft_vocab_size is None or self.method == "head",
             "draft_vocab_size applies to method='head' (a draft head's vocabulary)"),
            (not self.ngram_first or self.method != "ngram",
             "ngram_first applies to method='draft' or 'head' (n-gram lookup before the "
             "model); method='ngram' drafts by lookup alone"),
            (self.prompt_lookup_num_tokens is None or self.prompt_lookup_num_tokens >= 1,
             f"prompt_lookup_num_tokens must be >= 1, got {self.prompt_lookup_num_tokens}"),
            (self.prompt_lookup_num_tokens is None or self.ngram_first,
             "prompt_lookup_num_tokens applies with ngram_first (method='ngram' drafts "
             "num_speculative_tokens)"),
            (self.draft_topk >= 1, f"draft_topk must be >= 1, got {self.draft_topk}"),
            (self.draft_topk == 1 or self.method == "head",
             "draft_topk > 1 applies to method='head' (tree verification of its drafts)"),
            (self.draft_topk == 1 or self.draft_confidence_threshold == 0.0,
             "draft_topk > 1 needs draft_confidence_threshold=0 (drafts stay on the device)"),
            (1 + self.num_speculative_tokens * self.draft_topk <= MAX_TREE_ROWS,
             (f"num_speculative_tokens * draft_topk must be <= {MAX_TREE_ROWS - 1} (a verify "
              f"step's rows per sequence), got {self.num_speculative_tokens} * "
              f"{self.draft_topk}")),
            (self.method == "ngram" or self.model,
             f"method={self.method!r} needs `model` (the draft model or head to load)"),
            (self.method != "ngram" or self.model is None,
             "method='ngram' drafts from the context and takes no `model`"),
        ]
        for ok, message in checks:
            if not ok:
                raise SpeculativeConfigError(message)

    @property
    def max_drafts(self) -> int:
        """The most drafts any sequence gets in a round (what a verify step's rows allow
        for)."""
        return max(self.num_speculative_tokens, self.prompt_lookup_num_tokens or 0)

    def speculate_at(self, batch_size: int) -> bool:
        """Whether a step with `batch_size` running requests speculates (vLLM's
        disable_by_batch_size: large batches are compute-bound, where drafting only costs)."""
        return self.disable_by_batch_size is None or batch_size < self.disable_by_batch_size
