"""Our Transformer against transformers' reference models, checkpoint loading, and the `kernels` name hazard."""

import json

import pytest
import torch
from helpers import (
    F16_KV_TOLERANCE,
    F16_SPLIT_TOLERANCE,
    full_cache_for,
    llama_config,
    random_prompt,
    reference_logits,
    save_checkpoint,
    save_tokenizer,
    wrap,
)
from transformers import (
    GPT2Config,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from triforce_cli.cache import FullCache
from triforce_cli.kernels.step import rms_norm

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.runtime.loading import load_model
from triforce_cli.runtime.model import (
    ConcatLinear,
    Linear,
    ModelConfig,
    Transformer,
    UnsupportedModelError,
    replace_checkpoint_linears,
)
from triforce_cli.runtime.native import kernel_error
from triforce_cli.runtime.tiled_weights import TiledLinear, tiled_weights_apply, use_tiled_weights

SEQ = 96
ATOL = 1e-5
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0},
}


def our_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor(ids), 0, full_cache_for(model))


# checkpoint linears computed by the reference's own modules in the "separate" variant: whole fused projections
# (q, k, v), a part of one (gate, beside the fused weight's up rows) and an unfused one (o)
SEPARATE = ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj")


def random_llama(seed: int = 0, fused: bool = True, **config):
    """transformers' reference and our model with its weights; not fused: the checkpoint linears named in SEPARATE
    computed part by part, as GGUF blocks of different kinds are."""
    cfg = llama_config(initializer_range=0.2, **config)
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg).eval()
    model = wrap(ref, cfg).model
    if not fused:
        parts = {name: module for name, module in ref.named_modules() if name.endswith(SEPARATE)}
        assert replace_checkpoint_linears(model, parts) == len(parts) == len(SEPARATE) * cfg.num_hidden_layers
    return ref, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_target_keeps_a_float16_cache_on_the_cpu_in_float32_only(dtype):
    """The engine's prefill logits are transformers' within F16_KV_TOLERANCE (float32; bfloat16 is the GPU proxy,
    only checked for its cache's dtype): on the CPU the target is the model with a float16 KV cache, whose rounding
    shows in the logits (a float32 cache gives other ones), and a bfloat16 model keeps its own dtype."""
    ref, _ = random_llama(num_kv_heads=2)
    loaded = wrap(ref, ref.config)
    loaded.model.to(dtype)
    ids = random_prompt(SEQ, 32, seed=1)
    engine = Engine(loaded, EngineConfig(mode="autoregressive", max_new_tokens=1))
    state = engine.prefill(ids)
    full = engine._caches.full
    assert (
        full.keys.dtype == full.values.dtype == state.keys.dtype == (torch.float16 if dtype == torch.float32 else dtype)
    )
    if dtype != torch.float32:
        return
    expected = reference_logits(ref, ids)[-1:]
    torch.testing.assert_close(state.last_logits, expected, **F16_KV_TOLERANCE)
    cfg = loaded.model.config
    float32_cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, SEQ, torch.float32)
    unrounded = loaded.model(torch.tensor(ids), 0, float32_cache)[-1:]
    torch.testing.assert_close(unrounded, expected, atol=ATOL, rtol=1e-5)
    assert not torch.allclose(state.last_logits, unrounded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_logits_match_transformers(rope, num_kv_heads, tied, fused):
    extra = {} if ROPES[rope] is None else {"rope_parameters": dict(ROPES[rope])}
    ref, model = random_llama(fused=fused, num_kv_heads=num_kv_heads, tie_word_embeddings=tied, **extra)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, ConcatLinear) != fused
    assert isinstance(layer.mlp.gate_up_proj, ConcatLinear) != fused
    if not fused:
        assert [type(part) for part in layer.mlp.gate_up_proj.parts] == [torch.nn.Linear, Linear]  # gate, up rows
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    ids = random_prompt(SEQ, 32, seed=1)
    expected = reference_logits(ref, ids)
    assert expected.std() > 0.1  # a meaningful comparison, not near-zero logits
    torch.testing.assert_close(our_logits(model, ids), expected, **F16_KV_TOLERANCE)


def test_rope_variants_differ():
    """Guard: the scaled RoPE variants really change the model past the original context."""
    ids = random_prompt(SEQ, 32, seed=1)
    logits = {}
    for rope, params in ROPES.items():
        extra = {} if params is None else {"rope_parameters": dict(params)}
        logits[rope] = our_logits(random_llama(**extra)[1], ids)
    for rope in ("linear", "llama3", "yarn"):
        assert not torch.allclose(logits[rope][-1], logits["default"][-1], atol=1e-3)


