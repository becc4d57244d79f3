"""GGUF weights (`--weights gguf`): linears and embedding computed from the blocks of every type kept packed (Q4_0,
Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K).

The kernel must give the product with the dequantized weights (gguf-py's own dequantization is the reference) in
every body the CPU can run, the runtime must compute what transformers computes on those dequantized weights,
and every speculative mode must reproduce its own autoregressive output, greedy and sampled.
"""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    F16_KV_TOLERANCE,
    close_gguf,
    full_cache_for,
    llama_cpp_q4_k_m,
    make_model,
    random_blocks,
    random_prompt,
    reference_logits,
    write_gguf_model,
)
from torch import nn
from triforce_cli.cache import FullCache
from triforce_cli.kernels.gguf import (
    BLOCK_KINDS,
    BLOCK_TYPES,
    PackedBlocks,
    blocks_linear,
    blocks_rows,
    dequantize,
    pack_blocks,
)
from typer.testing import CliRunner

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.runtime.gguf_weights import GGUFEmbedding, GGUFLinear, apply_gguf_blocks
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import ConcatLinear
from triforce_cli.runtime.native import kernel_error

pytest.importorskip("gguf", reason="gguf-py reads and writes the files (a `pip install --no-deps` may lack it)")
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

KERNEL_ERROR = kernel_error()

pytestmark = pytest.mark.skipif(KERNEL_ERROR is not None, reason=f"no GGUF block kernel here: {KERNEL_ERROR}")

GREEDY = SamplingConfig(temperature=0)


def quantized(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """weight (N, K) as a GGUF tensor's bytes (N, K/32 * block bytes), by gguf-py's quantizer."""
    return torch.from_numpy(gguf_quantize(weight.detach().float().numpy(), GGMLQuantizationType[kind]))


def weight_bytes(rows: int, cols: int, kind: str, seed: int) -> torch.Tensor:
    """A random (rows, cols) weight as a GGUF tensor's bytes: gguf-py's quantizer where it has one, else
    random_blocks."""
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return random_blocks(rows, cols, kind, seed)
    torch.manual_seed(seed)
    return quantized(torch.randn(rows, cols), kind)


def width(kind: str) -> int:
    """Columns of a test weight: 3 blocks, or 2 super-blocks of a K-quant."""
    return 2 * 256 if BLOCK_TYPES[kind].file_weights == 256 else 96


def reference_weight(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """gguf-py's dequantization of the bytes: the weight the blocks hold."""
    return torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_dequantize_is_gguf_py_dequantization_bit_for_bit(kind):
    raw = weight_bytes(40, width(kind), kind, seed=0)
    packed = pack_blocks(raw, kind)
    assert (packed.out_features, packed.in_features) == (40, width(kind))
    assert packed.q.shape[0] == 3  # 40 rows padded to 3 tiles of 16
    assert torch.equal(dequantize(packed), reference_weight(raw, kind))
    rows = torch.tensor([39, 0, 17, 17])
    assert torch.equal(blocks_rows(packed, rows), reference_weight(raw, kind)[rows])  # the embedding's lookup


def test_rows_outside_the_blocks_are_refused():
    packed = pack_blocks(weight_bytes(40, width("Q8_0"), "Q8_0", seed=0), "Q8_0")
    with pytest.raises(RuntimeError, match="rows 0 to 47 of the blocks, not 48"):
        blocks_rows(packed, torch.tensor([3, 48]))
    with pytest.raises(RuntimeError, match="on the CPU"):
        blocks_rows(packed, torch.tensor([3], device="meta"))


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_packed_bytes_per_weight_are_the_types_own(kind):
    """What the planner counts for a type (BlockKind.bytes_per_weight) is what its packed blocks hold."""
    packed = pack_blocks(weight_bytes(32, width(kind), kind, seed=1), kind)
    assert packed.nbytes == 32 * width(kind) * BLOCK_TYPES[kind].bytes_per_weight()


@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 40, 64, 77])
def test_product_is_the_dequantized_product(body, kind, rows):
    """Passes of up to 6 rows (AVX2: 4), then the rest, over one chunk of tiles."""
    raw = weight_bytes(40, width(kind), kind, seed=rows)
    x = torch.randn(rows, width(kind))
    out = blocks_linear(x, pack_blocks(raw, kind))
    expected = x.double() @ reference_weight(raw, kind).double().T
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_wide_weight_passes_over_chunks_of_tiles(body, kind):
    """K = 4096: a tile's blocks take 48-72 KiB, so the 7 tiles go through in several chunks of the L2 budget."""
    raw = weight_bytes(100, 4096, kind, seed=3)
    x = torch.randn(13, 4096)
    out = blocks_linear(x, pack_blocks(raw, kind))
    expected = x.double() @ reference_weight(raw, kind).double().T
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-4)  # sums of 4096 float32 products


