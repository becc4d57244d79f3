"""The engine's generation path (decoding/engine.py) and the road to it: each step of the way done once.

- One generation sizes its caches with one memory plan (sizing.memory_plan: the memory check and the allocation
  share it), and a second generation on the same caches with none; `triforce generate` checks its prompt
  (sizing.check_prompt) and plans its memory once, though it prints the plan before the generation.
- Pipeline.load reads the target's checkpoint once: the set-up that decides on it (setup.choose_setup) hands it to
  load_model; and it resolves the set-up once (setup.resolve_setup), for a dense folder, a GGUF file and a load the
  measured fastest configuration chooses; and one function applies it to each model (loading.transform_model).
- A prefill saved in a prompt cache is restored, else prefilled and saved (pipeline.prefill_or_restore), the one
  path of a chat's document and a benchmark's prompt.
- The steps of a generation: allocate, prefill every cache, then rounds of the top tier; greedy output equals plain
  greedy decoding (the never/always/sometimes-accepted drafts live in test_speculative.py).
"""

import sys

import pytest
import torch
from helpers import make_model, random_prompt, save_checkpoint, small_config, write_gguf_model
from typer.testing import CliRunner

from triforce_cli.cli.app import app
from triforce_cli.decoding import setup, sizing, tuning
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline, prefill_or_restore
from triforce_cli.decoding.prompt_state import PromptCache
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.runtime import loading

GREEDY = SamplingConfig(temperature=0)
PROMPT = 64


