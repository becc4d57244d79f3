"""Helpers the tests share: tiny random-weight Llama models wrapped into the runtime, stub tokenizers, small
checkpoints written to disk, and the constants of the command-line tests (the fixtures built on them are in
conftest.py).

``make_model`` builds a transformers ``LlamaForCausalLM`` (the reference) and copies its weights into our
``Transformer``; both are returned so tests can compare against the reference forward. ``peak`` multiplies the
output embedding so distributions are far from uniform (drafts then get both accepted and rejected).
"""

import copy
import functools
import random
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig
from triforce_cli.cache import FullCache, kv_dtype

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.sampling import Verdict, sample, verify_draft
from triforce_cli.runtime.loading import BuildOptions, Checkpoint, LoadedModel, model_from_state
from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.tiled_weights import use_tiled_weights


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


def small_config(**changes) -> EngineConfig:
    """Engine settings for a 64-token prompt of a tiny model: a 32-token budget of 8-token chunks, a 24-token
    drafter window after 4 sinks, 24 new tokens; changes override any of them."""
    settings = {"budget": 32, "chunk_size": 8, "draft_window": 24, "sink_tokens": 4, "max_new_tokens": 24}
    return EngineConfig(**{**settings, **changes})


# our forward against transformers' float32 one: our KV cache is float16 on the CPU (cache.kv_dtype), whose rounding of
# the keys and values (11 significant bits) moves the logits by up to 1.6e-2 on the tiny test models (logits up to ~7
# in magnitude) and 2.5e-2 on the embedded SmolLM2-135M over 300 tokens (tests/test_embedded.py)
F16_KV_TOLERANCE = {"atol": 3e-2, "rtol": 1e-3}
# our forward against ours over the same tokens split otherwise (a chunk, then steps): some keys come out in other
# float32 bits, a few of which round to a neighbouring float16 in the cache, up to ~1.2e-4 in these logits
F16_SPLIT_TOLERANCE = {"atol": 5e-4, "rtol": 1e-4}


def full_cache_for(model: Transformer, capacity: int = 256) -> FullCache:
    """An empty full KV cache for model, in the dtype the engine keeps it in (cache.kv_dtype: float16 for a float32
    model on the CPU)."""
    cfg = model.config
    dtype = kv_dtype(model.device, model.model.embed_tokens.weight.dtype)
    return FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, dtype)


@dataclass
class TinyModel:
    ref: LlamaForCausalLM  # transformers reference with the same weights
    loaded: LoadedModel  # our runtime

    @property
    def model(self) -> Transformer:
        return self.loaded.model


def wrap(ref: torch.nn.Module, cfg, name: str = "tiny", eos_token_id: int | None = None) -> LoadedModel:
    """Our Transformer with the weights of a transformers model, as a LoadedModel with a stub tokenizer."""
    model = Transformer.from_hf_config(cfg)
    missing, unexpected = model.load_hf_state(ref.state_dict())
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    cfg.eos_token_id = eos_token_id
    return LoadedModel(name, model.eval(), StubTokenizer(cfg.vocab_size, eos_token_id), cfg)


def tiled(loaded: LoadedModel) -> LoadedModel:
    """loaded with every linear in tiles (use_tiled_weights), as the loader builds a float32 model on the CPU: the
    numeric contract's kernels (Engine.exact_positions), where a model built from a reference keeps torch's."""
    use_tiled_weights(loaded.model)
    return loaded


def load_tiny(tiny: TinyModel, options: BuildOptions) -> LoadedModel:
    """tiny's weights as the loader builds a checkpoint's (model_from_state, with options), in place of its runtime
    model copied from the reference."""
    model = model_from_state(
        tiny.ref.state_dict(), tiny.loaded.hf_config, options, Checkpoint(tiny.loaded.name, Path(), [])
    )
    return replace(tiny.loaded, model=model)


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


# ---------------------------------------------------------------------------------------------- command line
# The CLI tests swap the loader (triforce_cli.decoding.pipeline.load_model) for tiny random Llama models with a
# character-level tokenizer, so Pipeline.load and Engine still run for real; save_word_checkpoint writes a tiny
# checkpoint with a word-level tokenizer to disk for the tests of the real loader.

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?'"  # 32 pieces, none of them Rich markup or emoji codes
OTHER_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456"[:32]
CONTEXT = 512  # max_position_embeddings of the in-process tiny models
UNTIED_WITHOUT_SPECIAL_TOKENS = {
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
PROMPT = "the quick brown fox jumps over the lazy dog, then naps. " * 4  # 224 characters = 224 tokens


class CharTokenizer:
    """One token per character (code point mod vocabulary size); decode maps ids to fixed pieces."""

    chat_template = None
    eos_token_id = None

    def __init__(self, pieces: list[str]):
        assert len(set(pieces)) == len(pieces)
        self.pieces = pieces

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[ord(c) % len(self.pieces) for c in text])

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[int(i)] for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {piece: i for i, piece in enumerate(self.pieces)}


