"""LLMEngine: requests in, one scheduled forward pass per `step()`, RequestOutputs out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from llmaccel.engine.block_manager import BlockManager
from llmaccel.engine.config import EngineConfig
from llmaccel.engine.isolation import FailureIsolation
from llmaccel.engine.kv_cache import allocate_kv_caches, bytes_per_block, resolve_kv_cache_dtype
from llmaccel.engine.model_runner import ModelRunner
from llmaccel.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmaccel.engine.sampler import SampleResult, make_generator, sample_with_logprobs
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.engine.scheduler import Scheduler, SchedulerOutput
from llmaccel.engine.sequence import Sequence, SequenceStatus
from llmaccel.engine.sizing import capture_sizes, profile_num_blocks
from llmaccel.spec.decoder import SpecDecoder
from llmaccel.engine.stats import EngineStats
from llmaccel.engine.stop_checker import StopChecker
from llmaccel.errors import LLMAccelError
from llmaccel.kernels.greedy_select import greedy_with_logprobs
from llmaccel.models.config import make_model_config
from llmaccel.models.loader import get_model
from llmaccel.models.tokenizer import eos_token_ids, get_tokenizer
from llmaccel.spec.costs import measure_step_costs
from llmaccel.spec.head_proposer import HeadProposer, feature_bytes_per_block, load_head_for
from llmaccel.spec.draft_model import DraftModelProposer, load_draft_model

logger = logging.getLogger(__name__)

# Stands for a token still being computed on the device (async scheduling); never a real id.
PLACEHOLDER_TOKEN = -1


@dataclass(eq=False)
class _Launched:
    """A step whose forward pass is on the device and whose tokens are not yet on the host."""
    sched: SchedulerOutput
    sampling: list[Sequence]          # sequences that sample a token this step, row order
    logits: torch.Tensor
    greedy: torch.Tensor | None       # [2, rows] argmax ids and logprobs, on the device
    plain: bool = False               # every row greedy, no logprobs, nothing banned (async)
    greedy_host: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # copied early
    # a verify step's greedy [2, rows], copied out before the next round's drafts were
    # launched behind it (spec/overlap.py): reading the device tensor would wait for them
    verify_host: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
    # logits rows of each sampling sequence (1 + its drafts), fixed at launch: a sequence
    # that finishes before the step completes (a stop string) loses its drafts meanwhile
    rows_per_seq: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    pending_forks: list[Sequence] = field(default_factory=list)  # n > 1: wait for the prefill
    arrival_time: float = field(default_factory=time.monotonic)
    finished_time: float | None = None
    error: str | None = None  # why the engine failed it (its sequences end with "error")

    @property
    def finished(self) -> bool:
        return not self.pending_forks and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_config = mc = make_model_config(
            config.model, dtype=config.dtype, max_model_len=config.max_model_len,
            load_format=config.load_format, device=device, hf_overrides=config.hf_overrides)
        self.device, self.max_model_len = device, mc.max_model_len
        self.model = get_model(mc, device, attention_backend=config.attention_backend,
                               seed=config.seed)
        # a draft model loads before the KV pool is sized: its weights and KV take a share
        self.draft_model = load_draft_model(config, mc, device)
        self.draft_head = load_head_for(config, self.model, mc, device)
        self.tokenizer = None
        if not config.skip_tokenizer_init and (mc.source.kind != "shape" or config.tokenizer):
            self.tokenizer = get_tokenizer(mc, config.tokenizer)
        self.max_num_batched_tokens = config.max_num_batched_tokens or (
            8192 if config.enable_chunked_prefill else max(8192, mc.max_model_len))
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < mc.max_model_len:
            raise LLMAccelError(f"without chunked prefill, max_num_batched_tokens "
                                f"({self.max_num_batched_tokens}) must cover max_model_len "
                                f"({mc.max_model_len})")
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, mc.dtype, device, self.model.attention_backend.name)
        bs = config.block_size
        # every KV block's share of the proposer's pools: its own KV, and for a head the
        # target's features it reads
        proposer = self.draft_model or self.draft_head
        spec_bytes = 0 if proposer is None else bytes_per_block(proposer, bs,
                                                                self.kv_cache_dtype)
        if self.draft_head is not None:
            spec_bytes += feature_bytes_per_block(self.draft_head, bs, mc.dtype)
        num_blocks = config.num_gpu_blocks or profile_num_blocks(
            config, self.model, mc.max_model_len, self.max_num_batched_tokens,
            self.kv_cache_dtype, device, spec_bytes)
        if num_blocks * bs < mc.max_model_len:
            raise LLMAccelError(f"the KV cache holds {num_blocks * bs} tokens, fewer than "
                                f"max_model_len={mc.max_model_len}; lower max_model_len or give "
                                "the cache more memory")
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   self.max_num_batched_tokens, config.enable_chunked_prefill)
        if self.draft_head is not None:  # before the target's graphs are captured
            self.model.model.aux_hidden_state_layers = self.draft_head.model.aux_layers
            self.model.feature_cache = torch.zeros(num_blocks * bs + 1,
                                                   self.draft_head.model.feature_width,
                                                   dtype=mc.dtype, device=device)
        spec_cfg = config.speculative_config
        topk = 1 if spec_cfg is None else spec_cfg.draft_topk
        if topk > 1 and self.model.attention_backend.name not in ("triton", "torch"):
            raise LLMAccelError(f"speculative draft_topk={topk} (tree verification) needs the "
                                "triton or torch attention backend, not "
                                f"{self.model.attention_backend.name!r}")
        self.runner = ModelRunner(self.model, allocate_kv_caches(
            self.model, num_blocks, bs, self.kv_cache_dtype, device), bs, mc.max_model_len,
            capture_sizes(config, device, max_num_batched_tokens=self.max_num_batched_tokens),
            tree_rows=topk > 1)
        self.stop_checker = StopChecker(eos_token_ids(mc, self.tokenizer), mc.max_model_len,
                                        self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._deferred: list[Sequence] = []  # sampled last step, outputs not yet built
        self._outputs: list[RequestOutput] = []  # this step's, kept however the step ends
        self.isolation = FailureIsolation()
        self.scheduler.held = self.isolation.held  # one set: the scheduler admits none of these
        self._causes_logged: set[tuple[str, str]] = set()
        self._ahead: _Launched | None = None  # async scheduling: the next step, launched early
        # pinned staging for early token copies (_copy_to_host): 0 for plain copies, 1 and 2
        # in turn for those the next launch makes
        self._greedy_host: list[torch.Tensor | None] = [None, None, None]
        self._flip_host = 1
        self.stats = EngineStats(num_blocks=num_blocks)
        self.spec = None
        if config.speculative_config is not None:
            draft = None
            sizes = capture_sizes(config, device, draft=True,
                                  max_num_batched_tokens=self.max_num_batched_tokens)
            k = config.speculative_config.num_speculative_tokens
            if self.draft_model is not None:
                draft = DraftModelProposer(self.draft_model, num_blocks, bs, mc.max_model_len,
                                           self.kv_cache_dtype, device, sizes, k,
                                           draft_chain=spec_cfg.draft_chain)
            elif self.draft_head is not None:
                draft = HeadProposer(self.draft_head, self.model, num_blocks, bs,
                                     mc.max_model_len, self.kv_cache_dtype, device, sizes, k,
                                     draft_topk=topk, draft_chain=spec_cfg.draft_chain)
            self.spec = SpecDecoder(config.speculative_config, mc.max_model_len,
                                    self.stop_checker, draft)
            self.spec.move_slots = self.runner.move_slots
            self.spec.costs = measure_step_costs(self.runner, draft)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s", num_blocks, bs,
                    num_blocks * bs, str(self.kv_cache_dtype).removeprefix("torch."))

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, prompt_text: str | None = None) -> None:
        """Queue a request (text or token ids; `prompt_text` names token ids in outputs);
        raises LLMAccelError naming what is wrong with it."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise LLMAccelError(f"request id '{request_id}' is already in use")
        text = prompt if isinstance(prompt, str) else prompt_text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LLMAccelError("text prompts need a tokenizer; pass token ids instead")
            prompt = self.tokenizer(prompt).input_ids
        ids = [int(t) for t in prompt]
        vocab = self.model_config.hf_config.vocab_size
        if not ids:
            raise LLMAccelError("the prompt is empty")
        if any(t < 0 or t >= vocab for t in ids):
            raise LLMAccelError(f"the prompt has token ids outside the vocabulary (0..{vocab - 1})")
        if len(ids) >= self.max_model_len:
            raise LLMAccelError(f"the prompt has {len(ids)} tokens; max_model_len is "
                                f"{self.max_model_len}, which leaves no room to generate")
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:  # the sampler would index past the logits and fail the whole step
            raise LLMAccelError(f"stop_token_ids {bad_stops} are outside the vocabulary "
                                f"(0..{vocab - 1})")
        if params.stop and self.tokenizer is None:
            raise LLMAccelError("stop strings need a tokenizer (the engine runs without one: "
                                "skip_tokenizer_init); use stop_token_ids")
        seqs = [Sequence(request_id, i, ids, params, make_generator(
            None if params.seed is None else params.seed + i, self.device))
            for i in range(params.n)]
        req = Request(request_id, text, ids, seqs, pending_forks=seqs[1:])
        self.requests[request_id] = req
        self.isolation.on_add(request_id)
        self.scheduler.add(seqs[0])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self._end_request(request_id, "abort")

    def _end_request(self, request_id: str, reason: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.isolation.forget(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
            if self.spec is not None:
                self.spec.release(seq)
        for seq in req.pending_forks:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        req.pending_forks = []
        for seq in req.seqs:  # the text of tokens not yet detokenized (all, where deferred)
            try:
                self.stop_checker.finish_text(seq)
            except Exception:  # noqa: BLE001 - a request failing in its detokenizer ends anyway
                if reason != "error":
                    raise
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step (`_step`). A step that raises fails only the request that makes it
        fail: the engine recomputes the step's requests and tries them one at a time
        (FailureIsolation); the failed request comes back finished, with `error` set and
        finish_reason "error", and the others go on. Outputs are never lost to a failure."""
        if self.isolation.active or self.isolation.held:
            self.isolation.next_probation(self.requests.__contains__)
        try:
            self._step()
        except Exception as e:  # noqa: BLE001 - one request's failure, not the engine's
            self._recover(e)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _step(self) -> None:
        """Schedule and launch one forward pass; while the GPU runs it, finish the host work
        of the previous step (detokenization, stop strings, outputs); then sample.

        Outputs therefore come one step late, and the GPU never waits for the tokenizer. The
        checks that decide whether a sequence takes part in the next step (EOS, stop ids,
        max_tokens) run right after sampling; only a stop string is noticed one step late, and
        the token computed meanwhile for that sequence is dropped, so outputs are unchanged.

        With `async_scheduling`, a greedy step of an unchanged running set also launches the
        next step before sampling (its input ids are this step's argmax, still on the device):
        that step is the one the next call samples. A sequence that stops meanwhile (EOS, stop
        id) has its extra token dropped the same way.
        """
        start = time.perf_counter()
        launched, self._ahead = self._ahead, None
        ahead = launched is not None  # launched by the previous call (async scheduling)
        if launched is None:
            if self.spec is not None:
                self.spec.propose(self.scheduler.running, len(self.scheduler.waiting))
            sched = self.scheduler.schedule()
            if self.spec is not None:
                for seq in sched.preempted:
                    self.spec.release(seq)
            if not sched:
                self._process_outputs()
                # Config checks guarantee any single request fits; an empty step with work
                # waiting would loop forever, so it is a bug worth a loud error.
                if not self._outputs and self.scheduler.waiting and not self.scheduler.running:
                    raise RuntimeError("the scheduler could not admit the next waiting request")
                return
            launched = self._launch(sched)
            if self.spec is not None and self.spec.pending is not None:
                # the next round's drafts, from this verify step on the device (spec/overlap.py)
                launched.verify_host = self.spec.overlap(
                    launched.sampling, launched.logits, launched.greedy, launched.rows_per_seq,
                    self.scheduler.running, len(self.scheduler.waiting), self._copy_to_host)
        self._process_outputs()  # overlaps the GPU
        if self.spec is not None:
            # so does n-gram indexing
            self.spec.index_running(self.scheduler.running, len(self.scheduler.waiting))
        kind = None if self.spec is None else self.spec.step_kind(launched.sched)
        # With speculation off for this batch (spec.off), steps run as plain decoding, async
        # scheduling included, until the running set changes or the next round probes.
        # not while a failed step's requests are tried one at a time: a launch ahead would
        # take the next step's failure for this one's
        if self.config.async_scheduling and not self.isolation.active and (
                self.spec is None or self.spec.may_launch_ahead(len(self.scheduler.running))):
            self._ahead = self._launch_ahead(launched)
            if self._ahead is not None and self.spec is not None:
                self.spec.skip_round(len(self.scheduler.running))
        emitted = self._complete(launched)
        if self.isolation.probation is not None:
            self.isolation.passed(seq.request_id for seq in launched.sampling)
        if self.spec is not None:  # measured throughput of speculating or not, per batch size
            # a plain step is steady when launched ahead, or where it could not have been
            steady = ahead or not (self.config.async_scheduling and launched.plain)
            if kind is not None and any(seq.is_finished for seq, _ in launched.sched.scheduled):
                # requests finished: tokens computed past their end are dropped, and their
                # teardown is host time no steady round has; neither mode's rate
                kind = None
            self.spec.record_step(kind, emitted, time.perf_counter() - start, steady)

    def _recover(self, exc: Exception) -> None:
        """After a failed step: fail the request that made it fail, if known; recompute the
        others (the step's KV writes and the blocks it published may never have happened)."""
        in_step = [seq.request_id for seq in self.scheduler.running]
        if not in_step:
            raise exc  # nothing was computing: not a request's failure
        culprit = self.isolation.on_failure(in_step)
        cause = f"{type(exc).__name__}: {exc}"
        first = (type(exc).__name__, str(exc)) not in self._causes_logged
        self._causes_logged.add((type(exc).__name__, str(exc)))
        if culprit is None:
            logger.warning("an engine step of %d requests failed (%s); running them again one "
                           "at a time to find the one that fails", len(set(in_step)), cause,
                           exc_info=exc if first else None)
        self._ahead = None
        if self.spec is not None:
            self.spec.pending = None
        for seq in self.scheduler.running:
            if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER_TOKEN:
                seq.output_token_ids.pop()
            if self.spec is not None:
                self.spec.release(seq)
        self.scheduler.requeue_running()
        self.block_manager.pending_copies = []
        self.block_manager.reset_prefix_cache()
        if culprit is not None:
            logger.error("request %s failed in the engine and was stopped; the others go on: "
                         "%s", culprit, cause, exc_info=exc if first else None)
            self._fail_request(culprit, cause)

    def _fail_request(self, request_id: str, cause: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        req.finished_time, req.error = time.monotonic(), cause
        out = self._end_request(request_id, "error")
        if out is not None:
            self._outputs.append(out)

    def _launch(self, sched: SchedulerOutput,
                input_ids: torch.Tensor | None = None) -> _Launched:
        self.runner.copy_blocks(self.block_manager.take_pending_copies())
        drafts = None if self.spec is None else self.spec.device_drafts()
        sampling, logits, greedy = self.runner.execute(sched, input_ids, drafts)
        for seq, n in sched.scheduled:
            if not seq.is_finished:
                seq.num_computed_tokens += n
        plain = bool(sampling) and self.config.async_scheduling and self._plain(sampling)
        if greedy is None and plain:
            greedy = greedy_with_logprobs(logits)  # eager steps: argmax on the device too
        return _Launched(sched, sampling, logits, greedy, plain,
                         rows_per_seq=[1 + len(seq.spec_token_ids) + len(seq.spec_sibling_ids)
                                       for seq in sampling])

    def _plain(self, seqs: list[Sequence]) -> bool:
        """Greedy, no logprobs, nothing banned: the token is the argmax."""
        return all(s.params.greedy and s.params.logprobs is None
                   and not self.stop_checker.bans_any(s) for s in seqs)

    def _launch_ahead(self, launched: _Launched) -> _Launched | None:
        """Launch the step after `launched` now, with its argmax as input ids, if every one of
        its rows goes on decoding greedily: the same running set in the same order, no one at
        its last token, no request waiting for admission, no fork pending, KV blocks free."""
        seqs = launched.sampling
        if (not launched.plain or launched.greedy is None or self.scheduler.waiting
                or len(seqs) != len(launched.sched.scheduled) or seqs != self.scheduler.running):
            return None
        for seq in seqs:
            req = self.requests.get(seq.request_id)
            last = seq.params.max_tokens
            if (req is None or req.pending_forks or seq.is_finished
                    or (last is not None and len(seq.output_token_ids) + 1 >= last)
                    or seq.num_tokens + 1 >= self.max_model_len):
                return None
        for seq in seqs:
            seq.output_token_ids.append(PLACEHOLDER_TOKEN)
        sched = self.scheduler.schedule_decode_ahead(seqs)
        if sched is None:
            for seq in seqs:
                seq.output_token_ids.pop()
            return None
        # The next launch may overwrite the device buffer these tokens are in (a CUDA graph
        # reuses its outputs): copy them out first, without waiting. With CUDA graphs the
        # next step's input kernel writes them to the host itself (no copy of their own on
        # the stream between the two graphs: CUDAGraphRunner.copy_out_next).
        launched.greedy_host = self._copy_to_host(launched.greedy, before_next_launch=True)
        ahead = self._launch(sched, launched.greedy[0, :len(seqs)])
        self.stats.num_async_steps += 1
        return ahead

    def _copy_to_host(self, t: torch.Tensor, before_next_launch: bool = False
                      ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`t` copied into pinned host memory asynchronously, and the event of the copy.
        `before_next_launch` (the next call is `_launch`): the runner's next launch makes the
        copy (`CUDAGraphRunner.copy_out_next`), into pinned buffers 1 and 2 in turn."""
        if not t.is_cuda:
            return t.clone(), None
        graphs = getattr(self.runner, "graphs", None)
        if before_next_launch and graphs is not None:
            self._flip_host = 3 - self._flip_host
            out = self._pinned(t, self._flip_host)
            event = torch.cuda.Event()
            graphs.copy_out_next(t, out, event)
            return out, event
        out = self._pinned(t, 0)
        out.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return out, event

    def _pinned(self, t: torch.Tensor, which: int) -> torch.Tensor:
        """A contiguous view of t's shape in pinned staging buffer `which` (0, 1 or 2)."""
        numel = t.numel()
        buf = self._greedy_host[which]
        if buf is None or buf.numel() < numel or buf.dtype != t.dtype:
            size = max(numel, t.shape[0] * self.config.max_num_seqs)
            buf = self._greedy_host[which] = torch.empty(size, dtype=t.dtype, pin_memory=True)
        return buf[:numel].view(t.shape)  # contiguous, so a copy stays asynchronous

    def _complete(self, launched: _Launched) -> int:
        """Sample the launched step's tokens (the one host sync), apply them and the checks
        that decide the next step (EOS, stop ids, max_tokens); returns how many tokens the
        step emitted."""
        sched, sampling = launched.sched, launched.sampling
        offsets, num_rows = [], 0  # a sequence with drafts has 1 + len(drafts) logits rows
        for n in launched.rows_per_seq:
            offsets.append(num_rows)
            num_rows += n
        rows, seqs, spec_seqs, spec_offsets = [], [], [], []
        for i, seq in enumerate(sampling):
            if seq.is_finished:  # a stop string found just now, or aborted
                if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER_TOKEN:
                    seq.output_token_ids.pop()
                seq.spec_token_ids, seq.spec_sibling_ids = [], []
                continue
            if seq.spec_token_ids:
                spec_seqs.append(seq)
                spec_offsets.append(offsets[i])
                continue
            rows.append(offsets[i])
            seqs.append(seq)
            req = self.requests[seq.request_id]
            for child in req.pending_forks:  # n > 1: siblings share the prompt's blocks
                self.block_manager.fork(seq, child)
                child.status = SequenceStatus.RUNNING
                self.scheduler.running.append(child)
                rows.append(offsets[i])
                seqs.append(child)
            req.pending_forks = []
        results = self._sample(seqs, rows, num_rows, launched.logits, launched.greedy,
                               launched.greedy_host)
        now = time.monotonic()
        for seq, r in zip(seqs, results):
            tokens = seq.output_token_ids
            if tokens and tokens[-1] == PLACEHOLDER_TOKEN:
                tokens[-1] = r.token  # the next step was launched with it already
            else:
                tokens.append(r.token)
            seq.cumulative_logprob += r.logprob
            if r.top_logprobs is not None:
                seq.output_logprobs.append(r.top_logprobs)
            seq.first_token_time = seq.first_token_time or now
            if self.stop_checker.check_token(seq):
                self.scheduler.finish(seq, seq.finish_reason)
        emitted = len(seqs)
        if spec_seqs:
            emitted += self.spec.complete(spec_seqs, launched.logits, spec_offsets, now,
                                          self.scheduler, self.block_manager, launched.greedy,
                                          launched.verify_host)
        self.stats.record_step(sched.num_tokens, emitted, len(sched.preempted))
        self._deferred = seqs + spec_seqs
        return emitted

    def _sample(self, seqs: list[Sequence], rows: list[int], num_rows: int,
                logits: torch.Tensor, greedy: torch.Tensor | None,
                greedy_host: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
                ) -> list[SampleResult]:
        if not seqs:
            return []
        if greedy_host is not None:
            # Copied before the next step was launched (which may have overwritten the
            # device buffers): these rows were checked greedy and unbanned at that launch.
            host, event = greedy_host
            if event is not None:
                event.synchronize()
            tokens, logprobs = host.tolist()
            return [SampleResult(int(tokens[r]), logprobs[r], None) for r in rows]
        bans = self.stop_checker.bans_any
        plain = all(s.params.greedy and s.params.logprobs is None and not bans(s)
                    for s in seqs)
        if plain:  # all greedy, nothing banned: argmax and logprob in one transfer
            if greedy is None:
                greedy = greedy_with_logprobs(logits if len(rows) == num_rows else logits[rows])
                rows = range(len(rows))
            tokens, logprobs = greedy.tolist()
            return [SampleResult(int(tokens[r]), logprobs[r], None) for r in rows]
        if len(rows) != num_rows:
            logits = logits[rows]
        banned = [self.stop_checker.banned_tokens(s) for s in seqs]
        return sample_with_logprobs(logits, [s.params for s in seqs],
                                    [s.generator for s in seqs], banned)

    def _process_outputs(self) -> None:
        """Host work of the previous step: text, stop strings, RequestOutputs (into
        self._outputs). A request whose own host work raises fails alone."""
        seqs, self._deferred = self._deferred, []
        now = time.monotonic()
        touched: dict[str, Request] = {}
        defers = self.stop_checker.defers_text
        for seq in seqs:
            if not seq.is_finished and defers(seq):
                continue  # no text yet, no output yet: nothing to do until it finishes
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # aborted meanwhile (abort_request reported it)
            was_running = not seq.is_finished
            try:
                stopped = self.stop_checker.update_text(seq)
            except Exception as e:  # noqa: BLE001 - this request's text, no one else's
                logger.error("request %s failed in the engine and was stopped; the others go "
                             "on: %s: %s", seq.request_id, type(e).__name__, e, exc_info=e)
                touched.pop(seq.request_id, None)
                self._fail_request(seq.request_id, f"{type(e).__name__}: {e}")
                continue
            if stopped and was_running:
                self.scheduler.finish(seq, seq.finish_reason)
            if seq.is_finished and self.spec is not None:
                self.spec.release(seq)
            touched[seq.request_id] = req
        for req in touched.values():
            if req.request_id not in self.requests:
                continue  # failed by a later sibling's text
            if req.finished:
                req.finished_time = now
                del self.requests[req.request_id]
                self.isolation.forget(req.request_id)
            elif req.seqs[0].params.output_kind == "final_only":
                continue
            self._outputs.append(self._output(req))

    def _output(self, req: Request) -> RequestOutput:
        first = req.seqs[0]
        completions = [CompletionOutput(
            s.index, s.text, list(s.output_token_ids), s.cumulative_logprob,
            list(s.output_logprobs) if s.params.logprobs is not None else None,
            s.finish_reason, s.stop_reason) for s in req.seqs]
        times = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        metrics = RequestMetrics(req.arrival_time, min(times) if times else None,
                                 req.finished_time, sum(s.num_preemptions for s in req.seqs))
        if self.spec is not None:
            spec = type(first.spec_stats)()
            for s in req.seqs:
                spec.merge(s.spec_stats)
            metrics.spec_decode = spec.as_dict()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.finished, first.num_cached_tokens, metrics, req.error)

    def get_stats(self) -> EngineStats:
        stats = self.stats.snapshot(self.scheduler, self.block_manager)
        if self.spec is not None:
            stats.spec_decode = self.spec.stats.as_dict()
        return stats