@pytest.mark.parametrize("rows", [1, 77])
def test_tiles_split_over_threads_give_the_one_thread_product(rows):
    torch.manual_seed(5)
    packed = pack_blocks(quantized(torch.randn(100, 64), "Q4_1"), "Q4_1")  # 7 tiles
    x = torch.randn(rows, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = blocks_linear(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(blocks_linear(x, packed), alone)  # each output is summed by one thread, in one order
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_a_row_has_the_same_bits_in_any_batch_and_on_any_number_of_threads(body, kind):
    """Row i of a batch of n rows (1 to 300: the few-row passes, their tails and the many-row product) is the row
    computed alone, bit for bit, on 1 and 2 threads: one order of arithmetic per output element."""
    raw = weight_bytes(100, width(kind), kind, seed=11)  # 7 tiles: groups of tiles and a rest, split over threads
    packed = pack_blocks(raw, kind)
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(300, width(kind), generator=generator) * torch.rand(300, 1, generator=generator) * 4
    splits = torch.randperm(299, generator=generator)[:6].add(1).sort().values.tolist()  # random split points
    batches = [(0, 300), *zip([0, *splits], [*splits, 300])]
    batches += [(start, start + n) for start, n in ((0, 64), (7, 63), (13, 200), (299, 1), (150, 6), (40, 77))]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([blocks_linear(x[i : i + 1], packed) for i in range(300)])  # (300, 100)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for start, end in batches:
                assert torch.equal(blocks_linear(x[start:end], packed), alone[start:end]), (threads, start, end)
    finally:
        torch.set_num_threads(before)


def test_a_wrong_input_is_one_clear_error():
    packed = pack_blocks(quantized(torch.randn(16, 64), "Q4_1"), "Q4_1")
    with pytest.raises(RuntimeError, match="K = 32 \\* blocks"):
        blocks_linear(torch.randn(2, 96), packed)


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K", "Q8_0"])
def test_a_block_is_one_record_of_whole_cache_lines(kind):
    """q, d and m are views of one record a block, whole 64-byte lines (one stream of memory for the kernel); q, d
    and m as tensors of their own are refused, not read as if they were records."""
    packed = pack_blocks(weight_bytes(40, width(kind), kind, seed=2), kind)
    record = packed.records.shape[2]
    assert record % 64 == 0 and packed.records.is_contiguous()
    assert record == packed.q_bytes + 64 * (packed.groups + packed.minimums)
    for view in packed.operands():
        if view is not None:
            assert view.untyped_storage().data_ptr() == packed.records.untyped_storage().data_ptr()
    x = torch.randn(3, width(kind))
    expected = blocks_linear(x, packed)
    apart = [None if t is None else t.contiguous() for t in packed.operands()]
    with pytest.raises(RuntimeError, match="in the records after q"):
        torch.ops.triforce_cpu.blocks_linear(x, *apart)
    stacked = PackedBlocks(torch.cat([packed.records, packed.records]), packed.four_bit, packed.groups,
                           packed.minimums, 2 * 48)  # fmt: skip
    assert torch.equal(blocks_linear(x, stacked)[:, 48:88], expected)  # tiles stacked: records stay whole


def classic_types(name: str) -> str:
    """Q4_1 linears, Q4_0 for the MLP's down projection, Q8_0 for the embedding and output layer."""
    if name in ("lm_head", "model.embed_tokens"):
        return "Q8_0"
    return "Q4_0" if name.endswith("down_proj") else "Q4_1"


def q4_k_m_types(name: str) -> str:
    """As llama.cpp's Q4_K_M mixes them: Q4_K, with Q6_K for the value and down projections and the output layer,
    Q5_0 and Q5_1 for a few, Q8_0 for the embedding; Q5_K for the up projection, so that every type is there."""
    for suffix, kind in (("v_proj", "Q6_K"), ("down_proj", "Q6_K"), ("lm_head", "Q6_K"), ("embed_tokens", "Q8_0"),
                         ("k_proj", "Q5_0"), ("gate_proj", "Q5_1"), ("up_proj", "Q5_K")):  # fmt: skip
        if name.endswith(suffix):
            return kind
    return "Q4_K"


def gguf_tiny_model(seed: int, tie: bool = False, vocab_size: int = 32, types=classic_types, **config):
    """A tiny model whose linears, embedding and output layer hold GGUF blocks of the type types(module name)
    gives (gguf-py's quantization of random weights, or random blocks for the K-quants); returns (the transformers
    reference holding the dequantized weights, the dense runtime model on them, the runtime model computing from
    the blocks)."""
    settings = {"seed": seed, "initializer_range": 0.3, "tie_word_embeddings": tie, "vocab_size": vocab_size,
                "intermediate_size": 64, **config}  # fmt: skip
    tiny = make_model(**settings)
    blocks = {}
    with torch.no_grad():
        for index, (name, module) in enumerate(tiny.ref.named_modules()):
            if isinstance(module, (nn.Linear, nn.Embedding)) and name not in blocks:
                if name == "lm_head" and tie:
                    continue
                kind = types(name)
                rows, cols = module.weight.shape
                if kind in ("Q4_K", "Q5_K", "Q6_K"):
                    raw = random_blocks(rows, cols, kind, seed=seed * 1000 + index)
                else:
                    raw = quantized(module.weight, kind)
                module.weight.copy_(reference_weight(raw, kind))
                blocks[name] = pack_blocks(raw, kind)
    dense = make_model(**settings)
    dense.model.load_hf_state(tiny.ref.state_dict())
    packed = make_model(**settings)
    packed.model.load_hf_state(tiny.ref.state_dict())
    assert apply_gguf_blocks(packed.model, blocks) == len(blocks)
    return tiny.ref, dense.loaded, dataclasses.replace(packed.loaded, weights="gguf")


K_QUANT_SHAPES = {"hidden_size": 256, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2}  # rows of 256


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_every_weight_computes_from_its_blocks(tie):
    _, _, packed = gguf_tiny_model(1, tie=tie)
    modules = dict(packed.model.named_modules())
    assert not any(isinstance(m, (nn.Linear, nn.Embedding, ConcatLinear)) for m in modules.values())
    assert isinstance(modules["model.layers.0.self_attn.qkv_proj"], GGUFLinear)  # q, k, v stacked
    assert isinstance(modules["model.embed_tokens"], GGUFEmbedding)
    assert (packed.model.lm_head is packed.model.model.embed_tokens.blocks) == tie
    assert isinstance(packed.model.lm_head, GGUFLinear)


def test_a_linears_blocks_and_their_views_are_made_once_for_the_records_in_place():
    """GGUFLinear.packed (and the q, d, m views its operands are) is made once and kept while the records stay the
    same tensor; records moved (_apply) or replaced are read anew, and the kept blocks no longer hold the old ones."""
    linear = gguf_tiny_model(1)[2].model.model.layers[0].mlp.down_proj
    packed = linear.packed
    assert linear.packed is packed and packed.operands() is linear.packed.operands()
    linear._apply(lambda t: t.clone())
    moved = linear.packed
    assert moved is not packed and moved.records is linear.records and torch.equal(moved.records, packed.records)
    linear.records = packed.records.clone()
    assert linear.packed.records is linear.records


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_on_the_dequantized_weights(tie):
    ref, dense, packed = gguf_tiny_model(2, tie=tie)
    check_logits(ref, dense, packed)


def test_a_q4_k_m_mix_matches_transformers_on_its_dequantized_weights():
    ref, dense, packed = gguf_tiny_model(2, types=q4_k_m_types, **K_QUANT_SHAPES)
    kinds = {type(m).__name__: m for m in packed.model.modules()}
    assert "Linear" not in kinds and "ConcatLinear" in kinds  # q (Q4_K), k (Q5_0), v (Q6_K) forms cannot stack
    check_logits(ref, dense, packed)


def check_logits(ref, dense, packed):
    """Both runtime models' prefill logits are transformers' within the float16 cache's tolerance, or 1% of the
    largest logit where that is more (27 for the K-quant shapes, whose activations the rounding moves by up to
    0.14); on float32 caches, transformers' and each other's to float32 rounding of sums as wide as the model."""
    ids = random_prompt(48, 32, seed=3)
    expected = reference_logits(ref, ids)
    largest = expected.abs().max().item()
    rounding = max(1e-4, 2e-5 * largest)
    for loaded in (dense, packed):
        model, cfg = loaded.model, loaded.model.config
        logits = model(torch.tensor(ids), 0, full_cache_for(model, 64), num_logits=len(ids))
        torch.testing.assert_close(logits, expected, atol=max(F16_KV_TOLERANCE["atol"], 1e-2 * largest), rtol=1e-3)
        float32_cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32)
        logits = model(torch.tensor(ids), 0, float32_cache, num_logits=len(ids))
        torch.testing.assert_close(logits, expected, atol=rounding, rtol=1e-4)


SETTINGS = {"chunk_size": 8, "budget": 32, "sink_tokens": 4, "draft_window": 16, "gamma1": 2, "gamma2": 6,
            "max_new_tokens": 60, "prefill_block": 16}  # fmt: skip


@pytest.mark.parametrize(("seed", "types"), [(0, classic_types), (1, classic_types), (2, q4_k_m_types)])
def test_greedy_every_mode_equals_dense_autoregressive(seed, types):
    """Packed blocks in every mode give the tokens plain greedy decoding gives on the dequantized weights."""
    shapes = K_QUANT_SHAPES if types is q4_k_m_types else {}
    _, dense, packed = gguf_tiny_model(seed, types=types, **shapes)
    drafter = make_model(seed=seed + 50, num_layers=1, initializer_range=0.3, tie_word_embeddings=False).loaded
    prompt = random_prompt(200, 32, seed=100 + seed)
    expected = Engine(dense, EngineConfig(mode="autoregressive", sampling=GREEDY, **SETTINGS)).generate(prompt)
    assert len(set(expected.token_ids)) > 5
    reference = Engine(packed, EngineConfig(mode="autoregressive", sampling=GREEDY, **SETTINGS))
    assert reference.generate(prompt).token_ids == expected.token_ids
    assert reference._caches.full.keys.dtype == torch.float16  # the cache read as float16, as 'half'
    for mode, ngram in (("retrieval", False), ("streaming", False), ("triforce", False), ("triforce", True)):
        config = EngineConfig(mode=mode, ngram=ngram, sampling=GREEDY, **SETTINGS)
        result = Engine(packed, config, drafter=drafter).generate(prompt)
        assert result.token_ids == expected.token_ids, (mode, ngram)


def sampled_pairs(target: LoadedModel, drafter: LoadedModel, mode: str, trials: int) -> list[tuple[int, int]]:
    """The first two tokens of `trials` seeded generations at temperature 1 (drafts judged on their own
    probabilities: no n-gram proposer)."""
    prompt = random_prompt(24, 8, seed=7)
    base = EngineConfig(mode=mode, ngram=False, chunk_size=4, budget=8, sink_tokens=2, draft_window=8, gamma1=2,
                        gamma2=3, max_new_tokens=4, refresh_interval=1, prefill_block=8)  # fmt: skip
    pairs = []
    for seed in range(trials):
        sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, seed=seed)
        tokens = Engine(target, dataclasses.replace(base, sampling=sampling), drafter=drafter).generate(prompt)
        pairs.append(tuple(tokens.token_ids[:2]))
    return pairs


