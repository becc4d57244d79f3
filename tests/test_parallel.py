"""Tensor parallelism over torch.distributed: two gloo processes on the CPU give exactly the tokens of one."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import full_cache_for, make_model, random_prompt, save_word_checkpoint, small_config

from triforce_cli.decoding.config import MODES
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.model import MAX_STEP_TOKENS
from triforce_cli.runtime.parallel import apply_tp

PROMPT = 64
SAMPLINGS = {"greedy": SamplingConfig(temperature=0), "seeded": SamplingConfig(temperature=0.8, seed=2)}
OFFLOADS = ("none", "kv")


def tiny():
    # 4 query heads, 2 KV heads, 48 MLP rows: all divide by 2
    return make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded


def generations(loaded) -> dict[str, list[int]]:
    prompt = random_prompt(PROMPT, 64, seed=3)
    out = {}
    for mode in MODES:
        for name, sampling in SAMPLINGS.items():
            for offload in OFFLOADS:
                config = small_config(mode=mode, sampling=sampling, offload=offload, gamma_policy="heuristic")
                out[f"{mode}/{name}/{offload}"] = Engine(loaded, config, drafter=loaded).generate(prompt).token_ids
    return out


def worker(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        loaded = tiny()
        apply_tp(loaded.model)
        assert loaded.model.config.num_kv_heads == 1 and loaded.model.model.layers[0].self_attn.num_heads == 2
        with open(f"{folder}/rank{rank}.json", "w") as file:
            json.dump(generations(loaded), file)
    finally:
        dist.destroy_process_group()


def test_two_processes_generate_the_tokens_of_one(tmp_path):
    """Every mode, greedy and seeded sampling, with and without the full cache offloaded: each rank holds half the
    heads and half the MLP, and both give the single process's tokens."""
    expected = generations(tiny())
    mp.spawn(worker, args=(2, str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank


def mismatched(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        loaded = make_model(seed=5, vocab_size=64, hidden_size=48, num_heads=3, num_kv_heads=3).loaded
        with pytest.raises(ConfigError, match="3 KV heads, 3 query heads and 48 MLP rows must all divide by the 2"):
            apply_tp(loaded.model)
    finally:
        dist.destroy_process_group()


def test_heads_that_do_not_divide_by_the_world_size_are_a_clear_error(tmp_path):
    mp.spawn(mismatched, args=(2, str(tmp_path)), nprocs=2)


def test_torchrun_runs_generate_and_only_rank_0_prints(tmp_path):
    """docs/commands.md's command shape: torchrun --nproc-per-node 2 -m triforce_cli generate."""
    folder = save_word_checkpoint(tmp_path / "words")
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(f"w{i % 31}" for i in range(40)))
    args = ["generate", "-p", str(prompt), "--target", str(folder), "--temperature", "0", "--max-new-tokens", "12"]
    args += ["--json", "--no-ngram", "--gamma-policy", "heuristic"]
    single = subprocess.run([sys.executable, "-m", "triforce_cli", *args], capture_output=True, text=True, check=True)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parallel = subprocess.run(
        [*launch, "-m", "triforce_cli", *args], capture_output=True, text=True, env=env, check=False
    )
    assert parallel.returncode == 0, parallel.stderr[-2000:]
    lines = [line for line in parallel.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 1 printed nothing
    assert json.loads(lines[0])["token_ids"] == json.loads(single.stdout)["token_ids"]
    assert torch.distributed.is_available()


def spawn_within(target, args: tuple, seconds: float) -> None:
    """Run target(rank, *args) on two processes; fail where they have not all ended within seconds (a rank left
    waiting in a collective that another never runs) or where one raised."""
    context = mp.spawn(target, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):  # False until every rank has ended
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("a rank waited in a collective: the ranks decided apart")


def disagreeing(rank: int, world: int, folder: str) -> None:
    """Rank 1 computes distributions that differ from rank 0's (far more than the rounding of another summation
    order does), so left to itself it would draw and accept other tokens."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        if rank == 1:
            from triforce_cli.decoding import engine, speculative

            def skewed(logits, cfg, real=speculative.probabilities):
                probs = real(logits, cfg)
                flipped = probs.flip(-1)
                return flipped / flipped.sum(dim=-1, keepdim=True)

            speculative.probabilities = engine.probabilities = skewed
        loaded = tiny()
        apply_tp(loaded.model)
        prompt = random_prompt(PROMPT, 64, seed=3)
        tokens = {}
        for mode in MODES:
            config = small_config(mode=mode, sampling=SAMPLINGS["seeded"], gamma_policy="heuristic")
            tokens[mode] = Engine(loaded, config, drafter=loaded).generate(prompt).token_ids
        with open(f"{folder}/rank{rank}.json", "w") as file:
            json.dump(tokens, file)
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_zeros_tokens_even_where_its_own_distributions_differ(tmp_path):
    """Rank 0's sampled tokens and verification outcomes are every rank's: a rank whose distributions differ still
    emits rank 0's tokens (the single process's) and never hangs in a collective of another shape."""
    prompt = random_prompt(PROMPT, 64, seed=3)
    expected = {
        mode: Engine(
            tiny(), small_config(mode=mode, sampling=SAMPLINGS["seeded"], gamma_policy="heuristic"), drafter=tiny()
        )
        .generate(prompt)
        .token_ids
        for mode in MODES
    }
    spawn_within(disagreeing, (2, str(tmp_path)), 300)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank


def short_of_memory(rank: int, world: int, folder: str, free: list, offload: str, allocate_first: bool) -> None:
    """Rank r reads free[r] bytes free on every device (None: the system does not say); its outcome (tokens, or
    the ConfigError's message) goes to rank{r}.json. allocate_first: build the caches before the readings change,
    so that only the prefill reads them."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        from triforce_cli.decoding import prefill, sizing

        loaded = tiny()
        apply_tp(loaded.model)
        config = small_config(mode="triforce", sampling=SAMPLINGS["greedy"], offload=offload, prefill_block=16)
        engine = Engine(loaded, config, drafter=loaded)
        prompt = random_prompt(PROMPT, 64, seed=3)
        if allocate_first:
            engine._allocate(len(prompt))
        prefill.available_memory = sizing.available_memory = lambda device: free[rank]  # prefill, memory check
        try:
            outcome = {"tokens": engine.generate(prompt).token_ids}
        except ConfigError as error:
            outcome = {"error": str(error)}
        with open(f"{folder}/rank{rank}.json", "w") as file:
            json.dump(outcome, file)
    finally:
        dist.destroy_process_group()


def test_a_rank_short_of_memory_makes_every_rank_refuse_with_the_same_error(tmp_path):
    """Rank 1's device has room for none of the caches, rank 0's for all: both refuse, with the least free memory
    in the message, where rank 0 alone would go on and wait in the prefill's all-reduces forever."""
    spawn_within(short_of_memory, (2, str(tmp_path), [None, 1000], "none", False), 300)
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert outcomes[0] == outcomes[1]
    assert "on cpu, which has 1000 B free" in outcomes[0]["error"]


def test_a_rank_short_of_memory_makes_every_rank_prefill_in_its_segments(tmp_path):
    """The full cache offloaded, rank 1 has room for the hidden states of 32 prompt tokens, rank 0 for all 64:
    both prefill in two segments of 32 (the same all-reduces) and give the single process's tokens."""
    config = small_config(mode="triforce", sampling=SAMPLINGS["greedy"], offload="kv", prefill_block=16)
    expected = Engine(tiny(), config, drafter=tiny()).generate(random_prompt(PROMPT, 64, seed=3)).token_ids
    room = 2 * tiny().model.prefill_layerwise_bytes(32)  # the prefill takes half the free memory
    spawn_within(short_of_memory, (2, str(tmp_path), [None, room], "kv", True), 300)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"tokens": expected}, rank


def compiled_steps(rank: int, world: int, folder: str) -> None:
    """Rank r's sharded model with decode steps compiled by aot_eager, fullgraph=True: one decode step's logits
    against the eager sharded step's, and TriForce's greedy tokens (every cache kind's steps), to rank{r}.json."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        loaded = tiny()
        apply_tp(loaded.model)
        model = loaded.model
        graphs = []

        def backend(graph, inputs):
            graphs.append(graph)
            return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)

        model.compile_steps(backend=backend)  # fullgraph=True
        prompt = torch.tensor(random_prompt(PROMPT, 64, seed=3))
        eager, fixed = full_cache_for(model), full_cache_for(model)
        for cache in (eager, fixed):
            model(prompt, 0, cache, decoding=False)
        fixed.make_static(model.config.num_heads, MAX_STEP_TOKENS, torch.float32)
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            tokens = torch.randint(0, model.config.vocab_size, (7,), generator=generator)
            start = eager.length
            expected = model(tokens, start, eager, num_logits=7)
            got = model(tokens, start, fixed, num_logits=7)
            assert fixed.static_step and not eager.static_step
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert len(graphs) == 1  # one graph for the three positions, and no break
        reduces = [node for node in graphs[0].graph.nodes if str(node.target) == "_c10d_functional.all_reduce"]
        assert len(reduces) == 2 * model.config.num_layers  # the attention's and the MLP's, traced in the graph
        engine = Engine(loaded, small_config(mode="triforce", sampling=SAMPLINGS["greedy"]), drafter=loaded)
        assert engine.compiled
        with open(f"{folder}/rank{rank}.json", "w") as file:
            json.dump(engine.generate(random_prompt(PROMPT, 64, seed=3)).token_ids, file)
    finally:
        dist.destroy_process_group()


def test_sharded_decode_steps_compile_into_one_graph_and_give_the_eager_tokens(tmp_path):
    """A sharded decode step traces its all-reduces (functional collectives) into one graph, fullgraph=True, as
    CUDA-graph capture on NCCL needs: the eager sharded step's logits, and the single process's greedy tokens."""
    config = small_config(mode="triforce", sampling=SAMPLINGS["greedy"])
    expected = Engine(tiny(), config, drafter=tiny()).generate(random_prompt(PROMPT, 64, seed=3)).token_ids
    spawn_within(compiled_steps, (2, str(tmp_path)), 600)  # compiling is slow on a busy CPU
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank
