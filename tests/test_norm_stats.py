"""The norm-statistics decode layers (models/norm_stats.py): the plumbing on the CPU, with the
int4 GEMV hooks emulated in PyTorch on dense weights; the kernels themselves are tested on the
GPU in test_kernels_gemv_w4_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmaccel.engine.kv_cache import allocate_kv_caches
from llmaccel.kernels.activation import silu_and_mul_ref
from llmaccel.kernels.cache import reshape_and_cache
from llmaccel.kernels.gemv_w4_cuda import STATS_SLOTS, STATS_STRIDE
from llmaccel.kernels.rotary import rotary_embedding_ref
from llmaccel.models import norm_stats
from llmaccel.models.loader import load_model
from tiny_models import make_tiny_model, tiny_configs


def _run(model, steps, block_size=4):
    """Logits of each (query_lens, seq_lens, ids) step of one sequence in scattered blocks."""
    from llmaccel.models.attention import AttentionMetadata

    model.bind_kv_caches(allocate_kv_caches(model, 12, block_size, torch.float32, "cpu"))
    table = [7, 2, 9, 4, 0, 11]
    out = []
    try:
        for query_lens, seq_lens, ids in steps:
            pos = list(range(seq_lens[0] - query_lens[0], seq_lens[0]))
            slots = [table[p // block_size] * block_size + p % block_size for p in pos]
            meta = AttentionMetadata.build(query_lens, seq_lens, "cpu", slots, [table])
            with torch.no_grad():
                hidden = model(ids, torch.tensor(pos), meta)
                out.append(model.compute_logits(hidden).float())
    finally:
        model.bind_kv_caches(None)
    return out


def _slots(t: torch.Tensor) -> torch.Tensor:
    return t.view(STATS_SLOTS, STATS_STRIDE)[:, 0]


class _Emulated:
    """The int4 method's norm-statistics hooks as the CUDA kernels compute them (the .cu's
    slot layout, blocks of ROWS rows), on the layer's dense weight."""

    ROWS = 2

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def apply(self, layer, x, bias=None):
        return self.inner.apply(layer, x, bias)

    def takes_norm_stats(self, layer, x):
        return True

    @staticmethod
    def _input(x, norm_weight, eps, norm_stats):
        if norm_weight is None:
            return x
        ss = _slots(norm_stats).sum()
        return norm_weight * (x.float() * torch.rsqrt(ss.float() / x.shape[-1] + eps)).to(x.dtype)

    def apply_norm_stats(self, layer, x, *, norm_weight=None, eps=0.0, norm_stats=None,
                         silu_out=False, residual=None, stats_out=None, stats_zero=None,
                         residual_early=False):
        self.log.append((layer.prefix, norm_stats, stats_out, stats_zero))
        y = F.linear(self._input(x, norm_weight, eps, norm_stats), layer.weight, layer.bias)
        if silu_out:
            return silu_and_mul_ref(y)
        residual.add_(y)
        if stats_out is not None:
            sq = residual.double().reshape(-1) ** 2
            block = torch.arange(sq.numel()) // self.ROWS % STATS_SLOTS
            _slots(stats_out).index_add_(0, block, sq)
        if stats_zero is not None:
            stats_zero.zero_()
        return residual

    def apply_qkv_rope(self, layer, x, bias, rope, norm_weight=None, eps=0.0, norm_stats=None):
        self.log.append((layer.prefix, norm_stats, None, None))
        nq, nkv, hd = rope.num_q_heads, rope.num_kv_heads, rope.head_dim
        qkv = F.linear(self._input(x, norm_weight, eps, norm_stats), layer.weight, bias)
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = q.reshape(1, nq, hd).clone(), k.reshape(1, nkv, hd).clone()
        rotary_embedding_ref(rope.positions, q, k, rope.cos_sin_cache)
        reshape_and_cache(k, v.reshape(1, nkv, hd), rope.kv_cache, rope.slot_mapping)
        return q.reshape(1, nq * hd)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decode_equals_the_torch_reference_and_leaves_the_slots_zero(family, tmp_path,
                                                                     monkeypatch):
    """A tiny model, one sequence: prefill, then decode steps through the norm-statistics
    layers (taken on every decode step) give the torch reference's logits; each norm's slots
    are written by the layer's o or down GEMV, read by the next GEMV and zeroed by the one
    after, so all are zero after every step."""
    monkeypatch.setattr(norm_stats, "ENABLED", True)  # LLMACCEL_NORM_STATS=1 (off by default)
    make_tiny_model(tiny_configs()[family], tmp_path)
    _, ref = load_model(str(tmp_path), dtype="float32", device="cpu", attention_backend="torch")
    _, ours = load_model(str(tmp_path), dtype="float32", device="cpu",
                         attention_backend="triton")
    ours.set_fused_kernels(True)
    log: list = []
    for layer in ours.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            lin.quant_method = _Emulated(lin.quant_method, log)
    taken = []
    real_forward = norm_stats.forward

    def spy(model, *args):
        out = real_forward(model, *args)
        taken.append(bool((model._norm_stats_slots == 0).all()))
        return out

    gen = torch.Generator().manual_seed(3)
    vocab = ref.config.vocab_size
    steps = [([6], [6], torch.randint(0, vocab, (6,), generator=gen))]
    steps += [([1], [6 + s], torch.randint(0, vocab, (1,), generator=gen)) for s in (1, 2, 3)]
    monkeypatch.setattr(norm_stats, "forward", spy)
    got = _run(ours, steps)
    monkeypatch.undo()
    want = _run(ref, steps)
    assert taken == [True] * 3  # every decode step, never the prefill; slots zero after each
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=0)
    # one step's order: layer 0 norms by kernel, then statistics; down never zeroes its own
    n = len(ours.model.layers)
    step = log[-4 * n:]
    slots = ours.model._norm_stats_slots
    assert step[0][0].endswith("0.self_attn.qkv_proj") and step[0][1] is None
    for i in range(n):
        qkv, o, gate_up, down = step[4 * i: 4 * i + 4]
        if i:
            assert qkv[1].data_ptr() == o[3].data_ptr() == slots[2 * i - 1].data_ptr()
        else:
            assert o[3] is None
        assert o[2].data_ptr() == slots[2 * i].data_ptr()
        assert gate_up[1].data_ptr() == slots[2 * i].data_ptr()
        assert down[3].data_ptr() == slots[2 * i].data_ptr()
        assert (down[2] is None) == (i == n - 1)