def tiny_loaded(name: str, seed: int, pieces: list[str], num_layers: int = 2, peak: float = 10.0) -> LoadedModel:
    cfg = llama_config(num_layers=num_layers, max_position_embeddings=CONTEXT, **UNTIED_WITHOUT_SPECIAL_TOKENS)
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(peak)  # distributions far from uniform: no near-ties in greedy argmax
    model = Transformer.from_hf_config(cfg)
    missing, unexpected = model.load_hf_state(ref.state_dict())
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return LoadedModel(name, model.eval(), CharTokenizer(pieces), cfg)


def word_tokenizer(words: list[str], unknown: str, chat_template: str | None = None, **special_tokens):
    """A WordLevel tokenizer of words (ids in their order), split at whitespace and punctuation, any other word read
    as unknown (one of words); special_tokens (unk_token=...) as PreTrainedTokenizerFast takes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=unknown))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)
    tokenizer.chat_template = chat_template
    return tokenizer


# A chat template in words: w20 opens the conversation, w23 a user turn, w24 an assistant turn (also the prompt for the
# answer) and w21 ends a turn; a tokenizer's words are w0..w31, w31 also any word not among them (no special tokens).
WORD_CHAT_TEMPLATE = (
    "w20 {% for message in messages %}{{ 'w23' if message['role'] == 'user' else 'w24' }} {{ message['content'] }}"
    " w21 {% endfor %}{% if add_generation_prompt %}w24 {% endif %}"
)
CHAT_WORDS = [f"w{i}" for i in range(32)]


def chat_model() -> LoadedModel:
    """A tiny target whose answers depend on the whole conversation (rich_model), with the word chat template, its
    linears tiled as the loader tiles them (under the numeric contract, so chat and serve keep whole conversations)."""
    tiny = rich_model(seed=3)
    return tiled(replace(tiny.loaded, name="chat", tokenizer=word_tokenizer(CHAT_WORDS, "w31", WORD_CHAT_TEMPLATE)))


def save_word_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A tiny Llama checkpoint with a WordLevel tokenizer (w0..w30, no chat template, no EOS), saved to folder."""
    tokenizer = word_tokenizer(["[UNK]"] + [f"w{i}" for i in range(31)], "[UNK]", unk_token="[UNK]")
    cfg = llama_config(max_position_embeddings=4096, **UNTIED_WITHOUT_SPECIAL_TOKENS)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# the CPU kernels' bodies each ISA can run (torch.ops.triforce_cpu.use_isa)
KERNEL_BODIES = {"avx512": ("avx512", "avx2", "scalar"), "avx2": ("avx2", "scalar"), "scalar": ("scalar",)}


# message and the end of its turn (w21), the generation prompt (w22)
CHAT_TEMPLATE = (
    "w20 {% for message in messages %}{{ message['content'] }} w21 {% endfor %}"
    "{% if add_generation_prompt %}w22{% endif %}"
)


def wrong_verify_draft(draft_tokens, draft_probs, target_probs, generator, agree=None):
    """Speculative sampling that resamples from p (not the residual) after a rejection: NOT exact (as the reference
    reads)."""
    verdict = verify_draft(draft_tokens, draft_probs, target_probs, generator, agree)
    if verdict.accepted == draft_tokens.shape[0]:
        return verdict
    token = sample(target_probs[verdict.accepted][None], generator)  # (1,)
    return Verdict(verdict.accepted, int(token), verdict.drafts, torch.cat([verdict.ids[:-1], token]))


# Each GGUF type's float16 fields (byte offsets in its block) and the typical size of what multiplies them (scale
# times q), so that random blocks hold weights of about a chosen size
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,), "Q3_K": (108,)}  # fmt: skip
TYPICAL_Q = {
    "Q4_0": 4,
    "Q4_1": 8,
    "Q8_0": 64,
    "Q5_0": 8,
    "Q5_1": 16,
    "Q4_K": 240,
    "Q5_K": 500,
    "Q6_K": 1000,
    "Q3_K": 64,
}
BLOCK_SHAPES = {"Q3_K": (110, 256)}  # types not kept packed: bytes and weights of a block