def test_sampled_triforce_has_the_packed_targets_distribution():
    """Chi-square of the first two sampled tokens against the packed target's joint distribution at temperature 1
    (the second token's from a prefill of prompt + first: a float32 cache where decoding reads the prompt as
    float16, a difference far below what 1,200 samples resolve)."""
    from scipy.stats import chisquare

    _, _, target = gguf_tiny_model(4, vocab_size=8)
    drafter = make_model(seed=104, num_layers=1, vocab_size=8, initializer_range=0.3, tie_word_embeddings=False)
    prompt = random_prompt(24, 8, seed=7)
    engine = Engine(target, EngineConfig(mode="autoregressive", prefill_block=8))
    state = engine.prefill(prompt)
    probs = torch.zeros(8, 8, dtype=torch.float64)
    first = state.last_logits.double().softmax(-1)[0]
    for a in range(8):
        step = Engine(target, EngineConfig(mode="autoregressive", prefill_block=8)).prefill([*prompt, a])
        probs[a] = first[a] * step.last_logits.double().softmax(-1)[0]
    pairs = sampled_pairs(target, drafter.loaded, "triforce", 1200)
    observed = np.zeros((8, 8))
    for a, b in pairs:
        observed[a, b] += 1
    expected = probs.numpy() * len(pairs) / probs.sum().item()
    large = expected >= 5
    assert large.sum() >= 6
    obs = np.append(observed[large], observed[~large].sum())
    exp = np.append(expected[large], expected[~large].sum())
    assert chisquare(obs, exp).pvalue > 1e-3


def llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's rows in llama.cpp's order (its converter permutes them for its rotary layout)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def write_tiny_gguf(path, hf_config) -> dict[str, torch.Tensor]:
    """A tiny Llama GGUF file as llama.cpp's converter writes one (q/k rows permuted; linears Q4_1, the tied
    embedding Q8_0, norms float32); returns the weights each quantized tensor holds, in Hugging Face row order."""
    from gguf import GGUFWriter

    torch.manual_seed(9)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    held = {}

    def add(gguf_name: str, hf_name: str, weight: torch.Tensor, kind: str, heads: int = 0):
        raw = quantized(weight, kind)
        held[hf_name] = reference_weight(raw, kind)
        stored = llama_cpp_rows(weight, heads) if heads else weight
        writer.add_tensor(gguf_name, quantized(stored, kind).numpy(), raw_dtype=GGMLQuantizationType[kind])

    hidden = hf_config.hidden_size
    kv_rows = hf_config.num_key_value_heads * hidden // hf_config.num_attention_heads
    add("token_embd.weight", "model.embed_tokens", torch.randn(hf_config.vocab_size, hidden), "Q8_0")
    for i in range(hf_config.num_hidden_layers):
        layer = f"model.layers.{i}"
        heads = hf_config.num_attention_heads
        add(f"blk.{i}.attn_q.weight", f"{layer}.self_attn.q_proj", torch.randn(hidden, hidden), "Q4_1", heads)
        add(f"blk.{i}.attn_k.weight", f"{layer}.self_attn.k_proj", torch.randn(kv_rows, hidden), "Q4_1",
            hf_config.num_key_value_heads)  # fmt: skip
        add(f"blk.{i}.attn_v.weight", f"{layer}.self_attn.v_proj", torch.randn(kv_rows, hidden), "Q4_1")
        add(f"blk.{i}.attn_output.weight", f"{layer}.self_attn.o_proj", torch.randn(hidden, hidden), "Q4_1")
        for name, hf_name in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj")):
            add(f"blk.{i}.{name}.weight", f"{layer}.mlp.{hf_name}", torch.randn(64, hidden), "Q4_1")
        add(f"blk.{i}.ffn_down.weight", f"{layer}.mlp.down_proj", torch.randn(hidden, 64), "Q4_1")
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    close_gguf(writer, hidden)
    return held