@pytest.mark.skipif(kernel_error() is not None, reason="no CPU extension here")
def test_the_final_norm_on_the_cpu_in_float32_is_the_step_ops_norm():
    """As every layer's norms: one order of arithmetic, a row alone the same bits as in a batch; with autograd on
    (distillation) the module's own."""
    _, model = random_llama(hidden_size=576, num_heads=9, num_kv_heads=3)  # the embedded model's width
    norm = model.model.norm
    x = torch.randn(5, 576) * 3
    with torch.inference_mode():
        normed = model.final_norm(x)
        assert torch.equal(normed, rms_norm(x, norm.weight, norm.eps))
        assert torch.equal(model.final_norm(x[2:3]), normed[2:3])
    trained = model.final_norm(x.requires_grad_())
    assert trained.requires_grad and torch.equal(trained, norm(x))


def test_head_dim_different_from_hidden_over_heads():
    ref, model = random_llama(head_dim=16)
    assert model.config.head_dim == 16
    ids = random_prompt(40, 32, seed=2)
    torch.testing.assert_close(our_logits(model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


def test_chunked_prefill_and_decode_match_one_forward():
    ref, model = random_llama(rope_parameters=dict(ROPES["llama3"]))
    ids = random_prompt(SEQ, 32, seed=3)
    whole = our_logits(model, ids)
    cache = full_cache_for(model)
    first = model(torch.tensor(ids[:50]), 0, cache)
    second = model(torch.tensor(ids[50:90]), 50, cache)
    steps = [model(torch.tensor([t]), 90 + i, cache) for i, t in enumerate(ids[90:])]
    torch.testing.assert_close(torch.cat([first, second, *steps]), whole, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(whole, reference_logits(ref, ids), **F16_KV_TOLERANCE)
    # num_logits keeps only the last rows
    cache.rollback(80)
    tail = model(torch.tensor(ids[80:]), 80, cache, num_logits=3)
    torch.testing.assert_close(tail, whole[-3:], atol=ATOL, rtol=1e-5)


def test_rewriting_after_rollback_matches():
    """Rolled-back speculative tokens leave no trace: verify wrong drafts, roll back, feed the right ones."""
    _, model = random_llama()
    ids = random_prompt(60, 32, seed=4)
    whole = our_logits(model, ids)
    cache = full_cache_for(model)
    model(torch.tensor(ids[:50]), 0, cache)
    model(torch.tensor([(t + 1) % 32 for t in ids[50:55]]), 50, cache)  # rejected drafts
    cache.rollback(50)
    torch.testing.assert_close(model(torch.tensor(ids[50:]), 50, cache), whole[50:], atol=ATOL, rtol=1e-5)


def test_qwen2_biases_match_transformers():
    cfg = llama_config(config_class=Qwen2Config, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)  # initialised to zero: make them matter
    model = wrap(ref, cfg).model
    assert model.config.attention_bias
    ids = random_prompt(SEQ, 32, seed=5)
    torch.testing.assert_close(our_logits(model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)
    # the biases are really used: dropping the query biases changes the output
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.bias[: cfg.num_attention_heads * model.config.head_dim].zero_()
    assert not torch.allclose(our_logits(model, ids), reference_logits(ref, ids), atol=1e-3)


def qwen3(seed: int = 0) -> tuple[Qwen3Config, Qwen3ForCausalLM]:
    """A tiny Qwen3 (per-head q and k norms), its norm weights random so that they matter."""
    cfg = llama_config(config_class=Qwen3Config, head_dim=8, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(seed)
    ref = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return cfg, ref


def test_qwen3_query_and_key_norms_match_transformers():
    """Prefill, a second chunk and decode steps with the cache equal transformers' Qwen3; the norms are used."""
    cfg, ref = qwen3()
    model = wrap(ref, cfg).model
    assert model.config.qk_norm and not model.config.attention_bias
    ids = random_prompt(SEQ, 32, seed=6)
    whole = our_logits(model, ids)
    torch.testing.assert_close(whole, reference_logits(ref, ids), **F16_KV_TOLERANCE)
    cache = full_cache_for(model)
    first = model(torch.tensor(ids[:50]), 0, cache)
    steps = [model(torch.tensor([t]), 50 + i, cache) for i, t in enumerate(ids[50:])]
    torch.testing.assert_close(torch.cat([first, *steps]), whole, **F16_SPLIT_TOLERANCE)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_norm.weight.fill_(1.0)
    assert not torch.allclose(our_logits(model, ids), whole, atol=1e-3)


def test_qwen3_checkpoint_loads_and_every_mode_is_greedy_equal(tmp_path):
    """A saved Qwen3 checkpoint goes through load_model, and every mode gives autoregressive's greedy tokens."""
    cfg, ref = qwen3(seed=1)
    ref.save_pretrained(tmp_path / "qwen3")
    save_tokenizer(tmp_path / "qwen3", cfg.vocab_size)
    loaded = load_model(str(tmp_path / "qwen3"))
    ids = random_prompt(64, 32, seed=7)
    torch.testing.assert_close(our_logits(loaded.model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)
    greedy = SamplingConfig(temperature=0)
    settings = {"budget": 16, "chunk_size": 8, "draft_window": 16, "sink_tokens": 4, "max_new_tokens": 24}
    expected = Engine(loaded, EngineConfig(mode="autoregressive", sampling=greedy, **settings)).generate(ids)
    for mode in ("retrieval", "streaming", "triforce"):
        result = Engine(loaded, EngineConfig(mode=mode, sampling=greedy, ngram=False, **settings)).generate(ids)
        assert result.token_ids == expected.token_ids, mode


def mistral(sliding_window):
    cfg = llama_config(
        config_class=MistralConfig, tie_word_embeddings=False, sliding_window=sliding_window, initializer_range=0.2
    )
    torch.manual_seed(0)
    return cfg, MistralForCausalLM(cfg).eval()


def test_mistral_without_sliding_window_matches_transformers():
    cfg, ref = mistral(sliding_window=None)
    ids = random_prompt(48, 32, seed=1)
    torch.testing.assert_close(our_logits(wrap(ref, cfg).model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


def test_mistral_nemo_head_dim_wider_than_hidden_over_heads_matches_transformers():
    """Mistral-Nemo's heads are not hidden_size / num_heads wide: head_dim comes from the config."""
    cfg = llama_config(
        config_class=MistralConfig, head_dim=16, tie_word_embeddings=False, sliding_window=None, initializer_range=0.2
    )
    torch.manual_seed(2)
    ref = MistralForCausalLM(cfg).eval()
    model = wrap(ref, cfg).model
    assert model.config.head_dim == 16 != cfg.hidden_size // cfg.num_attention_heads
    ids = random_prompt(SEQ, 32, seed=8)
    whole = our_logits(model, ids)
    torch.testing.assert_close(whole, reference_logits(ref, ids), **F16_KV_TOLERANCE)
    cache = full_cache_for(model)
    steps = [model(torch.tensor(ids[:40]), 0, cache)] + [
        model(torch.tensor([t]), 40 + i, cache) for i, t in enumerate(ids[40:])
    ]
    torch.testing.assert_close(torch.cat(steps), whole, **F16_SPLIT_TOLERANCE)


def test_mistral_sliding_window_is_honoured():
    """More in tests/test_sliding_window.py."""
    cfg, ref = mistral(sliding_window=16)
    model = wrap(ref, cfg).model
    ids = random_prompt(48, 32, seed=1)
    torch.testing.assert_close(our_logits(model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


def test_unsupported_configs_are_rejected():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf(GPT2Config())
    cfg = llama_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelConfig.from_hf(cfg)


def test_a_projection_missing_from_the_checkpoint_is_named_as_the_checkpoint_names_it():
    cfg = llama_config(tie_word_embeddings=False)
    state = LlamaForCausalLM(cfg).state_dict()
    del state["model.layers.1.self_attn.k_proj.weight"]
    missing, unexpected = Transformer.from_hf_config(cfg).load_hf_state(state)
    assert missing == ["model.layers.1.self_attn.k_proj.weight"]
    assert set(unexpected) == {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"}


# --- loading from a saved folder --------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_model_from_saved_folder(tmp_path, tied):
    folder = tmp_path / "tiny-llama"
    ref = save_checkpoint(folder, tie_word_embeddings=tied)
    loaded = load_model(str(folder))
    assert loaded.name == "tiny-llama"
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.eos_token_ids == {31}
    assert loaded.tokenizer.get_vocab()["w3"] == 3
    assert loaded.tokenizer.encode("w1 w2 w3", add_special_tokens=False) == [1, 2, 3]
    model = loaded.model
    assert not model.training
    # float32 on the CPU: the linears are laid out in tiles, a tied embedding read from the output layer's
    tiled = kernel_error() is None
    if tiled:
        assert (getattr(model.model.embed_tokens, "tiles", None) is model.lm_head.tiles) == tied
    else:
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert all(p.device.type == "cpu" for p in model.parameters())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    projection = TiledLinear if tiled else Linear
    assert isinstance(attn.qkv_proj, projection) and isinstance(mlp.gate_up_proj, projection)  # fused projections
    assert attn.qkv_proj.out_features == (4 + 2 * 2) * 8 and mlp.gate_up_proj.out_features == 2 * 48
    ids = random_prompt(SEQ, 31, seed=6)
    torch.testing.assert_close(our_logits(model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn"])
def test_load_model_with_scaled_rope(tmp_path, rope):
    folder = tmp_path / "scaled"
    ref = save_checkpoint(folder, rope_parameters=dict(ROPES[rope]))
    loaded = load_model(str(folder))
    ids = random_prompt(SEQ, 31, seed=6)
    torch.testing.assert_close(our_logits(loaded.model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_model_gives_the_logits_of_the_checkpoint_copied_into_the_model(tmp_path, dtype):
    """Transformed in host memory before crossing to the device, the weights compute exactly the logits of the
    checkpoint's tensors copied into a model built whole (helpers.wrap) in the same weight form: tiled for float32
    on the CPU (whose layers run the CPU step ops), dense with layers 1 on streamed from host memory
    (--offload kv+weights)."""
    folder = tmp_path / "ckpt"
    ref = save_checkpoint(folder, seed=3, num_layers=3, tie_word_embeddings=False)
    copied = wrap(ref, ref.config).model
    for param in copied.parameters():
        param.data = param.data.to(dtype)
    ids = random_prompt(SEQ, 31, seed=4)
    dense = our_logits(copied, ids)
    if tiled_weights_apply(torch.device("cpu"), dtype):
        use_tiled_weights(copied)
    assert torch.equal(our_logits(load_model(str(folder), dtype=dtype).model, ids), our_logits(copied, ids))
    streamed = load_model(str(folder), dtype=dtype, offload_weights=True, resident_layers=1).model
    assert sorted(streamed.weight_stream.host) == [1, 2]
    assert torch.equal(our_logits(streamed, ids), dense)


def test_load_model_from_single_safetensors_file(tmp_path):
    folder = tmp_path / "ckpt"
    ref = save_checkpoint(folder, seed=2)
    loaded = load_model(str(folder / "model.safetensors"))
    assert loaded.name == "model"
    ids = random_prompt(40, 31, seed=7)
    torch.testing.assert_close(our_logits(loaded.model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


def test_load_model_in_bfloat16(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(folder)
    loaded = load_model(str(folder), dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    logits = our_logits(loaded.model, random_prompt(20, 31, seed=8))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_load_model_errors(tmp_path):
    from triforce_cli.errors import ModelLoadError

    folder = tmp_path / "empty"
    folder.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(folder))
    (folder / "config.json").write_text(json.dumps(llama_config().to_dict()))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(folder))
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "missing" / "model.gguf"))


def _biased_checkpoint_logits(tmp_path, **bias):
    folder = tmp_path / "biased"
    ref = save_checkpoint(folder, **bias)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    ref.save_pretrained(folder)
    loaded = load_model(str(folder))
    ids = random_prompt(40, 31, seed=9)
    return our_logits(loaded.model, ids), reference_logits(ref, ids)


def test_llama_attention_bias_checkpoint(tmp_path):
    ours, expected = _biased_checkpoint_logits(tmp_path, attention_bias=True)
    torch.testing.assert_close(ours, expected, **F16_KV_TOLERANCE)


def test_llama_mlp_bias_checkpoint(tmp_path):
    ours, expected = _biased_checkpoint_logits(tmp_path, mlp_bias=True)
    torch.testing.assert_close(ours, expected, **F16_KV_TOLERANCE)


# --- installed names ---------------------------------------------------------------------------------------------


def test_the_distribution_installs_one_top_level_name():
    """kernels/, cache/ and offload/ install inside triforce_cli, so no other distribution's top-level name (Hugging
    Face's `kernels`, which transformers probes for) can be shadowed by ours or shadow it."""
    import importlib
    from importlib.metadata import packages_distributions
    from pathlib import Path

    ours = sorted(name for name, distributions in packages_distributions().items() if "triforce-cli" in distributions)
    assert ours == ["triforce_cli"]
    root = Path(__file__).resolve().parents[1]
    for folder in ("kernels", "cache", "offload"):
        module = importlib.import_module(f"triforce_cli.{folder}")
        assert Path(module.__file__).resolve() == root / folder / "__init__.py"
