"""The full KV cache offloaded to host memory (offload/): the same tokens as on the device, and the copies in an
order a GPU can overlap, checked with a queue that defers every copy until something waits for it."""

import pytest
import torch
from conftest import load_tiny, make_model, random_prompt, save_word_checkpoint, small_config

from cache import FullCache
from kernels import half_weights_available
from offload import HostQueue, offload_kv
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.loading import LoadOptions

PROMPT = 64
MODES = ("autoregressive", "retrieval", "streaming", "triforce")


class DeferredQueue(HostQueue):
    """A copy stream that runs its copies, in order, only when a wait or settle needs them: what a GPU's side
    stream does at its own pace. Compute runs at once. A read of a slot before waiting for its copy, or a copy
    whose source changed before it ran, gives different numbers."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.issued = 0
        self.done = 0
        self.log: list[tuple] = []

    def record(self, stream: str):
        return (stream, self.issued)

    def wait(self, stream: str, event) -> None:
        self.log.append(("wait", stream, event))
        if stream == "compute" and event[0] == "copy":
            self._run(event[1])

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", dst.data_ptr(), src.data_ptr()))
        self.pending.append((dst, src))
        self.issued += 1

    def settle(self) -> None:
        self._run(self.issued)

    def _run(self, until: int) -> None:
        while self.done < until:
            dst, src = self.pending[self.done - (self.issued - len(self.pending))]
            dst.copy_(src)
            self.done += 1
        self.pending = self.pending[len(self.pending) - (self.issued - self.done) :]


def tiny_model():
    return make_model(seed=5, vocab_size=64, num_layers=4, initializer_range=0.3, tie_word_embeddings=False)


def loaded_model():
    return tiny_model().loaded


def streamed_model(resident_layers: int, weights: str = "dense"):
    """loaded_model()'s weights loaded as for --offload kv+weights: the layers from resident_layers on streamed."""
    options = LoadOptions(torch.device("cpu"), weights=weights, offload_weights=True, resident_layers=resident_layers)
    return load_tiny(tiny_model(), options)


def config(mode: str, sampling: SamplingConfig, **changes) -> EngineConfig:
    return small_config(mode=mode, sampling=sampling, gamma_policy="fixed", **changes)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=2)])
@pytest.mark.parametrize("on_chip_layers", [0, 1, 4])
def test_offloaded_generation_gives_the_tokens_of_the_device_cache(sampling, on_chip_layers, monkeypatch):
    monkeypatch.setattr("offload.kv.queue_for", lambda device: DeferredQueue())
    model = loaded_model()
    prompt = random_prompt(PROMPT, 64, seed=3)
    for mode in MODES:
        expected = Engine(model, config(mode, sampling)).generate(prompt).token_ids
        engine = Engine(model, config(mode, sampling, offload="kv", on_chip_layers=on_chip_layers))
        assert engine.generate(prompt).token_ids == expected, mode
        assert engine._caches.full.stream is not None


def test_each_offloaded_layer_is_fetched_once_per_forward_and_waited_for_before_it_is_read():
    model = loaded_model().model
    cfg = model.config
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    queue = DeferredQueue()
    stream = offload_kv(full, torch.device("cpu"), on_chip_layers=1, queue=queue)
    reference = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    prompt = torch.tensor(random_prompt(PROMPT, 64, seed=4))
    torch.testing.assert_close(model(prompt, 0, full), model(prompt, 0, reference))
    layer_of = {full.keys[layer, head].data_ptr(): layer for layer in range(cfg.num_layers) for head in range(2)}
    slot_of = {stream.ring_keys[slot, head].data_ptr(): slot for slot in range(2) for head in range(2)}
    for start in (PROMPT, PROMPT + 3):
        queue.log.clear()
        tokens = torch.tensor([1, 2, 3])
        torch.testing.assert_close(model(tokens, start, full), model(tokens, start, reference))
        fetched = [
            (layer_of[entry[2]], slot_of[entry[1]])
            for entry in queue.log
            if entry[0] == "copy" and entry[2] in layer_of and entry[1] in slot_of
        ]  # one copy per KV head and layer
        assert fetched == [(1, 0), (1, 0), (2, 1), (2, 1), (3, 0), (3, 0)]  # layers 1-3 once, the slots in turn
        # a deferred copy runs only when waited for: the logits above equal the reference's only if every layer
        # waited for its own copy before reading its slot, and no copy read a source changed after it was queued
    full.settle()
    held = slice(0, PROMPT + 6)
    torch.testing.assert_close(full.keys[:, :, held], reference.keys[:, :, held])
    assert stream.device_bytes == (1 + 2) * 2 * full.keys[0].nbytes


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=2)])
def test_streamed_weights_give_the_tokens_of_the_resident_model(sampling, monkeypatch):
    """--offload kv+weights: layers 1-3 of 4 stream their weights and KV cache through the deferred queue."""
    monkeypatch.setattr("offload.kv.queue_for", lambda device: DeferredQueue())
    monkeypatch.setattr("offload.weights.queue_for", lambda device: DeferredQueue())
    resident, streamed = loaded_model(), streamed_model(resident_layers=1)
    prompt = random_prompt(PROMPT, 64, seed=3)
    for mode in MODES:
        expected = Engine(resident, config(mode, sampling)).generate(prompt).token_ids
        engine = Engine(streamed, config(mode, sampling, offload="kv+weights", on_chip_layers=1))
        assert engine.generate(prompt).token_ids == expected, mode
    stream = streamed.model.weight_stream
    assert sorted(stream.host) == [1, 2, 3] and len(stream.slots) == 2
    plan = engine.memory_plan(PROMPT)
    assert plan.bytes_of("streamed weights") == 3 * stream.layer_bytes == stream.host_bytes
    assert plan.bytes_of("weight ring") == 2 * stream.layer_bytes