def test_a_gguf_file_gives_its_weights_in_hugging_face_row_order_and_is_kept_while_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))  # where the file's identity is remembered
    from transformers import LlamaConfig

    from triforce_cli.runtime import gguf_weights

    hf_config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    gguf = tmp_path / "tiny.gguf"
    held = write_tiny_gguf(gguf, hf_config)
    reads = []
    read = gguf_weights.read_gguf_blocks
    monkeypatch.setattr(gguf_weights, "read_gguf_blocks", lambda *args: reads.append(1) or read(*args))

    blocks = gguf_weights.gguf_blocks(gguf, hf_config, tmp_path / "converted")
    assert set(blocks) == set(held)
    for name, weight in held.items():
        assert torch.equal(dequantize(blocks[name]), weight), name  # q and k rows back in Hugging Face's order
    kept = gguf_weights.gguf_blocks(gguf, hf_config, tmp_path / "converted")
    assert len(reads) == 1  # the second time from the kept copy
    for name in held:
        assert torch.equal(kept[name].records, blocks[name].records) and kept[name].form == blocks[name].form
        assert kept[name].records.data_ptr() % 64 == 0  # whole cache lines, wherever the file put the tensor

    stat = gguf.stat()  # touched, the same bytes (a copy installed elsewhere, say): still the kept copy
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    gguf_weights.gguf_blocks(gguf, hf_config, tmp_path / "converted")
    assert len(reads) == 1
    with gguf.open("r+b") as handle:  # other bytes: read anew, never served from the copy
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)[0]
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last ^ 1]))
    gguf_weights.gguf_blocks(gguf, hf_config, tmp_path / "converted")
    assert len(reads) == 2