def random_blocks(rows: int, cols: int, kind: str, seed: int, size: float = 0.3) -> torch.Tensor:
    """Random bytes (rows, cols / block weights * block bytes) of a GGUF type, as a file of it holds (gguf-py has no
    quantizer for the K-quants): every bit pattern of the q's and 6- or 8-bit scales, float16 fields finite and
    weights of about `size`."""
    import numpy as np
    from triforce_cli.kernels.gguf import BLOCK_TYPES

    block_bytes, block_weights = BLOCK_SHAPES.get(kind) or (
        BLOCK_TYPES[kind].file_bytes,
        BLOCK_TYPES[kind].file_weights,
    )
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_weights, block_bytes), dtype=np.uint8)
    for at in HALF_FIELDS[kind]:
        halves = (rng.standard_normal(len(blocks)) * size / TYPICAL_Q[kind]).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def write_gguf_model(
    path: Path, types, layers: int = 2, hidden: int = 256, ffn: int = 512, heads: int = 4, seed: int = 0
) -> None:
    """A small Llama GGUF file as llama.cpp writes one, with the embedded model's tokenizer (its vocabulary of
    49,152 tokens, chat template included): `heads` query heads (half as many key/value heads), tied embedding;
    every weight matrix random blocks of the type types(GGUF tensor name) gives, norms float32 ones."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from triforce_cli.runtime.embedded import embedded_gguf_path

    source = GGUFReader(str(embedded_gguf_path()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer = GGUFWriter(str(path), "llama")
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub)
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    shapes = {"token_embd": (vocab, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_q": (hidden, hidden), f"blk.{i}.attn_k": (hidden // 2, hidden),
                   f"blk.{i}.attn_v": (hidden // 2, hidden), f"blk.{i}.attn_output": (hidden, hidden),
                   f"blk.{i}.ffn_gate": (ffn, hidden), f"blk.{i}.ffn_up": (ffn, hidden),
                   f"blk.{i}.ffn_down": (hidden, ffn)}  # fmt: skip
    for index, (name, (rows, cols)) in enumerate(shapes.items()):
        kind = types(name)
        raw = random_blocks(rows, cols, kind, seed=seed * 1000 + index, size=0.02 if name == "token_embd" else 0.1)
        writer.add_tensor(f"{name}.weight", raw.numpy(), raw_dtype=GGMLQuantizationType[kind])
        if name.endswith("ffn_down"):
            layer = name.split(".")[1]
            for norm in ("attn_norm", "ffn_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    close_gguf(writer, hidden)


def close_gguf(writer, hidden: int) -> None:
    """Add the final norm (float32 ones) to a GGUFWriter of a Llama and write the file."""
    import numpy as np

    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_q4_k_m(name: str) -> str:
    """The types llama.cpp's Q4_K_M quantization gives a Llama whose rows are multiples of 256 wide: Q6_K for the
    value projections and the MLP's down projections, Q4_K for the rest, and (here) Q8_0 for the embedding."""
    if name == "token_embd":
        return "Q8_0"
    return "Q6_K" if name.endswith(("attn_v", "ffn_down")) else "Q4_K"


ROWS = 300  # batches of 1 to ROWS rows


def split_points(total: int, seed: int) -> list[tuple[int, int]]:
    """Batches (start, rows) covering [0, total): the lengths of the few-row plans (1 to 9), a prefill chunk's 256
    and all of them, then random cuts of every length."""
    rng = random.Random(seed)
    batches = [(rng.randrange(total - rows + 1), rows) for rows in (*range(1, 10), 256, total)]
    start = 0
    while start < total:
        rows = rng.choice((1, 2, 3, 5, 8, rng.randint(1, total - start)))
        rows = min(rows, total - start)
        batches.append((start, rows))
        start += rows
    return batches


def assert_rows_alone(op, x: torch.Tensor, seed: int, row_dim: int = 0) -> None:
    """op(batch)'s row i equals op(row i alone, a tensor of its own) bit for bit for every batch of split_points,
    on one thread and on two."""
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            alone = [op(x.narrow(row_dim, i, 1).clone()) for i in range(x.shape[row_dim])]
            for start, rows in split_points(x.shape[row_dim], seed):
                out = op(x.narrow(row_dim, start, rows))
                for i in range(rows):
                    row = out.narrow(row_dim, i, 1)
                    assert torch.equal(row, alone[start + i]), f"row {start + i} of a batch of {rows}, {count} threads"
    finally:
        torch.set_num_threads(threads)
