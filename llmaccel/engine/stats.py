"""Engine statistics: what `/metrics` and progress displays report."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class EngineStats:
    num_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0            # fraction of KV blocks held by requests
    prefix_hit_rate: float = 0.0     # prompt tokens served from the prefix cache / looked up
    num_preemptions: int = 0
    num_steps: int = 0
    num_batched_tokens: int = 0      # tokens run through the model, all steps
    num_generated_tokens: int = 0
    num_async_steps: int = 0         # steps launched before the previous one's tokens arrived
    spec_decode: dict | None = None  # SpecDecodeStats.as_dict() when speculation is on

    def record_step(self, tokens: int, sampled: int, preempted: int) -> None:
        self.num_steps += 1
        self.num_batched_tokens += tokens
        self.num_generated_tokens += sampled
        self.num_preemptions += preempted

    def snapshot(self, scheduler, block_manager) -> EngineStats:
        cache = block_manager.cache
        return replace(self, num_running=len(scheduler.running),
                       num_waiting=len(scheduler.waiting), kv_usage=block_manager.usage,
                       prefix_hit_rate=cache.hit_rate if cache is not None else 0.0)