def test_a_kept_copy_whose_records_do_not_fit_their_form_is_read_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from triforce_cli.runtime import gguf_weights

    hf_config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, hf_config)
    reads = []
    read = gguf_weights.read_gguf_blocks
    monkeypatch.setattr(gguf_weights, "read_gguf_blocks", lambda *args: reads.append(1) or read(*args))
    blocks = gguf_weights.gguf_blocks(gguf, hf_config, tmp_path / "converted")
    stored = tmp_path / "converted" / gguf_weights.BLOCKS_FILE
    with safe_open(stored, framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    forms = json.loads(metadata["forms"])
    rows, four_bit, _, minimums = forms["model.layers.0.self_attn.o_proj"]
    forms["model.layers.0.self_attn.o_proj"] = [rows, four_bit, 2, minimums]  # a record a line short of that form
    save_file(tensors, stored, metadata={**metadata, "forms": json.dumps(forms)})

    again = gguf_weights.gguf_blocks(gguf, hf_config, tmp_path / "converted")
    assert len(reads) == 2  # read from the file again, not served from a copy that does not match its form
    assert again["model.layers.0.self_attn.o_proj"].form == blocks["model.layers.0.self_attn.o_proj"].form


def every_packed_type(name: str) -> str:
    """The first layer as llama.cpp's Q4_K_M (llama_cpp_q4_k_m), the second with the 5-bit types in it too."""
    if name.startswith("blk.1."):
        for suffix, kind in (("attn_k", "Q5_0"), ("attn_output", "Q5_1"), ("ffn_up", "Q5_K")):
            if name.endswith(suffix):
                return kind
    return llama_cpp_q4_k_m(name)


def some_q3_k(name: str) -> str:
    """every_packed_type, the attention output projections Q3_K (a type not kept packed)."""
    return "Q3_K" if name.endswith("attn_output") else every_packed_type(name)


@pytest.fixture(scope="module")
def k_quant_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("k-quants")
    files = {"mixed": folder / "tiny-Q4_K_M.gguf", "q3_k": folder / "tiny-Q3_K.gguf"}
    write_gguf_model(files["mixed"], every_packed_type)
    write_gguf_model(files["q3_k"], some_q3_k)
    return files


@pytest.mark.embedded  # the files carry the embedded model's tokenizer
def test_a_k_quant_file_keeps_every_weight_packed_and_generates_as_its_dequantized_copy(k_quant_files, tmp_path,
                                                                                        monkeypatch):  # fmt: skip
    """`generate --target file.gguf`: greedy tokens of every mode from the packed blocks are those of plain greedy
    decoding on the float32 weights transformers dequantizes the file to; `bench` names the file's types."""
    from triforce_cli.cli.app import app
    from triforce_cli.runtime.loading import load_model

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    notes = []
    packed = load_model(str(k_quant_files["mixed"]), weights="gguf", status=notes.append)
    assert packed.file_types == {"Q4_K": 7, "Q6_K": 4, "Q8_0": 1, "Q5_0": 1, "Q5_1": 1, "Q5_K": 1}
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in packed.model.modules())
    assert not any("not kept packed" in note for note in notes)

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The old lighthouse keeper wrote in his logbook every night. " * 40)

    def tokens(*args) -> list[int]:
        command = ["generate", "--target", k_quant_files["mixed"], "-p", prompt, "--temperature", 0, "--chunk-size",
                   8, "--budget", 64, "--max-new-tokens", 24, "--ignore-eos", "--json", *args]  # fmt: skip
        result = CliRunner().invoke(app, list(map(str, command)))
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.splitlines()[-1])["token_ids"]

    expected = tokens("--weights", "dense", "--mode", "autoregressive")
    assert len(set(expected)) > 5
    for mode in ("autoregressive", "retrieval", "streaming", "triforce"):
        assert tokens("--weights", "gguf", "--mode", mode) == expected, mode

    command = ["bench", "--target", k_quant_files["mixed"], "-p", prompt, "--context", 256, "--max-new-tokens", 4,
               "--repeats", 1, "--warmup", 0, "--budget", 64, "--chunk-size", 8, "--weights", "gguf", "--modes",
               "autoregressive,triforce", "--ignore-eos"]  # fmt: skip
    result = CliRunner().invoke(app, list(map(str, command)))
    assert result.exit_code == 0, result.output
    header = " ".join(result.stdout.split())  # as wrapped to the terminal's width
    assert "gguf weights; its GGUF file holds Q4_K x7, Q6_K x4, Q8_0 x1, Q5_0 x1, Q5_1 x1, Q5_K x1" in header