@pytest.mark.skipif(not half_weights_available(), reason="half weights need fbgemm")
def test_streamed_weights_must_be_dense():
    with pytest.raises(ConfigError, match="kv\\+weights: streamed weights must be dense"):
        streamed_model(resident_layers=1, weights="half")


def test_streamed_weights_run_eager_steps(tmp_path):
    with pytest.raises(ConfigError, match="kv\\+weights runs eager steps: use --no-compile"):
        Pipeline.load(
            str(save_word_checkpoint(tmp_path / "words")),
            config=EngineConfig(offload="kv+weights"),
            device="cpu",
            compile_steps=True,
        )


def test_streamed_weights_are_chosen_at_load():
    with pytest.raises(ConfigError, match="kv\\+weights needs a target loaded with its weights streamed"):
        Engine(loaded_model(), config("triforce", SamplingConfig(), offload="kv+weights"))


def test_a_restored_prompt_refills_the_on_chip_layers():
    model = loaded_model()
    prompt = random_prompt(PROMPT, 64, seed=3)
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("triforce", greedy, offload="kv", on_chip_layers=2))
    saved = []
    expected = engine.generate(prompt, on_prompt_state=saved.append).token_ids
    state: PromptState = saved[0]
    assert (
        Engine(model, config("triforce", greedy, offload="kv", on_chip_layers=2))
        .generate(prompt, prompt_state=state)
        .token_ids
        == expected
    )


def test_the_memory_plan_puts_the_full_cache_in_host_memory():
    model = loaded_model()
    on_device = Engine(model, config("triforce", SamplingConfig())).memory_plan(PROMPT)
    offloaded = Engine(model, config("triforce", SamplingConfig(), offload="kv", on_chip_layers=1)).memory_plan(PROMPT)
    full = on_device.bytes_of("full KV cache")
    assert on_device.host_bytes == 0 and offloaded.host_bytes == full > 0
    per_layer = full // model.model.config.num_layers
    assert offloaded.device_bytes == on_device.device_bytes - full + (1 + 2) * per_layer


def test_offloaded_caches_that_cannot_fit_the_host_are_one_clear_error(monkeypatch):
    import triforce_cli.decoding.engine as engine_module

    monkeypatch.setattr(engine_module, "available_memory", lambda device: 10_000 if device.type == "cpu" else None)
    engine = Engine(loaded_model(), config("triforce", SamplingConfig(), offload="kv"))
    with pytest.raises(ConfigError, match=r"on cpu, which has 9.8 KiB free"):
        engine.generate(random_prompt(PROMPT, 64, seed=3))


def test_an_unknown_offload_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown offload 'weights'"):
        EngineConfig(offload="weights")


def test_generate_prints_the_memory_plan_and_offloads_on_request(tmp_path):
    from conftest import save_word_checkpoint
    from typer.testing import CliRunner

    from triforce_cli.cli.app import app
    from triforce_cli.cli.console import NOTE_INDENT

    folder = save_word_checkpoint(tmp_path / "words")
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(f"w{i % 31}" for i in range(40)))
    runs = {}
    for offload in ("none", "kv", "kv+weights"):
        args = ["generate", "-p", str(prompt), "--target", str(folder), "--temperature", "0", "--max-new-tokens", "12"]
        result = CliRunner().invoke(app, [*args, "--offload", offload, "--on-chip-layers", "1"])
        assert result.exit_code == 0, result.output
        runs[offload] = result
    assert runs["kv"].stdout == runs["kv+weights"].stdout == runs["none"].stdout
    notes = {
        offload: result.stderr.replace("\n" + NOTE_INDENT, " ").splitlines()[0] for offload, result in runs.items()
    }
    assert "host" not in notes["none"]  # the memory note, its wrapped lines joined
    assert notes["kv"].startswith("memory: cpu ") and "full KV cache" in notes["kv"].split("host ")[1]
    assert "streamed weights" in notes["kv+weights"].split("host ")[1]  # loaded streamed: layer 1 of 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=2)])
def test_offloaded_generation_on_a_gpu_gives_the_tokens_of_the_device_cache(sampling):
    """Real CUDA streams and events, host storage in pinned memory."""
    model = loaded_model()
    model.model.to("cuda")
    prompt = random_prompt(PROMPT, 64, seed=3)
    for mode in MODES:
        expected = Engine(model, config(mode, sampling)).generate(prompt).token_ids
        engine = Engine(model, config(mode, sampling, offload="kv", on_chip_layers=1))
        assert engine.generate(prompt).token_ids == expected, mode
        assert engine._caches.full.keys.is_pinned()
