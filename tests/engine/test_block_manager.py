"""Property tests for the KV block manager and the radix prefix cache (CPU only, no model).

The state machine drives BlockManager the way Scheduler + LLMEngine do. Admission is
`match_prefix` then `allocate_slots`, or `free` when that fails. Several sequences are scheduled
into one batch; each one, once allocated, publishes its full blocks with
`cache_full_blocks(seq, computed + n)`. A step applies `take_pending_copies()`, writes the whole
batch's K/V, then does `num_computed_tokens += n`. Sampled tokens are appended; n > 1 sampling
forks; sequences are freed when they finish, are aborted or preempted. (Older trees published
after the step with `cache_computed_blocks(seq)`; the machine follows whichever API exists.)

Beside the real pool the machine keeps a shadow of the KV memory: slot j of a block holds the
token prefix whose K/V was written there (the K/V at position p depends on tokens[:p+1]), and
copy-on-write copies move it like the model runner's `copy_blocks`. The invariants look at memory
as it will be once the pending step has run (copies, then every write of the batch, as in one
forward). The central property: every sequence reads back, through its block table, exactly the
K/V of its own tokens, and every cached block holds the K/V its radix path spells.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmaccel.engine.block_manager import BlockManager
from llmaccel.engine.radix_cache import RadixCache
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.engine.scheduler import Scheduler
from llmaccel.engine.sequence import Sequence

PARAMS = SamplingParams()
EARLY_CACHING = hasattr(BlockManager, "cache_full_blocks")  # publish at scheduling time
MAX_PROMPT = 12
MAX_TOKENS = 20      # prompt + generated, per sequence
MAX_RUNNING = 8      # sequences holding blocks at once


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def publish(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Publish the full blocks of seq's first num_tokens tokens, with the API this tree has."""
    if EARLY_CACHING:
        bm.cache_full_blocks(seq, num_tokens)
    else:
        assert num_tokens == seq.num_computed_tokens
        bm.cache_computed_blocks(seq)


