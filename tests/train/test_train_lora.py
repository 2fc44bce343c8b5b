"""LoRA fine-tuning (llmaccel/train): a few steps lower the loss and the held-out perplexity;
the merged weights are W + (alpha / r) B A; a diverging run stops early and keeps its best
adapters; the CLI trains on text and its merged model loads in our engine."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import make_tiny_model, periodic_blocks, tiny_configs

from llmaccel.errors import LLMAccelError
from llmaccel.train.lora import FinetuneConfig, finetune, heldout_nll, is_degenerate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-tiny")
    make_tiny_model(tiny_configs()["llama"], d, seed=2)
    return d


def _cfg(model, out, **kw) -> FinetuneConfig:
    base = dict(model=str(model), out=str(out), lora_r=4, lora_alpha=8.0, lr=1e-2, steps=30,
                batch_size=4, eval_every=10, heldout=0.2, device="cpu", probe_tokens=0)
    return FinetuneConfig(**{**base, **kw})


def test_lora_steps_lower_the_loss_and_heldout_perplexity(tiny, tmp_path):
    res = finetune(_cfg(tiny, tmp_path), progress=False, blocks=periodic_blocks())
    losses = [h["train_loss"] for h in res.history[1:]]
    assert losses[-1] < losses[0] and res.stopped is None and res.steps_run == 30
    assert res.best_ppl < 0.8 * res.baseline_ppl
    summary = json.loads((tmp_path / "finetune.json").read_text())
    assert summary["best_ppl"] == res.best_ppl and len(summary["history"]) == 4
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_merged_weights_are_w_plus_scaled_ba(tiny, tmp_path):
    res = finetune(_cfg(tiny, tmp_path, steps=10, target_modules=("q_proj", "v_proj")),
                   progress=False, blocks=periodic_blocks())
    base = load_file(str(tiny / "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    scale = 8.0 / 4
    checked = 0
    for layer in range(2):
        for proj in ("q_proj", "v_proj", "k_proj"):
            key = f"model.layers.{layer}.self_attn.{proj}.weight"
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a, b = adapter.get(f"{prefix}.lora_A.weight"), adapter.get(f"{prefix}.lora_B.weight")
            if proj == "k_proj":  # not adapted: unchanged
                assert a is None and torch.equal(merged[key], base[key])
                continue
            assert b.abs().max() > 0  # trained (B starts at zero)
            torch.testing.assert_close(merged[key], base[key] + scale * b @ a,
                                       rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == 4 and res.best_step > 0


def test_diverging_run_stops_early_and_keeps_the_best_adapters(tiny, tmp_path):
    """A learning rate far too high: the held-out perplexity stops improving, training stops
    before its last step, and the merged model is the best evaluation's."""
    from transformers import AutoModelForCausalLM

    blocks = periodic_blocks()
    res = finetune(_cfg(tiny, tmp_path, lr=3.0, steps=200, eval_every=2, patience=2),
                   progress=False, blocks=blocks)
    assert res.stopped and "did not improve" in res.stopped and res.steps_run < 200
    ppls = [h["heldout_ppl"] for h in res.history]
    assert res.best_ppl == min(ppls) and max(ppls) > res.best_ppl
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    held = blocks[-8:]
    assert math.isclose(math.exp(heldout_nll(merged, held, 4)), res.best_ppl, rel_tol=1e-4)


def test_degenerate_generations():
    assert is_degenerate([]) == "empty"
    assert is_degenerate([5, 6, 7] * 8) == "looping"
    assert is_degenerate(list(range(24))) is None
    assert is_degenerate([1, 2, 3]) is None  # too short to call


def test_settings_errors_name_the_problem(tiny, tmp_path):
    with pytest.raises(LLMAccelError, match="gate_projx"):
        finetune(_cfg(tiny, tmp_path, target_modules=("gate_projx",)), progress=False,
                 blocks=periodic_blocks())
    with pytest.raises(LLMAccelError, match="lr"):
        finetune(_cfg(tiny, tmp_path, lr=0.0), progress=False, blocks=periodic_blocks())
    with pytest.raises(LLMAccelError, match="no such file or directory: ./no-such.txt"):
        finetune(_cfg(tiny, tmp_path, data="./no-such.txt"), progress=False)


def test_cli_finetunes_text_and_the_merged_model_serves(smollm2_hf, tmp_path):
    """`llmaccel finetune` on a text file, with a real tokenizer (SmolLM2's, on a tiny random
    model of its vocabulary): probes are generated and recorded, and the merged model loads
    in our engine."""
    from typer.testing import CliRunner

    from llmaccel import LLM, SamplingParams
    from llmaccel.cli import app

    _, tok, _ = smollm2_hf
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = len(tok)
    model_dir = tmp_path / "model"
    make_tiny_model(cfg, model_dir, seed=3)
    tok.save_pretrained(model_dir)
    text = tmp_path / "train.txt"
    text.write_text("The cat sat on the mat. The dog sat on the log. " * 60)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["finetune", str(model_dir), "--data", str(text), "--steps",
                                 "6", "--eval-every", "3", "--seq-len", "32", "--lr", "5e-3",
                                 "--lora-r", "4", "--batch-size", "2", "--device", "cpu",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "held-out perplexity" in r.output
    summary = json.loads((out / "finetune.json").read_text())
    assert len(summary["history"][0]["probes"]) == 2
    llm = LLM(str(out / "merged"), dtype="float32", device="cpu")
    got = llm.generate(["The cat"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 4


def test_a_gguf_model_finetunes_and_saves_merged(smollm2_gguf, tmp_path, wikitext_dir):
    """The default model is a GGUF file: transformers marks a GGUF-loaded model as quantized
    and refuses to save it, so training runs on the dequantized weights and the merged model
    saves. Two steps of SmolLM2 on blocks of generated text."""
    from transformers import AutoModelForCausalLM

    res = finetune(FinetuneConfig(model=str(smollm2_gguf), out=str(tmp_path), steps=2,
                                  data=str(wikitext_dir),
                                  batch_size=1, seq_len=32, eval_every=2, max_blocks=12,
                                  heldout=0.25, device="cpu", probe_tokens=4),
                   progress=False)
    assert res.steps_run == 2 and math.isfinite(res.best_ppl)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.config.vocab_size == 49152
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(smollm2_gguf)
