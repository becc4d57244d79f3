"""Fixed-shape decode steps recorded once per cache and padded length (runtime/graphs.py), on the CPU.

On the CPU a StepGraphs runs the step eagerly on its static buffers instead of capturing a CUDA graph, and counts
the graphs it would have captured: these tests exercise every part but the capture. They check that the warm-up
before a prefill records only the lengths decoding takes, at each cache's current length, so that a prefix kept from
the last prefill (a chat's document, a --prompt-cache hit) is still there for the prefill after it.
"""

import pytest
import torch
from helpers import full_cache_for, make_model, random_prompt, small_config
from triforce_cli.kernels.attention import SPLIT_SLOTS, slot_splits

from triforce_cli.decoding.chat import ChatSession
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.runtime.forms import StepMode

GREEDY = SamplingConfig(temperature=0)
DOCUMENT = " ".join(f"w{i % 19}" for i in range(120))
QUESTIONS = ("w5 w6", "w7 w8 w9")
STEP_MODES = [StepMode.GRAPHS, StepMode.COMPILED]


def use_steps(pipe: Pipeline, mode: StepMode) -> None:
    """Have the pipeline's models run mode's steps ('compiled' by aot_eager: the same graphs, without codegen)."""
    for loaded in (pipe.target, pipe.drafter):
        if loaded is not None:
            loaded.model.use_steps(mode, backend="aot_eager")


@pytest.fixture
def chat_pipes(tiny):
    """Two pipelines of the tiny chat model (triforce, greedy, prefill chunks of 32, so that a document of several
    chunks keeps some for the next prompt): the first stays eager."""
    config = small_config(max_new_tokens=12, sampling=GREEDY, prefill_block=32)
    return [Pipeline.load(LoadOptions(target="chat"), config=config) for _ in range(2)]


@pytest.mark.parametrize("mode", STEP_MODES)
def test_a_chat_keeps_its_document_through_the_warm_up(chat_pipes, mode):
    """A chat prefills its document, then each question keeps the document's whole prefill chunks: the warm-up
    before the first question records its steps past the kept positions, and the answers are the eager ones."""
    eager, fixed = chat_pipes
    use_steps(fixed, mode)
    expected = ChatSession(eager, DOCUMENT)
    expected.prefill()
    session = ChatSession(fixed, DOCUMENT)
    session.prefill()
    for question in QUESTIONS:
        answer = session.ask(question)
        assert answer.stats.reused_tokens > 0
        assert answer.token_ids == expected.ask(question).token_ids, question
    assert fixed.target.model.step_graphs.captured > 0


@pytest.mark.parametrize("mode", STEP_MODES)
def test_a_restored_prefill_is_kept_through_the_warm_up(chat_pipes, mode, tmp_path):
    """A --prompt-cache hit restores the document, and the first question keeps it: its answer is the eager one."""
    eager, fixed = chat_pipes
    use_steps(fixed, mode)
    saving = ChatSession(eager, DOCUMENT)
    assert saving.prefill(prompt_cache=tmp_path) is False
    expected = saving.ask(QUESTIONS[0])
    restoring = ChatSession(fixed, DOCUMENT)
    assert restoring.prefill(prompt_cache=tmp_path) is True
    answer = restoring.ask(QUESTIONS[0])
    assert answer.stats.reused_tokens > 0
    assert answer.token_ids == expected.token_ids


def graphs_before_the_first_token(config: EngineConfig, drafter: bool) -> tuple[int, list[int]]:
    """The steps recorded before a generation's first token, over target and drafter, and the padded lengths
    recorded on the drafter's cache by then."""
    target = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    draft = make_model(seed=6, vocab_size=64, num_layers=1, tie_word_embeddings=False).loaded if drafter else None
    models = [loaded.model for loaded in (target, draft) if loaded is not None]
    for model in models:
        model.use_steps(StepMode.GRAPHS)
    engine = Engine(target, config, draft)
    counted: list[tuple[int, list[int]]] = []

    def on_tokens(ids, tiers):
        if not counted:
            streaming = engine._caches.streaming
            lengths = [] if streaming is None else engine._drafter_model.step_graphs.lengths(streaming)
            counted.append((sum(model.step_graphs.captured for model in models), lengths))

    engine.generate(random_prompt(64, 64, seed=3), on_tokens=on_tokens)
    return counted[0]


