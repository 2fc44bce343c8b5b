"""Decide after each new token whether a sequence is done, and keep its text up to date."""

from __future__ import annotations

from llmaccel.engine.detokenizer import detokenize_incrementally, detokenize_rest
from llmaccel.engine.sequence import Sequence

class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, tokenizer=None) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def bans_any(self, seq: Sequence) -> bool:
        """Whether `banned_tokens` is non-empty, without building it (checked for every
        sequence at every step)."""
        p = seq.params
        return len(seq.output_token_ids) < p.min_tokens and bool(
            p.stop_token_ids or (not p.ignore_eos and self.eos_token_ids))

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """Ids that may not be sampled yet: EOS and stop ids before min_tokens outputs."""
        p = seq.params
        if not self.bans_any(seq):
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))

    def check_token(self, seq: Sequence) -> bool:
        """The checks that need only token ids (EOS, stop ids, max_tokens, max_model_len):
        cheap, so the engine runs them before launching the next step. True if done."""
        p = seq.params
        token = seq.output_token_ids[-1]
        n = len(seq.output_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finish_reason is None and (
                (p.max_tokens is not None and n >= p.max_tokens)
                or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    @staticmethod
    def defers_text(seq: Sequence) -> bool:
        """A sequence whose text nobody reads before it finishes: no stop strings to look for,
        and only its final output is wanted (LLM.generate). Its text is made once, when it
        finishes (`finish_text`), not token by token: at 256 running sequences the step-by-step
        decode was ~40% of the engine's host time per step (benchmarks/host_overhead.py)."""
        return not seq.params.stop and seq.params.output_kind == "final_only"

    def finish_text(self, seq: Sequence) -> None:
        """The text of the tokens not yet detokenized, all at once (a finished or aborted
        sequence; a no-op where the text is up to date)."""
        if self.tokenizer is not None:
            seq.text += detokenize_rest(self.tokenizer, seq.output_token_ids, seq.detokenizer,
                                        seq.params.skip_special_tokens)

    def update_text(self, seq: Sequence) -> bool:
        """Detokenize the new tokens and look for stop strings (a stop string overrides a
        length finish, or an EOS / stop id, of the same step, as it ends the text earlier).
        Several new tokens (accepted drafts) are taken one at a time, so a stop string ends
        the output at the token that completes it, as without speculation. (The engine does
        not call it for a running sequence that `defers_text`.) True if done."""
        p = seq.params
        if self.tokenizer is None:
            return seq.finish_reason is not None
        ids = seq.output_token_ids
        check = bool(p.stop) and seq.finish_reason != "abort" and not isinstance(
            seq.stop_reason, str)
        if not check and seq.finish_reason is not None:
            # the last text: up to the last complete character, however many tokens came
            self.finish_text(seq)
            return True
        first = seq.detokenizer.read_offset + 1 if check else len(ids)
        for end in range(min(first, len(ids)), len(ids) + 1):
            new_text = detokenize_incrementally(self.tokenizer, ids[:end], seq.detokenizer,
                                                p.skip_special_tokens)
            seq.text += new_text
            if (check and new_text and end >= p.min_tokens
                    and self._check_stop_strings(seq, len(new_text))):
                self._drop_after(seq, end)
                break
        return seq.finish_reason is not None

    @staticmethod
    def _drop_after(seq: Sequence, end: int) -> None:
        """Tokens after the one that completed a stop string are not output (they came in the
        same verified step): their ids, logprobs and share of the cumulative logprob go."""
        dropped = len(seq.output_token_ids) - end
        if dropped <= 0:
            return
        del seq.output_token_ids[end:]
        del seq.output_logprobs[end:]
        recent = seq.last_step_logprobs
        if len(recent) >= dropped:
            seq.cumulative_logprob -= sum(recent[len(recent) - dropped:])

    @staticmethod
    def _check_stop_strings(seq: Sequence, new_chars: int) -> bool:
        # Only a match that ends in the new text is new: search from just before it.
        start = max(0, len(seq.text) - new_chars - max(len(s) for s in seq.params.stop) + 1)
        hits = [(seq.text.find(s, start), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.text = seq.text[:end]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True
