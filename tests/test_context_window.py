"""--context-window: YaRN RoPE scaling beyond the trained context, the same in our runtime and in transformers."""

import pytest
import torch
from helpers import F16_KV_TOLERANCE, full_cache_for, llama_config, random_prompt, save_checkpoint, with_eos

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.runtime.context_window import extend_context, trained_context
from triforce_cli.runtime.loading import load_hf_model, load_model

TRAINED = 64


def test_extend_context_switches_to_yarn():
    cfg = llama_config(max_position_embeddings=TRAINED, rope_parameters={"rope_type": "default", "rope_theta": 5e4})
    assert extend_context(cfg, 4 * TRAINED) == 4.0
    assert cfg.max_position_embeddings == 4 * TRAINED
    assert cfg.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 5e4,
        "factor": 4.0,
        "original_max_position_embeddings": TRAINED,
    }
    assert trained_context(cfg) == TRAINED


def test_window_within_the_trained_context_changes_nothing():
    cfg = llama_config(max_position_embeddings=TRAINED)
    before = cfg.to_dict()
    assert extend_context(cfg, TRAINED) is None
    assert cfg.to_dict() == before
    assert trained_context(cfg) == TRAINED


def test_already_scaled_rope_is_refused():
    cfg = llama_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match="already scales RoPE .*; `context_window` cannot extend it further"):
        extend_context(cfg, 10 * cfg.max_position_embeddings)


def test_non_positive_window_is_refused():
    with pytest.raises(ConfigError, match="positive"):
        extend_context(llama_config(), 0)


def test_extended_model_matches_transformers_past_the_trained_context(tmp_path):
    save_checkpoint(tmp_path / "ckpt", max_position_embeddings=TRAINED)
    plain = load_model(str(tmp_path / "ckpt"))
    loaded = load_model(str(tmp_path / "ckpt"), context_window=4 * TRAINED)
    assert loaded.model.config.max_position_embeddings == 4 * TRAINED
    reference = load_hf_model(loaded.source, torch.float32, config=loaded.hf_config)
    assert reference.config.rope_parameters["rope_type"] == "yarn"
    ids = random_prompt(3 * TRAINED, 31, seed=3)
    ours = loaded.model(torch.tensor(ids), 0, full_cache_for(loaded.model, 4 * TRAINED))
    theirs = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, **F16_KV_TOLERANCE)
    unscaled = plain.model(torch.tensor(ids), 0, full_cache_for(plain.model, 4 * TRAINED))
    assert not torch.allclose(ours[-1], unscaled[-1], atol=1e-3)


def test_engine_accepts_prompts_up_to_the_window(tmp_path):
    save_checkpoint(tmp_path / "ckpt", max_position_embeddings=TRAINED)
    config = EngineConfig(mode="autoregressive", max_new_tokens=4)
    prompt = random_prompt(2 * TRAINED, 31, seed=4)
    with pytest.raises(PromptError, match="`context_window`"):
        Engine(load_model(str(tmp_path / "ckpt")), config).check_prompt(prompt)
    # No end-of-sequence id: a random model may well pick it, and this test is about the window, not stopping.
    extended = with_eos(load_model(str(tmp_path / "ckpt"), context_window=4 * TRAINED))
    result = Engine(extended, config).generate(prompt)
    assert len(result.token_ids) == 4
    assert result.stats.stop_reason == "max_new_tokens"


def test_prompt_cache_is_not_shared_across_context_windows(tmp_path):
    """YaRN rescales RoPE at every position, so a prefill saved without --context-window must not serve a run
    with it: that run prefills for itself and equals an uncached run with the window."""
    save_checkpoint(tmp_path / "ckpt", max_position_embeddings=TRAINED)
    config = EngineConfig(mode="autoregressive", max_new_tokens=6, sampling=SamplingConfig(temperature=0))
    prompt = random_prompt(TRAINED // 2, 31, seed=5)
    folder = tmp_path / "prompts"
    plain = Pipeline.load(LoadOptions(target=str(tmp_path / "ckpt"), dtype="float32", device="cpu"), config=config)
    assert not plain.generate_ids(prompt, prompt_cache=folder).stats.prompt_cached
    assert plain.generate_ids(prompt, prompt_cache=folder).stats.prompt_cached
    extended = Pipeline.load(
        LoadOptions(target=str(tmp_path / "ckpt"), dtype="float32", device="cpu", context_window=4 * TRAINED),
        config=config,
    )
    windowed = extended.generate_ids(prompt, prompt_cache=folder)
    assert not windowed.stats.prompt_cached
    assert windowed.token_ids == extended.generate_ids(prompt).token_ids
    assert len(list(folder.glob("*.safetensors"))) == 2
