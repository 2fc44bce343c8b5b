"""Greedy outputs of the engine equal transformers' greedy generate, token for token, for
concurrent prompts of mixed lengths, with prefix caching, chunked prefill and preemption."""

import pytest

from engine_matrix import MODES, check_mode, hf_greedy, random_workload, run_engine
from tiny_models import make_tiny_model, tiny_configs

FAMILIES = ["llama", "llama3-rope", "qwen2", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(tiny_configs()[request.param], directory)
    prompts, max_tokens = random_workload(hf.config.vocab_size, seed=len(request.param))
    return str(directory), prompts, max_tokens, hf_greedy(hf, prompts, max_tokens)


@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_models_match_transformers(family, mode):
    model, prompts, max_tokens, expected = family
    llm, got = run_engine(model, mode, prompts, max_tokens, skip_tokenizer_init=True)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): {g} != {e}"
    check_mode(llm, mode)