def walk_cache(cache: RadixCache, tokens) -> list[int]:
    """Blocks of the longest cached full-block prefix of `tokens`, without touching the LRU
    clock (the invariants must not change the state they check)."""
    node, blocks, bs = cache.root, [], cache.block_size
    for i in range(len(tokens) // bs):
        node = node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
        if node is None:
            break
        blocks.append(node.block_id)
    return blocks


def cached_paths(cache: RadixCache) -> dict[int, tuple[int, ...]]:
    """block id -> the token prefix spelled from the root to (and including) its node, checking
    the tree's structure on the way."""
    paths: dict[int, tuple[int, ...]] = {}
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for key, child in node.children.items():
            assert child.key == key, f"node keyed {key} under its parent says {child.key}"
            assert child.parent is node, f"block {child.block_id}: parent link broken"
            assert len(key) == cache.block_size, f"block {child.block_id}: key {key} not full"
            assert child.block_id not in paths, f"block {child.block_id} cached twice"
            assert cache.node_of_block.get(child.block_id) is child, \
                f"node_of_block[{child.block_id}] is not the tree's node"
            paths[child.block_id] = prefix + key
            stack.append((child, prefix + key))
    assert set(paths) == set(cache.node_of_block), \
        f"node_of_block has blocks not in the tree: {set(cache.node_of_block) - set(paths)}"
    return paths


class BlockManagerMachine(RuleBasedStateMachine):
    prefix_caching: bool = True  # set by the subclasses below

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None

    # -- setup -------------------------------------------------------------------------------
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 24),
                vocab=st.integers(1, 4), evict_batch=st.integers(1, 3))
    def setup(self, block_size: int, num_blocks: int, vocab: int, evict_batch: int) -> None:
        self.bs, self.vocab = block_size, vocab
        self.bm = BlockManager(num_blocks, block_size, self.prefix_caching)
        self.bm.evict_batch = evict_batch  # large pools evict several idle blocks at once
        self.running: list[Sequence] = []     # hold blocks
        self.waiting: list[Sequence] = []     # preempted, or admission failed: hold nothing
        self.batch: dict[Sequence, int] = {}  # scheduled this step, K/V not written yet
        self.shadow: dict[int, list] = {b: [None] * block_size for b in range(num_blocks)}
        self.history: list[tuple[int, ...]] = []  # token lists to draw shared prefixes from
        self.next_request = 0
        self.looked_up: set[Sequence] = set()
        self.pending_forks: dict[Sequence, int] = {}  # n - 1 siblings, forked at first sample
        self.expected_query = self.expected_hit = 0
        self.prev_cached: dict[int, tuple[int, ...]] = {}
        self.prev_holders: dict[int, set[int]] = {}
        if self.bm.cache is not None:
            self._wrap_evict()

    def _wrap_evict(self) -> None:
        cache, original = self.bm.cache, self.bm.cache.evict

        def checked_evict(num_blocks, is_free):
            held = {b for s in self.running for b in s.block_table}
            evicted = original(num_blocks, is_free)
            assert len(evicted) <= num_blocks
            for b in evicted:
                assert b not in held, f"evicted block {b}, which a live sequence references"
                assert self.bm.ref_count[b] == 0, \
                    f"evicted block {b} with ref {self.bm.ref_count[b]}"
                assert is_free(b), f"evicted block {b} that is_free rejects"
                assert not cache.is_cached(b)
            if evicted:
                event("evicted a cached block")
            return evicted

        cache.evict = checked_evict

    # -- helpers -----------------------------------------------------------------------------
    def _pick(self, data, items, label):
        return items[data.draw(st.integers(0, len(items) - 1), label=label)]

    def _token(self, data, label="token"):
        return data.draw(st.integers(0, self.vocab - 1), label=label)

    def _remember(self, tokens) -> None:
        self.history.append(tuple(tokens))
        del self.history[:-30]

    def _draw_prompt(self, data) -> list[int]:
        tok = st.integers(0, self.vocab - 1)
        if self.history and data.draw(st.booleans(), label="share a prefix"):
            base = self._pick(data, self.history, "base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            prompt = list(base[:cut]) + data.draw(st.lists(tok, max_size=4), label="suffix")
        else:
            prompt = data.draw(st.lists(tok, min_size=1, max_size=MAX_PROMPT), label="prompt")
        return prompt[:MAX_PROMPT] or [0]

    def _state(self):
        bm = self.bm
        cache = set(bm.cache.node_of_block) if bm.cache is not None else set()
        return (list(bm.ref_count), list(bm.free_blocks), bm.num_idle_cached,
                list(bm.pending_copies), cache)

    def _allocate(self, seq: Sequence, n: int) -> bool:
        """allocate_slots, checked against what it must do: succeed exactly when the blocks it
        needs (a copy-on-write copy included) are unreferenced, change nothing when it fails."""
        bm, bs = self.bm, self.bs
        c, table, before = seq.num_computed_tokens, list(seq.block_table), self._state()
        idx = c // bs
        cow = c % bs != 0 and idx < len(table) and bm.ref_count[table[idx]] > 1
        need = max(0, ceil_div(c + n, bs) - len(table)) + cow
        unreferenced = sum(1 for r in bm.ref_count if r == 0)
        ok = bm.allocate_slots(seq, n)
        assert ok == (need <= unreferenced), \
            f"allocate_slots({n}) returned {ok}; needs {need} blocks, {unreferenced} unreferenced"
        if not ok:
            event("allocation failed")
            assert seq.block_table == table, "a failed allocation changed the block table"
            assert self._state() == before, "a failed allocation changed the pool"
            return False
        assert len(seq.block_table) == ceil_div(c + n, bs)
        new_copies = bm.pending_copies[len(before[3]):]
        if cow:
            event("copy-on-write")
            old, new = table[idx], seq.block_table[idx]
            assert new != old, "copy-on-write kept writing into the shared block"
            assert new_copies == [(old, new)], f"expected copy {(old, new)}, got {new_copies}"
            assert bm.ref_count[old] == before[0][old] - 1
        else:
            assert new_copies == [], f"copies {new_copies} without a shared block to write"
        assert all(seq.block_table[i] == table[i] for i in range(len(table))
                   if not (cow and i == idx)), "allocate_slots replaced blocks it must keep"
        for b in seq.block_table[len(table):] + ([seq.block_table[idx]] if cow else []):
            assert before[0][b] == 0 and bm.ref_count[b] == 1, f"new block {b} was not free"
        return True

    def _publish(self, seq: Sequence, num_tokens: int) -> None:
        table = list(seq.block_table)
        publish(self.bm, seq, num_tokens)
        assert len(seq.block_table) == len(table)
        full = num_tokens // self.bs
        assert seq.block_table[full:] == table[full:], "publishing changed a non-full block"
        if seq.block_table != table:
            event("switched to an already cached block")

    def _scheduled(self, seq: Sequence, n: int) -> None:
        self.batch[seq] = n
        if EARLY_CACHING:
            self._publish(seq, seq.num_computed_tokens + n)

    def _admit(self, seq: Sequence, data) -> None:
        """Scheduler.schedule's admission of the queue head."""
        bm = self.bm
        before = self._state()
        expect_blocks = (walk_cache(bm.cache, seq.all_token_ids[:-1])
                         if bm.cache is not None else [])
        self.running.append(seq)
        matched = bm.match_prefix(seq)
        assert seq.block_table == expect_blocks, \
            f"match_prefix took {seq.block_table}; the longest cached prefix is {expect_blocks}"
        assert matched == seq.num_computed_tokens == len(expect_blocks) * self.bs
        assert matched < seq.num_tokens, "match_prefix left no token to compute"
        if matched:
            event("prefix cache hit")
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="chunk")
        if self._allocate(seq, n):
            self._scheduled(seq, n)
            if seq.num_preemptions == 0 and seq not in self.looked_up and bm.cache is not None:
                self.looked_up.add(seq)  # what the scheduler records, once per request
                bm.cache.record_lookup(len(seq.prompt_token_ids), matched)
                self.expected_query += len(seq.prompt_token_ids)
                self.expected_hit += matched
        else:
            bm.free(seq)  # hold nothing while waiting
            self.running.remove(seq)
            self.waiting.append(seq)
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert self._state()[:3] == before[:3], "match_prefix + free did not restore the pool"

    def _release(self, seq: Sequence) -> None:
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        self.running.remove(seq)
        self.batch.pop(seq, None)

    def _pending_writes(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """(block, slot) -> the K/V the scheduled batch writes there; no two writes disagree."""
        writes: dict[tuple[int, int], tuple[int, ...]] = {}
        for seq, n in self.batch.items():
            tokens, c = seq.all_token_ids, seq.num_computed_tokens
            for p in range(c, c + n):
                slot, kv = (seq.block_table[p // self.bs], p % self.bs), tuple(tokens[:p + 1])
                assert writes.setdefault(slot, kv) == kv, \
                    f"one step writes {writes[slot]} and {kv} into block {slot[0]} slot {slot[1]}"
        return writes

    def _view(self) -> dict[int, list]:
        """KV memory once the pending step has run: pending copies, then the batch's writes."""
        view = {b: list(content) for b, content in self.shadow.items()}
        copies = self.bm.pending_copies
        sources = [list(self.shadow[src]) for src, _ in copies]  # cache[:, dst] = cache[:, src]
        for (src, dst), content in zip(copies, sources):
            assert src != dst
            view[dst] = content
        for (b, j), kv in self._pending_writes().items():
            view[b][j] = kv
        return view

    # -- rules -------------------------------------------------------------------------------
    @precondition(lambda self: self.bm is not None and len(self.running) < MAX_RUNNING)
    @rule(data=st.data())
    def add_request(self, data) -> None:
        prompt = self._draw_prompt(data)
        self._remember(prompt)
        seq = Sequence(f"req{self.next_request}", 0, prompt, PARAMS)
        self.next_request += 1
        self.pending_forks[seq] = data.draw(st.sampled_from([0, 0, 1, 2]), label="n - 1")
        self._admit(seq, data)

    @precondition(lambda self: self.bm is not None and self.waiting
                  and len(self.running) < MAX_RUNNING)
    @rule(data=st.data())
    def readmit(self, data) -> None:
        """A preempted sequence (or one whose admission failed) is admitted again."""
        seq = self._pick(data, self.waiting, "waiting seq")
        self.waiting.remove(seq)
        self._admit(seq, data)

    def _schedulable(self) -> list[Sequence]:
        return [s for s in self.running if s not in self.batch and s.num_uncomputed_tokens > 0]

    @precondition(lambda self: self.bm is not None and self._schedulable())
    @rule(data=st.data())
    def schedule(self, data) -> None:
        """A running sequence gets its next chunk; if blocks are short it may be preempted."""
        seq = self._pick(data, self._schedulable(), "running seq")
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="chunk")
        if self._allocate(seq, n):
            self._scheduled(seq, n)
        elif data.draw(st.booleans(), label="preempt it"):
            self._release(seq)
            seq.num_preemptions += 1
            self.waiting.append(seq)

    @precondition(lambda self: self.bm is not None and self._schedulable())
    @rule(data=st.data())
    def schedule_running(self, data) -> None:
        """Scheduler.schedule's loop over running sequences, in order: each gets a chunk; when
        blocks are short the last running sequence not scheduled yet is preempted, until the
        allocation fits or the sequence itself was the one preempted."""
        for seq in self._schedulable():
            if seq not in self.running:
                continue  # preempted for an earlier one
            n = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="chunk")
            while not self._allocate(seq, n):
                victim = [s for s in self.running if s not in self.batch][-1]
                self._release(victim)
                victim.num_preemptions += 1
                self.waiting.append(victim)
                if victim is seq:
                    break
            else:
                self._scheduled(seq, n)
                continue
            break

    @precondition(lambda self: self.bm is not None and self.batch)
    @rule(data=st.data())
    def step(self, data) -> None:
        """LLMEngine.step after scheduling: copies, the forward's K/V writes, bookkeeping; a
        request with n > 1 forks its siblings off the sequence when it first samples, and the
        sequence and its new siblings each get a token."""
        expected = self._view()
        copies = self.bm.take_pending_copies()
        assert self.bm.take_pending_copies() == [], "take_pending_copies did not clear the list"
        sources = [list(self.shadow[src]) for src, _ in copies]
        for (_, dst), content in zip(copies, sources):
            self.shadow[dst] = content
        for (b, j), kv in self._pending_writes().items():
            self.shadow[b][j] = kv
        assert self.shadow == expected
        for seq, n in self.batch.items():
            seq.num_computed_tokens += n
            if not EARLY_CACHING:
                self._publish(seq, seq.num_computed_tokens)
        sampled = [s for s in self.batch if s.num_computed_tokens == s.num_tokens]
        self.batch.clear()
        for seq in sampled:
            siblings = self.pending_forks.pop(seq, 0)
            if not siblings or seq.num_tokens >= MAX_TOKENS:
                continue
            for _ in range(min(siblings, MAX_RUNNING - len(self.running))):
                self._fork(seq, data)
            seq.output_token_ids.append(self._token(data, "parent token"))
            self._remember(seq.all_token_ids)

    def _sampled(self) -> list[Sequence]:
        return [s for s in self.running if s not in self.batch
                and s.num_computed_tokens == s.num_tokens and s.num_tokens < MAX_TOKENS]

    @precondition(lambda self: self.bm is not None and self._sampled())
    @rule(data=st.data())
    def append_token(self, data) -> None:
        seq = self._pick(data, self._sampled(), "seq")
        seq.output_token_ids.append(self._token(data))
        self._remember(seq.all_token_ids)

    def _fork(self, parent: Sequence, data) -> Sequence:
        bm = self.bm
        child = Sequence(parent.request_id, parent.index + 100, parent.prompt_token_ids, PARAMS)
        child.output_token_ids = list(parent.output_token_ids)
        refs = list(bm.ref_count)
        bm.fork(parent, child)
        self.running.append(child)
        assert child.block_table == parent.block_table
        assert child.block_table is not parent.block_table
        assert child.num_computed_tokens == parent.num_computed_tokens
        for b, k in Counter(parent.block_table).items():
            assert bm.ref_count[b] == refs[b] + k
        child.output_token_ids.append(self._token(data, "child token"))
        self._remember(child.all_token_ids)
        return child

    @precondition(lambda self: self.bm is not None and self._sampled()
                  and len(self.running) < MAX_RUNNING)
    @rule(data=st.data())
    def fork(self, data) -> None:
        """Fork any fully computed sequence; the child gets its own token (a different one from
        the parent's, when the parent samples too)."""
        parent = self._pick(data, self._sampled(), "parent")
        child = self._fork(parent, data)
        if self.vocab > 1 and data.draw(st.booleans(), label="parent samples too"):
            parent.output_token_ids.append((child.output_token_ids[-1] + 1) % self.vocab)
            self._remember(parent.all_token_ids)

    def _idle_running(self) -> list[Sequence]:
        return [s for s in self.running if s not in self.batch]

    @precondition(lambda self: self.bm is not None and self._idle_running())
    @rule(data=st.data(), preempt=st.booleans())
    def free_running(self, data, preempt: bool) -> None:
        """Finish or abort (the sequence is gone) or preempt (back to waiting, recomputed later).
        Never one of the pending batch: the scheduler only preempts sequences it has not
        scheduled yet this step, and finishing and aborting happen between steps."""
        seq = self._pick(data, self._idle_running(), "seq")
        self._release(seq)
        if preempt:
            seq.num_preemptions += 1
            self.waiting.append(seq)

    @precondition(lambda self: self.bm is not None and self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        """Scheduler.finish frees a waiting sequence too; it holds nothing."""
        seq = self._pick(data, self.waiting, "seq")
        before = self._state()
        self.bm.free(seq)
        assert self._state() == before
        self.waiting.remove(seq)

    @precondition(lambda self: self.bm is not None and self.running and not self.batch)
    @rule()
    def free_all(self) -> None:
        for seq in list(self.running):
            self._release(seq)
        self._check_all_free()

    # -- invariants --------------------------------------------------------------------------
    def _check_all_free(self) -> None:
        bm = self.bm
        assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks used with no sequence"
        assert bm.usage == 0.0
        assert all(r == 0 for r in bm.ref_count)
        cached = set(bm.cache.node_of_block) if bm.cache is not None else set()
        assert set(bm.free_blocks) | cached == set(range(bm.num_blocks))
        assert bm.num_available_blocks == bm.num_blocks

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.bm is None:
            return
        bm, bs, n = self.bm, self.bs, self.bm.num_blocks
        # ref counts: one per occurrence in a live block table
        held = Counter(b for s in self.running for b in s.block_table)
        for s in self.waiting:
            assert s.block_table == [] and s.num_computed_tokens == 0
        for b in range(n):
            assert bm.ref_count[b] == held[b], \
                f"block {b}: ref_count {bm.ref_count[b]}, held by {held[b]} sequences"
        # free / in use / idle cached partition the pool
        paths = cached_paths(bm.cache) if bm.cache is not None else {}
        free = list(bm.free_blocks)
        assert len(set(free)) == len(free), f"free list has duplicates: {free}"
        for b in free:
            assert bm.ref_count[b] == 0, f"free block {b} has ref {bm.ref_count[b]}"
            assert b not in paths, f"free block {b} is also cached"
        in_use = {b for b in range(n) if bm.ref_count[b] > 0}
        idle = {b for b in paths if bm.ref_count[b] == 0}
        lost = set(range(n)) - set(free) - in_use - idle
        assert not lost, f"blocks {lost} are neither free, in use nor cached"
        assert bm.num_idle_cached == len(idle), \
            f"num_idle_cached {bm.num_idle_cached}, but {len(idle)} cached blocks have ref 0"
        assert bm.num_used_blocks == len(in_use)
        assert bm.num_available_blocks + bm.num_used_blocks == n
        # idle cached blocks are evictable: a referenced node's ancestors are referenced
        for b in paths:
            parent = bm.cache.node_of_block[b].parent
            if bm.ref_count[b] > 0 and parent is not bm.cache.root:
                assert bm.ref_count[parent.block_id] > 0, \
                    f"cached block {b} is in use but its parent {parent.block_id} is idle"
        # a cached block holds the K/V of exactly the prefix its path spells
        view = self._view()
        for b, path in paths.items():
            depth = len(path) // bs - 1
            expected = [path[:depth * bs + j + 1] for j in range(bs)]
            assert view[b] == expected, \
                f"cached block {b} (key {path[-bs:]}) holds {view[b]}, not {expected}"
        # nothing referenced was evicted (checked at each eviction by checked_evict, and here:
        # a block that some sequence held at the last check and still holds is still cached
        # under the same path; a block that went idle in between may have been evicted, even
        # reused and cached anew)
        holders: dict[int, set[int]] = {}
        for s in self.running:
            for b in s.block_table:
                holders.setdefault(b, set()).add(id(s))
        for b, path in self.prev_cached.items():
            if paths.get(b) != path:
                kept = self.prev_holders.get(b, set()) & holders.get(b, set())
                assert not kept, \
                    f"block {b} left the cache (path {path} -> {paths.get(b)}) while held"
        self.prev_cached, self.prev_holders = paths, holders
        # every sequence reads back its own tokens' K/V: the computed ones and the ones the
        # pending step computes
        for s in self.running:
            tokens, done = s.all_token_ids, s.num_computed_tokens + self.batch.get(s, 0)
            assert done <= s.num_tokens
            assert len(s.block_table) == ceil_div(done, bs), \
                f"seq {s.request_id}/{s.index}: {len(s.block_table)} blocks for {done} tokens"
            for p in range(done):
                got = view[s.block_table[p // bs]][p % bs]
                assert got == tuple(tokens[:p + 1]), \
                    f"seq {s.request_id}/{s.index} position {p} reads K/V of {got}, " \
                    f"its tokens are {tokens[:p + 1]}"
            if bm.cache is not None:  # its full published blocks are the cached ones
                full = (done if EARLY_CACHING else s.num_computed_tokens) // bs
                path = walk_cache(bm.cache, tokens[:full * bs])
                assert path == s.block_table[:full], \
                    f"seq {s.request_id}/{s.index}: full blocks {s.block_table[:full]} are not " \
                    f"the cached path {path}"
        if bm.cache is not None:
            assert bm.cache.query_tokens == self.expected_query
            assert bm.cache.hit_tokens == self.expected_hit
            expected_rate = self.expected_hit / self.expected_query if self.expected_query else 0.0
            assert bm.cache.hit_rate == expected_rate

    def teardown(self) -> None:
        """Free everything; then every unreferenced block must really be obtainable: one
        sequence allocates the whole pool, evicting every idle cached block."""
        if self.bm is None:
            return
        bm = self.bm
        for seq in list(self.running):
            self._release(seq)
        self._check_all_free()
        bm.take_pending_copies()
        hog = Sequence("hog", 0, [self.vocab + 1] * (bm.num_blocks * self.bs), PARAMS)
        assert bm.match_prefix(hog) == 0
        assert bm.allocate_slots(hog, hog.num_tokens), "could not take the whole idle pool"
        assert sorted(hog.block_table) == list(range(bm.num_blocks))
        assert bm.num_available_blocks == 0 and bm.num_idle_cached == 0
        assert bm.cache is None or len(bm.cache) == 0
        assert bm.take_pending_copies() == []
        bm.free(hog)
        assert sorted(bm.free_blocks) == list(range(bm.num_blocks))


class PrefixCachingMachine(BlockManagerMachine):
    prefix_caching = True


class NoPrefixCachingMachine(BlockManagerMachine):
    prefix_caching = False


# ~25 s for both machines on one CPU core; hypothesis's swarm testing switches rules off at random
# per example, so a good share of examples ends early as "invalid": that is expected.
MACHINE_SETTINGS = settings(max_examples=500, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow,
                                                   HealthCheck.filter_too_much])
TestBlockManagerWithPrefixCaching = PrefixCachingMachine.TestCase
TestBlockManagerWithPrefixCaching.settings = MACHINE_SETTINGS
TestBlockManagerWithoutPrefixCaching = NoPrefixCachingMachine.TestCase
TestBlockManagerWithoutPrefixCaching.settings = settings(MACHINE_SETTINGS, max_examples=250)


# -- plain tests: the radix cache ----------------------------------------------------------------

def test_match_prefix_longest_full_block_prefix():
    cache = RadixCache(2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == [10, 11, 12]
    assert cache.insert([1, 2, 3, 9], [20, 21]) == [21]  # shares the first block
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == [10, 11, 12]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]) == [10, 11, 12]
    assert cache.match_prefix([1, 2, 3, 4, 5]) == [10, 11]      # a partial block never matches
    assert cache.match_prefix([1, 2, 3, 9, 5, 6]) == [10, 21]
    assert cache.match_prefix([1, 2, 4, 4]) == [10]
    assert cache.match_prefix([1]) == []
    assert cache.match_prefix([2, 1, 3, 4]) == []
    assert cache.match_prefix([]) == []
    assert cache.insert([7, 8, 9], [30, 31]) == [30]   # the partial tail [9] is not cached
    assert not cache.is_cached(31) and len(cache) == 5
    assert cache.match_prefix([7, 8, 9]) == [30]


@settings(max_examples=150, deadline=None)
@given(bs=st.sampled_from([1, 2, 3]),
       inserts=st.lists(st.lists(st.integers(0, 2), max_size=9), max_size=8),
       queries=st.lists(st.lists(st.integers(0, 2), max_size=10), min_size=1, max_size=8))
def test_match_prefix_against_reference(bs, inserts, queries):
    """match_prefix agrees with a dict of every inserted full-block prefix (first insert wins)."""
    cache, ref, next_id = RadixCache(bs), {}, 0
    for tokens in inserts:
        ids = list(range(next_id, next_id + len(tokens) // bs))
        next_id += len(ids)
        added = cache.insert(tokens, ids)
        expect_added = []
        for i, b in enumerate(ids):
            prefix = tuple(tokens[:(i + 1) * bs])
            if prefix not in ref:
                ref[prefix] = b
                expect_added.append(b)
        assert added == expect_added
    assert len(cache) == len(ref)
    for q in queries + inserts:
        expected = []
        for i in range(len(q) // bs):
            b = ref.get(tuple(q[:(i + 1) * bs]))
            if b is None:
                break
            expected.append(b)
        assert cache.match_prefix(q) == expected


def test_lru_eviction_order():
    cache = RadixCache(1)
    free = lambda b: True
    cache.insert([1, 2], [0, 1])
    cache.insert([3], [2])
    cache.insert([1, 4], [0, 3])
    cache.match_prefix([3])        # 2 used after 3
    cache.match_prefix([1, 2])     # 1 (and its parent 0) used last
    assert cache.evict(1, free) == [3]
    assert cache.evict(1, free) == [2]
    assert cache.evict(1, free) == [1]   # 0 becomes a leaf only now
    assert cache.evict(5, free) == [0]
    assert len(cache) == 0 and cache.match_prefix([1, 2]) == []
    # publishing an already cached path again counts as a use too
    cache.insert([1], [0])
    cache.insert([2], [1])
    cache.insert([1], [5])
    assert cache.evict(1, free) == [1]


def test_eviction_goes_leaf_first_even_when_the_parent_is_older():
    cache = RadixCache(1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 5], [0, 3])
    cache.node_of_block[0].last_access = -2   # make the shared root block the oldest
    cache.node_of_block[1].last_access = -1
    # 0 and 1 are older than every leaf but have children: the oldest leaf goes first
    assert cache.evict(1, lambda b: True) == [2]
    # then 1 is a leaf (and older than 3); 0 goes only once 3 has gone too
    assert cache.evict(4, lambda b: True) == [1, 3, 0]
    assert len(cache) == 0


def test_evict_respects_is_free():
    cache = RadixCache(1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])
    cache.insert([5], [4])
    held = {1, 4}
    out = cache.evict(10, lambda b: b not in held)
    assert sorted(out) == [2, 3]       # 1 and 4 are held; 0 keeps its held child 1
    assert set(cache.node_of_block) == {0, 1, 4}
    assert cache.evict(10, lambda b: False) == []


@settings(max_examples=150, deadline=None)
@given(inserts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), max_size=8),
       held_mask=st.lists(st.booleans(), min_size=40, max_size=40),
       k=st.integers(0, 40))
def test_evict_returns_only_free_whole_subtrees(inserts, held_mask, k):
    cache, next_id = RadixCache(1), 0
    for tokens in inserts:
        cache.insert(tokens, list(range(next_id, next_id + len(tokens))))
        next_id += len(tokens)
    held = {b for b in cache.node_of_block if held_mask[b % 40]}

    def subtree_free(node):
        return node.block_id not in held and all(subtree_free(c) for c in node.children.values())

    evictable = {b for b, node in cache.node_of_block.items() if subtree_free(node)}
    out = cache.evict(k, lambda b: b not in held)
    assert len(out) == min(k, len(evictable)) and len(set(out)) == len(out)
    assert set(out) <= evictable and not set(out) & held
    for b in out:
        assert not cache.is_cached(b)
    remaining = set(cache.node_of_block)
    for b in remaining:  # no parent went before its children
        assert cache.node_of_block[b].parent is cache.root or \
            cache.node_of_block[b].parent.block_id in remaining


def test_hit_rate_accounting():
    cache = RadixCache(4)
    assert cache.hit_rate == 0.0
    cache.record_lookup(10, 4)
    cache.record_lookup(6, 0)
    assert (cache.query_tokens, cache.hit_tokens) == (16, 4)
    assert cache.hit_rate == 0.25
    cache.match_prefix([1, 2, 3, 4])  # looking up does not count by itself
    assert cache.query_tokens == 16


def test_scheduler_records_prefix_hits():
    """Through the real Scheduler: a later identical prompt is served from the cache."""
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence("a", 0, [1, 2, 3, 4, 5], PARAMS)
    sched.add(a)
    assert sched.schedule().scheduled == [(a, 5)]
    a.num_computed_tokens += 5      # LLMEngine.step after the forward
    if not EARLY_CACHING:
        bm.cache_computed_blocks(a)
    a.output_token_ids.append(6)
    b = Sequence("b", 0, [1, 2, 3, 4, 5], PARAMS)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled == [(a, 1), (b, 1)]   # 4 of b's 5 prompt tokens come from the cache
    assert b.num_cached_tokens == 4 and b.block_table[:2] == a.block_table[:2]
    assert bm.ref_count[a.block_table[0]] == 2
    assert bm.cache.hit_rate == 4 / 10        # a found nothing, b 4 of 5


@pytest.mark.skipif(not EARLY_CACHING, reason="blocks are published after the step")
def test_scheduler_shares_blocks_scheduled_in_the_same_step():
    """cache_full_blocks at scheduling time: a request admitted later in the same step reuses
    the blocks an earlier one computes in that step."""
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence("a", 0, [1, 2, 3, 4, 5], PARAMS)
    b = Sequence("b", 0, [1, 2, 3, 4, 9], PARAMS)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().scheduled == [(a, 5), (b, 1)]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_used_blocks == 4 and bm.cache.hit_rate == 4 / 10


# -- plain tests: the block manager ------------------------------------------------------------

def test_fork_copy_on_write():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    parent = Sequence("r", 0, [1, 2, 3, 4, 5, 6], PARAMS)
    assert bm.match_prefix(parent) == 0
    assert bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    publish(bm, parent, 6)
    full, partial = parent.block_table
    assert bm.cache.is_cached(full) and not bm.cache.is_cached(partial)
    child = Sequence("r", 1, parent.prompt_token_ids, PARAMS)
    bm.fork(parent, child)
    assert bm.ref_count[full] == bm.ref_count[partial] == 2
    child.output_token_ids.append(7)
    parent.output_token_ids.append(8)
    assert bm.blocks_needed(child, 1) == 1   # the copy
    assert bm.allocate_slots(child, 1)
    copy = child.block_table[1]
    assert child.block_table == [full, copy] and copy not in (full, partial)
    assert bm.take_pending_copies() == [(partial, copy)]
    assert bm.ref_count[partial] == 1 and bm.ref_count[copy] == 1 and bm.ref_count[full] == 2
    assert bm.allocate_slots(parent, 1)      # sole owner now: writes in place
    assert parent.block_table == [full, partial] and bm.take_pending_copies() == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0 and bm.num_idle_cached == 1   # `full` stays cached


def test_same_block_computed_twice_is_deduplicated():
    """b computes block 0 while a already holds the same tokens half-computed in its own block:
    when a completes it, a switches to b's cached block and frees its own."""
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    a = Sequence("a", 0, [1, 2, 3], PARAMS)
    b = Sequence("b", 0, [1, 2, 3], PARAMS)
    assert bm.match_prefix(a) == 0 and bm.allocate_slots(a, 1)   # chunk: token 1 only
    a.num_computed_tokens = 1
    a_own = a.block_table[0]
    assert bm.match_prefix(b) == 0 and bm.allocate_slots(b, 3)
    b.num_computed_tokens = 3
    publish(bm, b, 3)
    b_block = b.block_table[0]
    assert bm.cache.is_cached(b_block) and b_block != a_own
    assert bm.allocate_slots(a, 2)
    a.num_computed_tokens = 3
    publish(bm, a, 3)
    assert a.block_table[0] == b_block
    assert bm.ref_count[b_block] == 2 and bm.ref_count[a_own] == 0
    assert a_own in bm.free_blocks and len(bm.cache) == 1


def test_a_full_cache_evicts_in_batches():
    """Taking blocks from a pool full of idle cached blocks scans the cache once per batch of
    num_blocks / 256 blocks, not once per block; the rest of the batch stays free."""
    bm = BlockManager(1024, 1, enable_prefix_caching=True)
    assert bm.evict_batch == 4
    for i in range(1024):  # 1024 one-token sequences, each leaving a cached idle block
        seq = Sequence(f"s{i}", 0, [i], PARAMS)
        assert bm.allocate_slots(seq, 1)
        bm.cache_full_blocks(seq, 1)
        bm.free(seq)
    assert bm.num_idle_cached == 1024 and not bm.free_blocks
    calls, evict = [], bm.cache.evict
    bm.cache.evict = lambda n, is_free: calls.append(n) or evict(n, is_free)
    seq = Sequence("new", 0, [5000] * 10, PARAMS)
    assert bm.allocate_slots(seq, 10)
    assert calls == [4, 4, 4] and len(bm.free_blocks) == 2
    assert bm.num_available_blocks == 1024 - 10 and bm.num_idle_cached == 1024 - 12
    bm.free(seq)
    assert bm.num_available_blocks == 1024


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, 2)
    a = Sequence("a", 0, [0] * 6, PARAMS)
    assert bm.allocate_slots(a, 6) and len(a.block_table) == 3
    b = Sequence("b", 0, [0] * 3, PARAMS)
    assert not bm.allocate_slots(b, 3)
    assert b.block_table == [] and bm.num_available_blocks == 1
    assert bm.allocate_slots(b, 2) and bm.num_available_blocks == 0