@pytest.mark.embedded
def test_a_type_not_kept_packed_is_named_and_computed_from_its_dequantized_weights(k_quant_files, tmp_path,
                                                                                   monkeypatch):  # fmt: skip
    from triforce_cli.runtime.loading import load_model

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    notes = []
    packed = load_model(str(k_quant_files["q3_k"]), weights="gguf", status=notes.append)
    assert [note for note in notes if "not kept packed" in note] == [
        "tiny-Q3_K: Q3_K x2 weights are not kept packed: computed from float32 copies"
    ]
    modules = dict(packed.model.named_modules())
    assert type(modules["model.layers.0.self_attn.o_proj"]).__name__ == "TiledLinear"  # float32 copies, tiled
    assert isinstance(modules["model.layers.0.mlp.down_proj"], GGUFLinear)
    dense = load_model(str(k_quant_files["q3_k"]), weights="dense")
    torch.testing.assert_close(modules["model.layers.0.self_attn.o_proj"].weight,
                               dense.model.model.layers[0].self_attn.o_proj.weight, atol=0, rtol=0)  # fmt: skip
    prompt = random_prompt(64, 1000, seed=3)
    config = EngineConfig(mode="autoregressive", sampling=GREEDY, max_new_tokens=12, prefill_block=32)
    assert Engine(packed, config).generate(prompt).token_ids == Engine(dense, config).generate(prompt).token_ids


@pytest.mark.embedded
def test_the_shipped_drafter_drafts_for_another_file_of_its_model_only(k_quant_files, tmp_path, monkeypatch):
    """A file of the embedded model in other types keeps its embedding (the drafter borrows it): the shipped drafter
    is its default; a model with another embedding drafts for itself."""
    from transformers import AutoConfig

    from triforce_cli.decoding.pipeline import drafter_spec
    from triforce_cli.runtime.embedded import EMBEDDED_DRAFTER
    from triforce_cli.runtime.loading import resolve_checkpoint

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    embedded = resolve_checkpoint(None)
    same = LoadedModel("a Q4_K_M copy", None, None, AutoConfig.from_pretrained(embedded.folder),
                       weight_files=embedded.weight_files)  # fmt: skip
    assert drafter_spec(same, None) == str(EMBEDDED_DRAFTER)
    assert drafter_spec(same, "self") is None and drafter_spec(same, "other") == "other"
    other = resolve_checkpoint(str(k_quant_files["mixed"]))
    stranger = LoadedModel("random", None, None, AutoConfig.from_pretrained(other.folder),
                           weight_files=other.weight_files)  # fmt: skip
    assert drafter_spec(stranger, None) is None
