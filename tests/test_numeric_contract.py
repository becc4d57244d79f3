"""The numeric contract of the CPU target forward (docs/architecture.md): on the CPU with a float32 model, every
position holds the same bits however it was computed. A prompt prefilled in 256-token chunks, the same prompt fed
token by token (as one-token decode steps feed it) and fed in random pieces of 1 to 8 tokens (as verifications of
drafts feed it), with 1 thread and with 2, leave bit-identical keys, values and logits in the full cache the engine
builds.

This is what makes reuse exact (Engine.exact_positions, Held.reusable): a later prompt keeps the positions a decode
step computed and prefills only what is new, and still gets the tokens a fresh prefill gives.

Checked on a tiny random dense model and, where it is installed, on the embedded GGUF model with its block weights.
"""

import random

import pytest
import torch
from helpers import make_model, random_prompt, small_config

from triforce_cli.decoding.engine import Engine
from triforce_cli.errors import ModelLoadError
from triforce_cli.runtime.embedded import embedded_gguf_path
from triforce_cli.runtime.environment import torch_threads
from triforce_cli.runtime.loading import LoadedModel, load_model
from triforce_cli.runtime.tiled_weights import use_tiled_weights

PROMPT_TOKENS = 600
CHUNK = 256  # the CPU's prefill chunk
THREADS = (1, 2)


def pieces(lengths: list[int], total: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive pieces of the given lengths over [0, total), the last one cut at total."""
    bounds, start = [], 0
    for length in lengths:
        if start >= total:
            break
        bounds.append((start, min(start + length, total)))
        start += length
    return bounds


def feedings(total: int) -> dict[str, list[tuple[int, int]]]:
    """The ways a prompt of total tokens is fed: prefill chunks, one token at a time, random pieces of 1-8."""
    draw = random.Random(46)
    return {
        "chunks": pieces([CHUNK] * total, total),
        "tokens": pieces([1] * total, total),
        "pieces": pieces([draw.randint(1, 8) for _ in range(total)], total),
    }


def fed(loaded: LoadedModel, ids: list[int], bounds: list[tuple[int, int]], threads: int):
    """Keys, values (layers, Hkv, P, D) of the engine's full cache and the logits (P, V) at every position after
    feeding ids piece by piece (bounds) on threads, each piece one forward as a prefill chunk or a step runs it."""
    engine = Engine(loaded, small_config(mode="autoregressive", prefill_block=CHUNK, cache_positions=len(ids) + 8))
    full = engine._allocate(len(ids)).full
    tokens = torch.tensor(ids, dtype=torch.long)
    logits = []
    with torch_threads(threads):
        for start, stop in bounds:
            prefill = stop - start == CHUNK
            logits.append(loaded.model(tokens[start:stop], start, full, num_logits=stop - start, decoding=not prefill))
    _, keys, values = full.held()
    return keys.clone(), values.clone(), torch.cat(logits)


def check_contract(loaded: LoadedModel, ids: list[int]) -> None:
    reference = fed(loaded, ids, feedings(len(ids))["chunks"], THREADS[0])
    assert reference[2].shape[0] == len(ids) and reference[0].shape[2] == len(ids)
    for name, bounds in feedings(len(ids)).items():
        for threads in THREADS:
            keys, values, logits = fed(loaded, ids, bounds, threads)
            where = f"{name} on {threads} threads"
            assert torch.equal(keys, reference[0]), f"keys of {where} differ from a prefill in chunks"
            assert torch.equal(values, reference[1]), f"values of {where} differ from a prefill in chunks"
            assert torch.equal(logits, reference[2]), f"logits of {where} differ from a prefill in chunks"


def test_a_dense_float32_model_gives_every_position_the_same_bits_however_it_is_fed():
    tiny = make_model(
        seed=46,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    loaded = tiny.loaded
    assert use_tiled_weights(loaded.model) > 0  # as the loader builds a float32 model on the CPU
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert Engine(loaded, small_config()).exact_positions
    check_contract(loaded, random_prompt(PROMPT_TOKENS, 96, seed=46))


@pytest.mark.embedded
def test_the_embedded_gguf_model_gives_every_position_the_same_bits_however_it_is_fed():
    pytest.importorskip("gguf")
    try:
        embedded_gguf_path()
    except ModelLoadError as missing:  # not installed: nothing to check
        pytest.skip(str(missing))
    loaded = load_model(None, weights="gguf")
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    ids = random_prompt(PROMPT_TOKENS, loaded.model.config.vocab_size, seed=46)
    check_contract(loaded, ids)
