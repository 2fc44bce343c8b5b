"""Speculative decoding counters, per request (`RequestOutput.metrics`) and per engine, with
vLLM's names where it has them (acceptance rate, mean acceptance length)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_steps: int = 0            # verify steps that carried at least one draft
    num_draft_tokens: int = 0     # drafts proposed (and scored by the target)
    num_accepted_tokens: int = 0  # drafts accepted
    num_emitted_tokens: int = 0   # tokens emitted by those steps (accepted + one each)
    num_rollbacks: int = 0        # steps that rejected a draft (its KV slots were given back)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    num_off_steps: int = 0        # engine steps run without speculation: it would not pay

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One request's verify step: it proposed num_draft tokens, accepted the first
        num_accepted of them and emitted num_accepted + 1."""
        if num_draft == 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        self.num_rollbacks += num_accepted < num_draft
        for counts, upto in ((self.drafted_per_position, num_draft),
                             (self.accepted_per_position, num_accepted)):
            if len(counts) < num_draft:
                counts.extend([0] * (num_draft - len(counts)))
            for i in range(upto):
                counts[i] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        for name in ("num_steps", "num_draft_tokens", "num_accepted_tokens",
                     "num_emitted_tokens", "num_rollbacks", "draft_time_s", "verify_time_s",
                     "num_off_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per verify step (vLLM's mean acceptance length: 1 + accepted/step)."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft i accepted | it was proposed), by position."""
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_emitted_tokens": self.num_emitted_tokens,
                "num_rollbacks": self.num_rollbacks,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_len": self.mean_accepted_len,
                "per_position_acceptance": self.per_position_acceptance,
                "accepted_per_position": list(self.accepted_per_position),
                "drafted_per_position": list(self.drafted_per_position),
                "draft_time_s": self.draft_time_s, "verify_time_s": self.verify_time_s,
                "num_off_steps": self.num_off_steps}
