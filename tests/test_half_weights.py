"""Half weights (`--weights half`): float16-rounded weight matrices (and prompt KV cache) computed in float32.

The runtime with half weights must compute what transformers computes on the same rounded weights, every
speculative mode must still reproduce its own autoregressive output, and the option must reach the target and
the drafter, the prompt cache and the transformers peers of `triforce bench`.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import F16_KV_TOLERANCE, full_cache_for, make_model, random_prompt, reference_logits, save_checkpoint
from torch import nn
from triforce_cli.kernels import half_weights_available

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.prompt_state import PromptCache
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.errors import ModelLoadError
from triforce_cli.runtime.half_weights import HalfLinear, round_to_half, use_half_weights
from triforce_cli.runtime.loading import LoadedModel, load_hf_model, load_model

pytestmark = pytest.mark.skipif(not half_weights_available(), reason="torch build without fbgemm")

GREEDY = SamplingConfig(temperature=0)


def half_tiny_model(seed: int, **config) -> LoadedModel:
    """A fresh tiny runtime model with half weights, as load_model(weights='half') returns it."""
    tiny = make_model(seed=seed, initializer_range=0.3, tie_word_embeddings=False, **config)
    use_half_weights(tiny.model)
    return dataclasses.replace(tiny.loaded, weights="half")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_every_linear_is_replaced_and_holds_rounded_values(tied):
    tiny = make_model(seed=3, tie_word_embeddings=tied)
    dense = {name: m.weight.detach().clone() for name, m in tiny.model.named_modules() if isinstance(m, nn.Linear)}
    embedding = tiny.model.model.embed_tokens.weight.detach().clone()
    assert use_half_weights(tiny.model) == len(dense) == 4 * 2 + 1  # fused qkv, o, fused gate-up, down; lm_head
    modules = dict(tiny.model.named_modules())
    assert not any(isinstance(m, nn.Linear) for m in modules.values())
    for name, weight in dense.items():
        assert isinstance(modules[name], HalfLinear)
        assert torch.equal(modules[name].weight, weight.half().float()), name
    assert torch.equal(tiny.model.model.embed_tokens.weight, embedding.half().float())
    assert not torch.equal(embedding, embedding.half().float())  # the rounding did change values


def test_logits_match_transformers_on_the_same_rounded_weights():
    tiny = make_model(seed=4)
    use_half_weights(tiny.model)
    round_to_half(tiny.ref)
    ids = random_prompt(64, 32, seed=5)
    cache = full_cache_for(tiny.model, 64)
    ours = tiny.model(torch.tensor(ids), 0, cache)
    torch.testing.assert_close(ours, reference_logits(tiny.ref, ids), **F16_KV_TOLERANCE)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_speculative_modes_equal_autoregressive_with_half_weights(seed):
    target = half_tiny_model(seed)
    drafter = half_tiny_model(seed + 50, num_layers=1)
    prompt = random_prompt(200, 32, seed=100 + seed)
    settings = {"chunk_size": 8, "budget": 32, "sink_tokens": 4, "draft_window": 16, "gamma1": 2, "gamma2": 6,
                "max_new_tokens": 60, "prefill_block": 16, "sampling": GREEDY}  # fmt: skip
    reference = Engine(target, EngineConfig(mode="autoregressive", **settings))
    expected = reference.generate(prompt).token_ids
    assert len(set(expected)) > 5
    assert reference._caches.full.keys.dtype == torch.float16  # attention read the cache as float16
    for mode in ("retrieval", "streaming", "triforce"):
        result = Engine(target, EngineConfig(mode=mode, ngram=False, **settings), drafter=drafter).generate(prompt)
        assert result.token_ids == expected, mode


def test_a_restored_state_holds_the_float16_keys_a_prefill_writes():
    target = half_tiny_model(4)
    prompt = random_prompt(70, 32, seed=8)
    engine = Engine(target, EngineConfig(mode="autoregressive", max_new_tokens=12, sampling=GREEDY))
    expected = engine.generate(prompt).token_ids
    made = engine._caches.full.keys[:, :, : len(prompt)].clone()
    state = engine.prefill(prompt)
    assert engine.generate(prompt, prompt_state=state).token_ids == expected
    assert made.dtype == torch.float16 and torch.equal(engine._caches.full.keys[:, :, : len(prompt)], made)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-half"
    save_checkpoint(folder, seed=6, tie_word_embeddings=False)
    return folder


def test_load_model_with_half_weights(checkpoint):
    loaded = load_model(str(checkpoint), weights="half")
    assert loaded.weights == "half" and loaded.dtype == torch.float32
    assert isinstance(loaded.model.lm_head, HalfLinear)
    hf = load_hf_model(str(checkpoint), torch.float32, half_weights=True)
    assert torch.equal(hf.lm_head.weight, loaded.model.lm_head.weight)
    assert torch.equal(hf.model.embed_tokens.weight, loaded.model.model.embed_tokens.weight)
    ids = random_prompt(40, 31, seed=7)
    ours = loaded.model(torch.tensor(ids), 0, full_cache_for(loaded.model, 40))
    torch.testing.assert_close(ours, reference_logits(hf, ids), **F16_KV_TOLERANCE)
    dense_hf = load_hf_model(str(checkpoint), torch.float32)
    assert not torch.equal(dense_hf.lm_head.weight, hf.lm_head.weight)


def test_half_weights_need_float32_on_the_cpu(checkpoint):
    with pytest.raises(ModelLoadError, match="half weights need the CPU, float32"):
        load_model(str(checkpoint), dtype=torch.bfloat16, weights="half")


def test_pipeline_gives_the_drafter_half_weights_too(checkpoint):
    config = EngineConfig(mode="triforce", budget=32, chunk_size=8, draft_window=16, sink_tokens=4)
    pipe = Pipeline.load(LoadOptions(target=str(checkpoint), draft=str(checkpoint), weights="half"), config=config)
    assert pipe.target.weights == pipe.drafter.weights == "half"
    assert isinstance(pipe.drafter.model.lm_head, HalfLinear)


def test_prompt_cache_files_differ_by_weight_format(checkpoint):
    loaded = load_model(str(checkpoint))
    variants = [dataclasses.replace(loaded, weights=weights) for weights in ("dense", "half")]
    assert len({PromptCache(Path("."), v).path_for([1, 2, 3]) for v in variants}) == 2


def test_the_memory_plan_counts_the_float16_cache_it_holds_and_no_copy():
    target = half_tiny_model(3)
    prompt = random_prompt(60, 32, seed=4)
    engine = Engine(target, EngineConfig(mode="autoregressive", max_new_tokens=8, sampling=GREEDY))
    engine.generate(prompt)
    full = engine._caches.full
    planned = engine.memory_plan(len(prompt))
    assert full.keys.dtype == torch.float16
    assert planned.bytes_of("full KV cache") == full.keys.nbytes + full.values.nbytes
    assert {item.what for item in planned.items} & {"float16 prompt copy"} == set()
