"""Shared helpers: tiny random-weight Llama models wrapped into the runtime, and a stub tokenizer.

``make_model`` builds a transformers ``LlamaForCausalLM`` (the reference) and copies its weights into our
``Transformer``; both are returned so tests can compare against the reference forward. ``peak`` multiplies the
output embedding so distributions are far from uniform (drafts then get both accepted and rejected).
"""

import copy
import functools
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig

from cache import FullCache
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import Transformer

# Tiny models: intra-op threads only add synchronisation overhead (and stall badly on a busy 2-core machine).
torch.set_num_threads(1)


class StubTokenizer:
    """Just what the engine needs: get_vocab(), decode() and eos_token_id."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


def llama_config(
    vocab_size: int = 32,
    hidden_size: int = 32,
    intermediate_size: int = 48,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    config_class: type[PretrainedConfig] = LlamaConfig,
    **extra,
) -> PretrainedConfig:
    """A tiny config of a Llama-family class (LlamaConfig unless config_class says otherwise)."""
    cfg = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )
    cfg._attn_implementation = "eager"
    return cfg


def full_cache_for(model: Transformer, capacity: int = 256) -> FullCache:
    """An empty full KV cache for model, in its dtype."""
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    return FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, dtype)


@dataclass
class TinyModel:
    ref: LlamaForCausalLM  # transformers reference with the same weights
    loaded: LoadedModel  # our runtime

    @property
    def model(self) -> Transformer:
        return self.loaded.model


def wrap(
    ref: torch.nn.Module, cfg, name: str = "tiny", eos_token_id: int | None = None, fused: bool = True
) -> LoadedModel:
    """Our Transformer with the weights of a transformers model, as a LoadedModel with a stub tokenizer.

    fused: merge its projections as load_model does for dense and half weights."""
    model = Transformer.from_hf_config(cfg)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    if fused:
        model.fuse_projections()
    cfg.eos_token_id = eos_token_id
    return LoadedModel(name, model.eval(), StubTokenizer(cfg.vocab_size, eos_token_id), cfg)


def make_model(seed: int = 0, peak: float = 1.0, name: str = "tiny", eos_token_id=None, **config) -> TinyModel:
    cfg = llama_config(**config)
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg).eval()
    if peak != 1.0:
        with torch.no_grad():
            ref.lm_head.weight.mul_(peak)  # shared with the input embedding when tied
    return TinyModel(ref, wrap(ref, cfg, name, eos_token_id))


@torch.no_grad()
def reference_logits(ref: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """transformers' logits (T, V) for one sequence."""
    return ref(torch.tensor([ids])).logits[0].float()


def fixed_drafts_at_least(gamma: int, verifications: int) -> int:
    """The fewest drafts a top tier with a fixed gamma makes in this many verifications: every pass drafts gamma,
    except the last ones, which draft only the tokens still wanted less one; each of those commits at least one
    token, so together they draft at most 1 + 2 + ... + (gamma - 1) fewer."""
    return gamma * verifications - gamma * (gamma - 1) // 2


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


@functools.cache
def rich_model(seed: int, vocab_size: int = 32, num_layers: int = 2, name: str = "target") -> TinyModel:
    """A tiny random model whose output depends on its context (large init), untied; cached per arguments."""
    return make_model(
        seed=seed,
        name=name,
        vocab_size=vocab_size,
        num_layers=num_layers,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )


def save_tokenizer(folder, vocab_size: int, eos: str = "<eos>"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab["<unk>"] = vocab_size - 2
    vocab[eos] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos)
    fast.save_pretrained(folder)
    return fast


def save_checkpoint(folder, seed: int = 0, **config) -> LlamaForCausalLM:
    cfg = llama_config(initializer_range=0.2, **config)
    cfg.eos_token_id = cfg.vocab_size - 1
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(folder)
    save_tokenizer(folder, cfg.vocab_size)
    return ref


def with_eos(loaded: LoadedModel, config_eos=None, tokenizer_eos=None) -> LoadedModel:
    """The same weights with other end-of-sequence ids (in the HF config and/or the tokenizer)."""
    cfg = copy.deepcopy(loaded.hf_config)
    cfg.eos_token_id = config_eos
    return LoadedModel(loaded.name, loaded.model, StubTokenizer(cfg.vocab_size, tokenizer_eos), cfg)


@pytest.fixture(scope="session")
def tiny_target() -> TinyModel:
    """Peaky tiny target (vocab 32): drafts of the tiers below it are sometimes accepted, sometimes rejected."""
    return make_model(seed=0, peak=2.0, name="target", initializer_range=0.3, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_drafter() -> TinyModel:
    """A different random model (one layer) with the same stub vocabulary."""
    return make_model(seed=1, peak=2.0, name="drafter", num_layers=1, initializer_range=0.3, tie_word_embeddings=False)
