"""The engine allocates its caches once and keeps them across prompts (decoding/cache_pool.py, sizes from sizing.py).

- Compiled steps compile once per padded length and cache kind for any number of prompts, before the first prefill
  (compile_seconds), and the caches are built once, with the greedy tokens of eager steps.
- A longer prompt grows the full cache, the old one released before the new one is allocated, and the memory
  check asks for exactly what growing adds.
- A retrieval cache built for a large budget serves a smaller one, with the tokens of a cache built for it.
- Engines made from one another (Pipeline.reconfigure, bench runs) share the caches.
"""

import gc
import weakref
from collections import Counter

import pytest
from helpers import make_model, random_prompt, small_config
from torch._dynamo.testing import CompileCounterWithBackend
from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache

from triforce_cli.decoding import sizing
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import ConfigError

GREEDY = SamplingConfig(temperature=0)
NEW_TOKENS = 24  # small_config's
CACHE_CLASSES = (FullCache, RetrievalCache, StreamingCache)


def model(seed: int = 5):
    return make_model(seed=seed, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded


@pytest.fixture
def built(monkeypatch) -> Counter:
    """Caches constructed from now on, by class name."""
    counts = Counter()
    for cls in CACHE_CLASSES:

        def counting(self, *args, _init=cls.__init__, _name=cls.__name__, **kwargs):
            counts[_name] += 1
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    return counts


@pytest.mark.parametrize(
    ("lengths", "cache_positions"),
    [
        pytest.param((48, 96, 72), 96 + NEW_TOKENS, id="cache_positions"),
        pytest.param((96, 72, 48), None, id="sized-to-the-first-prompt"),
    ],
)
def test_three_prompts_compile_each_step_once_and_allocate_the_caches_once(lengths, cache_positions, built):
    """TriForce with the target drafting itself: the full, retrieval and StreamingLLM caches, each with compiled
    steps. Three prompts of different lengths (and so different retrieval budgets) through one engine: one cache of
    each kind is built, every (cache, padded length) step compiles once, all of them before the first prompt's
    prefill, and the greedy tokens are the eager engine's."""
    config = small_config(sampling=GREEDY, budget=None, ngram=False, cache_positions=cache_positions)
    prompts = [random_prompt(length, 64, seed=length) for length in lengths]
    eager = Engine(model(), config)
    expected = [eager.generate(prompt).token_ids for prompt in prompts]
    built.clear()
    compiled = model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled.model.compile_steps(backend=counter)
    steps = set()  # (cache class, padded length) of every compiled step run
    compiled_step = compiled.model.fixed_step

    def recording(tokens, positions, cache):
        steps.add((type(cache).__name__, tokens.shape[0]))
        return compiled_step(tokens, positions, cache)

    compiled.model.fixed_step = recording
    engine = Engine(compiled, config)
    results = [engine.generate(prompt) for prompt in prompts]
    assert [result.token_ids for result in results] == expected
    assert built == {"FullCache": 1, "RetrievalCache": 1, "StreamingCache": 1}
    assert {kind for kind, _ in steps} == {"FullCache", "RetrievalCache", "StreamingCache"}
    assert counter.frame_count == len(steps)  # each step compiled once, whatever the prompt
    first, *later = [result.stats.compile_seconds for result in results]
    assert first > 0 and later == [0.0, 0.0]


def test_a_longer_prompt_grows_the_full_cache_after_releasing_the_old_one(built, monkeypatch):
    """Sized to the first prompt: a longer one builds a larger full cache (and the retrieval cache reading it) only
    once the old ones are gone; a shorter one after it keeps them, and the StreamingLLM cache is built once."""
    alive = []  # per FullCache built: whether an earlier one was still alive then
    earlier = []
    init = FullCache.__init__

    def watched(self, *args, **kwargs):
        gc.collect()
        alive.append(any(ref() is not None for ref in earlier))
        init(self, *args, **kwargs)
        earlier.append(weakref.ref(self))

    monkeypatch.setattr(FullCache, "__init__", watched)
    engine = Engine(model(), small_config(sampling=GREEDY), drafter=model(seed=6))
    capacities = []
    for length in (64, 96, 80):
        engine.generate(random_prompt(length, 64, seed=length))
        capacities.append(engine._caches.full.capacity)
    assert capacities[0] < capacities[1] == capacities[2]
    assert alive == [False, False]
    assert built == {"FullCache": 2, "RetrievalCache": 2, "StreamingCache": 1}


def cache_tensor_bytes(engine: Engine) -> int:
    """Bytes of the full and retrieval caches' tensors the engine holds."""
    caches = engine._caches
    tensors = (caches.full.keys, caches.full.values, caches.retrieval.keys, caches.retrieval.values)
    return sum(t.nbytes for t in (*tensors, caches.retrieval.chunk_keys))


def test_the_memory_check_asks_for_what_growing_adds(monkeypatch):
    """Growing from a 64- to a 96-token prompt needs the new full and retrieval caches less the old ones, which are
    released first; the kept StreamingLLM cache needs nothing. One byte less free is an error that keeps the old
    caches."""
    config = small_config(sampling=GREEDY)
    target, drafter = model(), model(seed=6)
    longer = Engine(target, config, drafter=drafter)
    longer.generate(random_prompt(96, 64, seed=2))
    engines = [Engine(target, config, drafter=drafter) for _ in range(2)]
    for engine in engines:
        engine.generate(random_prompt(64, 64, seed=1))
    needed = cache_tensor_bytes(longer) - cache_tensor_bytes(engines[0])
    for engine, free in zip(engines, (needed, needed - 1), strict=True):
        monkeypatch.setattr(sizing, "available_memory", lambda device, free=free: free)
        old = engine._caches.full
        if free == needed:
            engine.generate(random_prompt(96, 64, seed=2))
            assert engine._caches.full is not old
        else:
            with pytest.raises(ConfigError, match=r"on cpu, which has .* free"):
                engine.generate(random_prompt(96, 64, seed=2))
            assert engine._caches.full is old


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, seed=4)])
def test_a_smaller_budget_in_a_larger_retrieval_cache_gives_the_tokens_of_its_own(sampling):
    """An engine sized for 200 positions holds a retrieval cache for a 176-token budget (the longest prompt's whole
    chunks); a 64-token prompt uses a 64-token budget in it and samples what an engine sized to that prompt does."""
    config = small_config(sampling=sampling, budget=None, gamma_policy="fixed", cache_positions=200)
    target = model()
    engine = Engine(target, config, drafter=model(seed=6))
    prompts = [random_prompt(length, 64, seed=length) for length in (96, 64)]
    got = [engine.generate(prompt).token_ids for prompt in prompts]
    assert engine._caches.retrieval.keys.shape[2] - engine._caches.retrieval.recent_capacity == 176
    assert engine._caches.retrieval.budget == 64
    one_shot = small_config(sampling=sampling, budget=None, gamma_policy="fixed")
    assert got == [Engine(target, one_shot, drafter=model(seed=6)).generate(prompt).token_ids for prompt in prompts]


def test_engines_made_from_one_another_share_the_caches(built):
    """Every mode through engines made with Engine.reconfigured, as bench runs are: one full cache for all of them,
    a retrieval cache kept for modes without one, and each mode's tokens those of an engine of its own."""
    target = model()
    prompt = random_prompt(64, 64, seed=3)
    first = Engine(target, small_config(sampling=GREEDY, mode="triforce", ngram=False))
    expected = {}
    for mode in ("autoregressive", "retrieval", "streaming", "triforce"):
        expected[mode] = Engine(target, small_config(sampling=GREEDY, mode=mode, ngram=False)).generate(prompt)
    built.clear()
    for mode in ("triforce", "autoregressive", "streaming", "retrieval"):
        engine = first.reconfigured(small_config(sampling=GREEDY, mode=mode, ngram=False), None)
        assert engine.generate(prompt).token_ids == expected[mode].token_ids, mode
        assert engine._caches is first._caches
    assert built == {"FullCache": 1, "RetrievalCache": 1, "StreamingCache": 1}