def counted(monkeypatch, function) -> list:
    """Count the calls of function, wherever a module of the package holds it by name; the list of their args."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("triforce_cli") and getattr(module, function.__name__, None) is function:
            monkeypatch.setattr(module, function.__name__, counting)
    return calls


@pytest.fixture(scope="module")
def target():
    return make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded


def test_a_generation_sizes_its_caches_with_one_memory_plan(target, monkeypatch):
    """The memory check and the allocation of one generation share one memory plan; the next generation, which
    keeps the caches, makes none."""
    plans = counted(monkeypatch, sizing.cache_items)
    engine = Engine(target, small_config(mode="triforce", sampling=GREEDY))
    engine.generate(random_prompt(PROMPT, 64, seed=1))
    assert len(plans) == 1
    engine.generate(random_prompt(PROMPT, 64, seed=2))
    assert len(plans) == 1


@pytest.mark.parametrize("output", [[], ["--json"]])
def test_a_generate_checks_its_prompt_and_plans_its_memory_once(output, tiny, prompt_file, monkeypatch):
    """The command checks the prompt and prints the memory plan before generating; the generation then takes both
    from there instead of making them again."""
    checks = counted(monkeypatch, sizing.check_prompt)
    plans = counted(monkeypatch, sizing.memory_plan)
    command = ["generate", "-p", str(prompt_file), "--max-new-tokens", "4", "--temperature", "0", *output]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert len(checks) == 1 and len(plans) == 1


def test_loading_reads_the_checkpoint_once(tmp_path, monkeypatch):
    """On the CPU in float32 the checkpoint decides the weight form (a GGUF file may become gguf weights): the
    set-up reads it, and the loader takes it from there instead of resolving it again."""
    save_checkpoint(tmp_path, vocab_size=64, num_layers=1)
    resolved = counted(monkeypatch, loading.resolve_checkpoint)
    pipe = Pipeline.load(LoadOptions(target=str(tmp_path), draft="self", device="cpu"), small_config())
    assert len(resolved) == 1 and pipe.target.source == str(tmp_path)


def measured(checkpoint, choice: tuning.Choice) -> tuning.Tuning:
    """A kept measurement that chose choice, taken on a quiet machine."""
    paths = tuning.checkpoint_paths(checkpoint)
    return tuning.Tuning(checkpoint.name, "cpu", choice, {}, "now", "machine", paths, None, 0.0, 0.0, [1.0])


@pytest.mark.parametrize("source", ["dense folder", pytest.param("gguf file", marks=pytest.mark.embedded), "tuned"])
def test_loading_resolves_the_set_up_once(source, tmp_path, monkeypatch):
    """Whatever the set-up reads on the way (the checkpoint, a GGUF file's kernels, the measured fastest
    configuration), it is resolved once, from all of it; the models load as it says."""
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(tuning.TUNING_ENV, raising=False)
    if source == "gguf file":
        target = tmp_path / "tiny.gguf"
        write_gguf_model(target, lambda name: "Q8_0", layers=1, hidden=64, ffn=128)
    else:
        target = tmp_path / "tiny"
        save_checkpoint(target, vocab_size=64, num_layers=1)
    choice = tuning.Choice("dense", threads=1)
    monkeypatch.setattr(tuning, "measure", lambda spec, checkpoint: measured(checkpoint, choice))
    threads = torch.get_num_threads()
    resolved = counted(monkeypatch, setup.resolve_setup)
    options = LoadOptions(target=str(target), draft="self", device="cpu", tune=source == "tuned")
    try:
        pipe = Pipeline.load(options, small_config())
    finally:
        torch.set_num_threads(threads)
    assert len(resolved) == 1
    expected = {"dense folder": pipe.target.weights, "gguf file": "gguf", "tuned": "dense"}[source]
    assert pipe.target.weights == expected and (pipe.tuning is not None) == (source == "tuned")


def test_loading_applies_the_set_up_in_one_place(tmp_path, monkeypatch):
    """Each model the load makes is transformed once, by one function (loading.transform_model), into every choice
    of the Setup: its attention kernels and step mode too."""
    save_checkpoint(tmp_path, vocab_size=64, num_layers=1)
    transformed = counted(monkeypatch, loading.transform_model)
    options = LoadOptions(target=str(tmp_path), draft=str(tmp_path), device="cpu", attention="sdpa", steps="graphs")
    pipe = Pipeline.load(options, small_config(mode="triforce"))
    assert len(transformed) == 2  # the target, then the drafter
    for loaded in (pipe.target, pipe.drafter):
        assert (loaded.model.attention_backend, loaded.model.step_mode) == ("sdpa", "graphs")


def test_a_saved_prefill_is_restored_else_prefilled_and_saved(target, tmp_path):
    """A miss prefills and saves; a hit restores the saved state, which the next prompt starting with its ids
    keeps (prefix reuse), or hands it back unrestored for generate(prompt_state=...)."""
    config = small_config(mode="autoregressive", sampling=GREEDY, prefill_block=16, cache_positions=256)
    engine = Engine(target, config)
    cache = PromptCache(tmp_path, target, prefill_chunk=16, new_tokens=config.max_new_tokens)
    prompt = random_prompt(PROMPT, 64, seed=3)
    state, restored = prefill_or_restore(engine, prompt, cache)
    assert not restored and state is not None and cache.load(prompt) is not None
    fresh = Engine(target, config)
    saved, restored = prefill_or_restore(fresh, prompt, cache, restore=False)
    assert restored and torch.equal(saved.keys, state.keys) and fresh._caches.holds is None
    _, restored = prefill_or_restore(fresh, prompt, cache)
    assert restored and fresh._caches.holds.ids == prompt
    longer = [*prompt, *random_prompt(8, 64, seed=4)]
    assert fresh.generate(longer).stats.reused_tokens == PROMPT
    assert prefill_or_restore(Engine(target, config), prompt) == (None, False)  # no cache: nothing copied


@pytest.mark.parametrize("mode", ["autoregressive", "retrieval", "triforce"])
def test_the_steps_of_a_generation_give_plain_greedy_decoding(target, mode):
    """Allocate, prefill every cache, then rounds of the top tier: the greedy tokens are plain greedy decoding's,
    and the caches the generation used are the engine's (kept for the next one)."""
    prompt = random_prompt(PROMPT, 64, seed=5)
    expected = Engine(target, small_config(mode="autoregressive", sampling=GREEDY)).generate(prompt)
    engine = Engine(target, small_config(mode=mode, sampling=GREEDY))
    result = engine.generate(prompt)
    assert result.token_ids == expected.token_ids
    caches = engine._caches
    assert caches.full is not None and (caches.retrieval is not None) == (mode != "autoregressive")
    assert caches.holds.ids == prompt + result.token_ids
