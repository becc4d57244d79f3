"""Fixtures the tests share, built on the helpers in helpers.py, and the settings every test runs under."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    ALPHABET,
    CHAT_TEMPLATE,
    KERNEL_BODIES,
    OTHER_ALPHABET,
    PROMPT,
    CharTokenizer,
    TinyModel,
    chat_model,
    make_model,
    save_checkpoint,
    save_tokenizer,
    tiny_loaded,
)
from triforce_cli.kernels.native import cpu_isa

import triforce_cli.decoding.pipeline
import triforce_cli.decoding.setup
from triforce_cli.runtime.loading import Checkpoint, LoadedModel
from triforce_cli.runtime.native import kernel_error

# Tiny models: intra-op threads only add synchronisation overhead (and stall badly on a busy 2-core machine).
torch.set_num_threads(1)
# No first-run measurement of the fastest configuration (decoding.tuning) in tests that do not ask for one: the
# rule it replaces keeps them fast and deterministic; tests/test_tuning.py switches it on.
os.environ["TRIFORCE_TUNING"] = "off"
# The CPU extension (built once per machine) from the start, so that every test computes attention of many queries
# with the same kernel whatever ran before it (kernels.attention picks it once loaded).
kernel_error()


@pytest.fixture(scope="session")
def tiny_target() -> TinyModel:
    """Peaky tiny target (vocab 32): drafts of the tiers below it are sometimes accepted, sometimes rejected."""
    return make_model(seed=0, peak=2.0, name="target", initializer_range=0.3, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_drafter() -> TinyModel:
    """A different random model (one layer) with the same stub vocabulary."""
    return make_model(seed=1, peak=2.0, name="drafter", num_layers=1, initializer_range=0.3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_models() -> dict:
    """Model spec -> LoadedModel; any other spec (including None, the embedded default) gets 'tiny'."""
    target = tiny_loaded("tiny", seed=0, pieces=list(ALPHABET))
    markup = [f"[bold]{c}" if i % 2 else f":fire:{c}" for i, c in enumerate(ALPHABET)]
    return {
        "tiny": target,
        "drafter": tiny_loaded("drafter", seed=1, pieces=list(ALPHABET), num_layers=1),
        "other-vocab": tiny_loaded("other-vocab", seed=1, pieces=list(OTHER_ALPHABET), num_layers=1),
        "markup": LoadedModel("markup", target.model, CharTokenizer(markup), target.hf_config),
        "chat": chat_model(),
    }


@pytest.fixture
def tiny(monkeypatch, tiny_models) -> dict:
    """Pipeline.load runs for real, but every model spec resolves to an in-memory tiny model."""
    calls = []

    def fake_load_model(
        spec,
        dtype=torch.float32,
        device="cpu",
        status=None,
        weights="dense",
        shared_from=None,
        context_window=None,
        tensor_parallel=False,
        offload_weights=False,
        resident_layers=0,
        checkpoint=None,
        attention=None,
        steps=None,
    ):
        calls.append(
            SimpleNamespace(
                spec=spec,
                dtype=dtype,
                device=device,
                weights=weights,
                shared_from=shared_from,
                context_window=context_window,
            )
        )
        loaded = tiny_models.get(spec, tiny_models["tiny"])
        if attention is not None:  # the set-up's last transforms (loading.transform_model)
            loaded.model.use_attention(attention)
        if steps is not None:
            loaded.model.use_steps(steps)
        return loaded

    monkeypatch.setattr(triforce_cli.decoding.pipeline, "load_model", fake_load_model)
    monkeypatch.setattr(  # no files behind the specs: none is a GGUF checkpoint
        triforce_cli.decoding.setup, "resolve_checkpoint", lambda spec, status=None: Checkpoint(spec, Path(), [])
    )
    # The embedded default's shipped drafter is not one of the tiny models: without --draft the target drafts.
    monkeypatch.setattr(triforce_cli.decoding.pipeline, "EMBEDDED_DRAFTER", Path("/nonexistent/drafter"))
    return {"models": tiny_models, "calls": calls}


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT, encoding="utf-8")
    return path


@pytest.fixture(params=KERNEL_BODIES[cpu_isa()] if kernel_error() is None else ())
def body(request):
    """Each body of the CPU kernels this CPU can run, the best one restored afterwards."""
    best = cpu_isa()
    torch.ops.triforce_cpu.use_isa(request.param)
    yield request.param
    torch.ops.triforce_cpu.use_isa(best)


# A chat template of the tiny word-level tokenizer (save_tokenizer), shaped as real ones are: an opening, each
# message and the end of its turn (w21), the generation prompt (w22)
@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    """A tiny checkpoint (128 positions) with a word-level tokenizer and CHAT_TEMPLATE."""
    folder = tmp_path_factory.mktemp("chat") / "tiny-chat"
    save_checkpoint(folder, seed=5, max_position_embeddings=128)
    tokenizer = save_tokenizer(folder, 32)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