def test_the_warm_up_records_only_the_lengths_decoding_takes():
    """Before the first token: the full tier's padded lengths up to gamma2 + 1 (1, 2, 4, 8), the retrieval tier's up
    to gamma1 + 1 (1, 2, 4) and the drafter's up to its last token and the bonus tokens of the two tiers above it
    (1, 2, 4), not every length up to its prefill chunk; autoregressive decoding records its one step."""
    settings = {"budget": 32, "chunk_size": 8, "draft_window": 24, "sink_tokens": 4, "max_new_tokens": 16}
    triforce = EngineConfig(mode="triforce", sampling=GREEDY, ngram=False, **settings)
    assert (triforce.gamma1, triforce.gamma2) == (2, 6)  # the defaults
    assert graphs_before_the_first_token(triforce, drafter=True) == (10, [1, 2, 4])
    autoregressive = EngineConfig(mode="autoregressive", sampling=GREEDY, **settings)
    assert graphs_before_the_first_token(autoregressive, drafter=False) == (1, [])


@pytest.mark.parametrize("mode", ["autoregressive", "retrieval", "streaming", "triforce"])
def test_recorded_steps_generate_the_eager_tokens(mode):
    """Greedy: recorded steps (StepMode graphs, the step run on its static buffers) give the eager tokens, the
    drafter's catch-up writes longer than its recorded steps running eager; a length first needed after the
    warm-up (a longer verification) is recorded then."""
    eager = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    fixed = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    fixed.model.use_steps(StepMode.GRAPHS)
    assert fixed.model.step_mode == StepMode.GRAPHS and eager.model.step_mode == StepMode.EAGER
    prompt = random_prompt(64, 64, seed=3)
    config = small_config(mode=mode, sampling=GREEDY)
    engine = Engine(fixed, config)
    assert engine.generate(prompt).token_ids == Engine(eager, config).generate(prompt).token_ids
    full = engine._caches.full
    assert fixed.model.step_graphs.lengths(full)  # the full tier's steps were recorded


def test_a_step_longer_than_any_recorded_is_recorded_on_first_use():
    """A full-cache step of a padded length the warm-up did not record is recorded when first taken, once."""
    model = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3).loaded.model
    model.use_steps(StepMode.GRAPHS)
    cfg = model.config
    eager, fixed = full_cache_for(model), full_cache_for(model)
    fixed.make_static(cfg.num_heads, 128, torch.float32)
    prompt = torch.arange(16) % cfg.vocab_size
    model(prompt, 0, eager, decoding=False)
    model(prompt, 0, fixed, decoding=False)
    for start, count in ((16, 5), (21, 7), (28, 3)):  # padded 8, 8, 4
        tokens = torch.arange(count) % cfg.vocab_size
        expected = model(tokens, start, eager, num_logits=count)
        torch.testing.assert_close(model(tokens, start, fixed, num_logits=count), expected, rtol=1e-5, atol=1e-5)
    assert model.step_graphs.lengths(fixed) == [4, 8] and model.step_graphs.captured == 2


def test_a_fixed_shape_full_cache_splits_its_value_product_over_its_slots():
    """With fixed-shape steps the full cache holds a multiple of SPLIT_SLOTS slots, so attention_in_cache splits the
    value product into parts of SPLIT_SLOTS (on a GPU: that many times the thread blocks of one product over every
    slot); the eager engine's cache holds exactly what the generation needs."""
    loaded = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    prompt = random_prompt(300, 64, seed=3)
    eager = Engine(loaded, small_config(sampling=GREEDY))
    eager.generate(prompt)
    loaded.model.use_steps(StepMode.GRAPHS)
    fixed = Engine(loaded, small_config(sampling=GREEDY))
    fixed.generate(prompt)
    needed, slots = eager._caches.full.capacity, fixed._caches.full.capacity
    assert needed % SPLIT_SLOTS and slots % SPLIT_SLOTS == 0 and needed < slots < needed + 2 * SPLIT_SLOTS
    assert slot_splits(slots) == slots // SPLIT_SLOTS > 1 == slot_splits(needed)