def test_not_taken_without_the_int4_gemv(tmp_path, monkeypatch):
    """Dense layers (no such hooks), several rows, or LLMACCEL_NORM_STATS unset: the usual
    layers."""
    from llmaccel.models.attention import AttentionMetadata

    make_tiny_model(tiny_configs()["llama"], tmp_path)
    _, model = load_model(str(tmp_path), dtype="float32", device="cpu",
                          attention_backend="triton")
    model.set_fused_kernels(True)
    x = torch.zeros(1, model.config.hidden_size)
    meta = AttentionMetadata.build([1], [4], "cpu", [3], [[0]])
    model.bind_kv_caches([torch.zeros(2, 4, 4, model.config.num_key_value_heads, 8)] * 2)
    monkeypatch.setattr(norm_stats, "_layer_takes", lambda layer, x: True)
    assert not norm_stats.step_takes(model.model, x, meta)  # off by default
    monkeypatch.undo()
    monkeypatch.setattr(norm_stats, "ENABLED", True)
    assert not norm_stats.step_takes(model.model, x, meta)  # dense layers have no such hooks
    monkeypatch.setattr(norm_stats, "_layer_takes", lambda layer, x: True)
    assert norm_stats.step_takes(model.model, x, meta) is False  # cached per dtype/device
    model.set_fused_kernels(True)  # clears the decision
    assert norm_stats.step_takes(model.model, x, meta)
    assert not norm_stats.step_takes(model.model, torch.zeros(2, x.shape[1]), meta)
