"""Our torch dequantization of GGUF blocks (models/gguf_blocks.py) equals gguf-py's bit
for bit, and the faster GGUF load (models/gguf_loading.py) gives the same weights with one
metadata parse for the config and the weights."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import llmaccel.models.gguf_blocks as gguf_blocks
from llmaccel.models.gguf_blocks import BLOCKS, dequantize

# where each format keeps its fp16 scales (byte offsets in a block)
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes in the format's layout, with finite fp16 scales (random bytes make NaNs
    and infinities there, which compare unequal to themselves)."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCKS[name][1]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * nbytes), dtype=np.uint8)
    view = raw.reshape(-1, nbytes)
    for off in FP16_FIELDS[name]:
        scales = rng.uniform(-3, 3, size=view.shape[0]).astype(np.float16)
        view[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_equals_gguf_py(name):
    raw = random_blocks(name, rows=6, blocks_per_row=3)
    want = quants.dequantize(raw, GGMLQuantizationType[name])
    got = dequantize(raw, name)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_1"])
def test_chunked_calls_equal_one_call(name, monkeypatch):
    """A tensor is done in chunks of blocks; the cut between chunks changes nothing."""
    raw = random_blocks(name, rows=5, blocks_per_row=7, seed=1)
    whole = dequantize(raw, name)
    monkeypatch.setattr(gguf_blocks, "_CHUNK_WEIGHTS", 3 * BLOCKS[name][0])  # 3 blocks each
    assert torch.equal(dequantize(raw, name), whole)


def test_read_only_memory_map_and_3d_rows():
    raw = random_blocks("Q8_0", rows=4, blocks_per_row=2)
    ro = raw.reshape(2, 2, -1)
    ro.setflags(write=False)
    got = dequantize(ro, "Q8_0")
    assert tuple(got.shape) == (2, 2, 64)
    assert np.array_equal(got.numpy().reshape(4, 64),
                          quants.dequantize(raw, GGMLQuantizationType.Q8_0))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no torch dequantization"):
        dequantize(np.zeros((1, 10), np.uint8), "IQ2_XXS")
    with pytest.raises(ValueError, match="whole 34-byte blocks"):
        dequantize(np.zeros((1, 35), np.uint8), "Q8_0")


def test_fast_load_gives_the_same_weights_with_one_parse(smollm2_gguf, monkeypatch):
    """SmolLM2's GGUF (Q4_1, Q8_0, F32 tensors) through the fast path: config and weights
    read the file's metadata once; tensors of each type equal gguf-py's own dequantization of
    the file (a full load without the fast path took ~30 s more in CI); gguf's names are
    restored afterwards."""
    import gguf

    import llmaccel.models.gguf_loading as gguf_loading
    from llmaccel.models.config import make_model_config
    from llmaccel.models.loader import gguf_weights

    made = []
    real_reader = gguf.GGUFReader

    class Counting(real_reader):
        def __init__(self, *args, **kwargs):
            made.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    real_dequantize = gguf.dequantize
    gguf_loading.release_readers()  # an earlier test's config read may have left one
    mc = make_model_config(str(smollm2_gguf), dtype=torch.float32)
    fast = dict(gguf_weights(mc, torch.device("cpu")))
    assert len(made) == 1  # the config's reader served the weights too
    assert gguf.GGUFReader is Counting and gguf.dequantize is real_dequantize
    assert not gguf_loading._readers  # released after the weights

    # tensors transformers passes through unpermuted, one of each type in the file
    names = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.3.ffn_gate.weight": "model.layers.3.mlp.gate_proj.weight",
             "output_norm.weight": "model.norm.weight"}
    tensors = {t.name: t for t in real_reader(str(smollm2_gguf)).tensors}
    types = set()
    for gguf_name, hf_name in names.items():
        t = tensors[gguf_name]
        types.add(t.tensor_type.name)
        want = torch.from_numpy(np.array(real_dequantize(t.data, t.tensor_type)))
        assert torch.equal(fast[hf_name], want.reshape(fast[hf_name].shape)), gguf_name
    assert {"Q4_1", "Q8_0", "F32"} <= types
