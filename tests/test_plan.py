"""`triforce plan`: the memory it predicts is what the engine allocates, offloading moves the full KV cache to the
host, latency behaves as the cost model says, and every input ends in a table, a JSON object or one `error:` line.

The this-cpu measurement is replaced by fixed figures in every test (no timing here)."""

import json
from dataclasses import replace
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from helpers import StubTokenizer
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
from triforce_cli.cache import FullCache, kv_dtype
from triforce_cli.kernels.attention import SPLIT_SLOTS
from typer.testing import CliRunner

import triforce_cli.plan.measure
from triforce_cli.cli.app import app
from triforce_cli.decoding.config import MODE_TIERS, MODES, PREFILL_BLOCK, EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sizing import RING_LAYERS
from triforce_cli.decoding.stats import as_record
from triforce_cli.plan import DEFAULT_ACCEPTANCE, EMBEDDED_PRESET, MODELS, Acceptance, Hardware, Workload, plan
from triforce_cli.plan.model import GPU_ITEMS, ModelShape
from triforce_cli.plan.presets import GIB, HARDWARE, HARDWARE_CHOICES, SMOLLM2_135M, SMOLLM2_135M_DRAFTER, hardware_name
from triforce_cli.runtime.embedded import EMBEDDED_DRAFTER
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import MAX_STEP_TOKENS, ModelConfig, Transformer
from triforce_cli.runtime.native import kernel_error

FAKE_CPU = Hardware(
    name="this-cpu",
    memory_bytes=16 * GIB,
    bandwidth=20e9,
    pcie=20e9,
    flops=100e9,
    layer_overhead_s=100e-6,
    measured=True,
    gpu=False,
)
ROW_KEYS = {"mode", "offload", "ms_per_token", "device_bytes", "host_bytes", "fits", "on_chip_layers"}
DEFAULTS = EngineConfig()


@pytest.fixture(autouse=True)
def no_timing(monkeypatch):
    monkeypatch.setattr(triforce_cli.plan.measure, "measure_this_cpu", lambda: FAKE_CPU)


def invoke(*args: str):
    return CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "80"})


def plan_json(*args: str) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def row(payload: dict, mode: str, offload: str) -> dict:
    return next(r for r in payload["rows"] if (r["mode"], r["offload"]) == (mode, offload))


def predict(model: str, hardware: Hardware, context: int, acceptance=DEFAULT_ACCEPTANCE, **engine):
    preset = MODELS[model]
    workload = Workload(context=context, engine=EngineConfig(**engine), acceptance=acceptance, dtype_bytes=2)
    return plan(target=preset.target, drafter=preset.drafter, hardware=hardware, workload=workload)


def kv_bytes(shape: ModelShape, positions: int, size: int = 2) -> int:
    """Keys and values of every layer, by hand."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * positions * size


class TestJson:
    def test_a_row_per_mode_and_offload_with_the_keys(self):
        payload = plan_json("--model", "Llama-3.1-8B", "--hardware", "rtx-4090", "--context", "128k")
        assert payload["prediction"] is True
        assert {(r["mode"], r["offload"]) for r in payload["rows"]} == {(m, o) for m in MODES for o in ("none", "kv")}
        assert len(payload["rows"]) == 2 * len(MODES)
        for r in payload["rows"]:
            assert ROW_KEYS <= set(r) and r["ms_per_token"] > 0
        assert {"mode", "offload", "budget", "gamma1", "gamma2", "on_chip_layers"} <= set(payload["recommendation"])

    def test_offload_kv_moves_the_full_kv_cache_to_the_host_less_the_on_chip_layers(self):
        """The device's tensors (GPU_ITEMS aside) drop by the full KV cache, less the layers kept on chip and the
        two-layer ring an offloaded forward stages the others in, and plus the tail of 256 positions not yet written
        back (the steps' query buffer stays on the device: offloaded, they are graphed too); the host holds the whole cache, the
        tail's pinned twin and, where the retrieval tier runs, the staging buffer its selection gathers every layer's
        chosen chunks into before one upload (budget 1,024 at 128K)."""
        target = MODELS["Llama-3.1-8B"].target
        payload = plan_json("--model", "Llama-3.1-8B", "--hardware", "rtx-4090", "--context", "128k")
        headroom = 2 * (DEFAULTS.gamma1 + DEFAULTS.gamma2 + 2)  # doubled by CUDA graphs
        positions = -(-(131072 + DEFAULTS.max_new_tokens + headroom) // SPLIT_SLOTS) * SPLIT_SLOTS  # graphs' split
        full = kv_bytes(target, positions)
        tail = kv_bytes(target, 256)
        for mode in MODES:
            none, kv = row(payload, mode, "none"), row(payload, mode, "kv")
            staging = kv_bytes(target, 1024) if MODE_TIERS[mode].retrieval else 0
            assert none["host_bytes"] == 0 and kv["host_bytes"] == full + tail + staging
            staged = kv["on_chip_layers"] + min(RING_LAYERS, target.num_layers - kv["on_chip_layers"])
            tensors = [
                r["device_bytes"] - sum(r["memory"].get(w, {"device": 0})["device"] for w in GPU_ITEMS)
                for r in (none, kv)
            ]
            assert tensors[0] - tensors[1] == full - staged * full // 32 - tail

    def test_records_name_each_figure_in_its_unit_in_a_fixed_order(self):
        """The machine, a row and the recommendation as --json writes them: these keys in this order, rates in GB/s
        and TFLOP/s, fixed costs in microseconds, the memory by item, the speedup beside the latencies."""
        machine = replace(HARDWARE["rtx-4090"], gpus=2, link=25e9, all_reduce_s=30e-6)
        prediction = predict("Llama-2-7B-128K", machine, 49152)
        assert list(as_record(machine).items()) == [
            ("name", machine.name),
            ("gpus", 2),
            ("memory_bytes_per_device", machine.memory_bytes),
            ("bandwidth_gbs", machine.bandwidth / 1e9),
            ("pcie_gbs", machine.pcie / 1e9),
            ("tflops", machine.flops / 1e12),
            ("layer_overhead_us", machine.layer_overhead_s * 1e6),
            ("link_gbs", 25.0),
            ("all_reduce_us", 30e-6 * 1e6),
            ("cuda_graphs", machine.cuda_graphs),
            ("measured", False),
            ("gpu", True),
        ]
        kv = prediction.row("triforce", "kv")
        assert list(as_record(kv).items()) == [
            ("mode", "triforce"),
            ("offload", "kv"),
            ("ms_per_token", kv.ms_per_token),
            ("device_bytes", kv.device_bytes),
            ("host_bytes", kv.host_bytes),
            ("fits", kv.fits),
            ("on_chip_layers", kv.on_chip_layers),
            ("tokens_per_pass", kv.tokens_per_pass),
            ("pass_ms", kv.pass_ms),
            ("draft_ms", kv.draft_ms),
            ("retrieval_ms", kv.retrieval_ms),
            ("full_ms", kv.full_ms),
            ("transfer_ms", kv.transfer_ms),
            ("memory", {item.what: {"device": item.device_bytes, "host": item.host_bytes} for item in kv.memory}),
        ]
        assert kv.host_bytes > 0 and as_record(kv)["memory"]
        best = prediction.recommendation
        assert list(as_record(best).items()) == [
            ("mode", best.mode),
            ("offload", best.offload),
            ("budget", best.budget),
            ("gamma1", best.gamma1),
            ("gamma2", best.gamma2),
            ("on_chip_layers", best.on_chip_layers),
            ("triforce_ms_per_token", best.triforce_ms_per_token),
            ("autoregressive_ms_per_token", best.autoregressive_ms_per_token),
            ("mode_ms_per_token", best.mode_ms_per_token),
            ("speedup_vs_autoregressive", best.speedup),
            ("fits", best.fits),
        ]


class TestMemory:
    def test_preset_shapes_are_the_runtimes_models(self):
        """The embedded preset's parameters are those our Transformer builds, and the drafter preset is the shipped
        drafter's config.json with its restricted output layer."""
        hf = AutoConfig.from_pretrained(EMBEDDED_DRAFTER)
        shipped = ModelShape.from_config(name=SMOLLM2_135M_DRAFTER.name, config=ModelConfig.from_hf(hf))
        assert replace(SMOLLM2_135M_DRAFTER, output_vocab=None) == shipped
        assert SMOLLM2_135M_DRAFTER.output_vocab == len(hf.triforce_drafter["output_ids"])
        with torch.device("meta"):
            drafter = Transformer.from_hf_config(hf)
            drafter.restrict_output(torch.tensor(hf.triforce_drafter["output_ids"]))
            target = Transformer.from_hf_config(SMOLLM2_135M.llama_config())
        assert SMOLLM2_135M_DRAFTER.parameters == sum(p.numel() for p in drafter.parameters())
        assert SMOLLM2_135M.parameters == sum(p.numel() for p in target.parameters()) == 134_515_008

    @pytest.mark.parametrize("mode", MODES)
    def test_embedded_memory_is_the_engines_memory_plan(self, mode):
        """Every cache, on the device or in host memory, as Engine.memory_plan sizes it, with the KV cache on the
        device and offloaded with the on-chip layers the planner finds room for (some, not all, in 850 MiB). The
        meta device stands for the CPU, whose prefill chunk (the drafter's cache holds one) it is given."""
        hf = AutoConfig.from_pretrained(EMBEDDED_DRAFTER)
        with torch.device("meta"):  # float32, as on a CPU; nothing allocated
            target = loaded(Transformer.from_hf_config(SMOLLM2_135M.llama_config()), SMOLLM2_135M.llama_config())
            drafter = loaded(Transformer.from_hf_config(hf), hf)
        workload = Workload(
            context=15360,
            engine=EngineConfig(mode=mode, budget=2048, prefill_block=PREFILL_BLOCK["cpu"]),
            acceptance=Acceptance(draft=0.5, retrieval=0.9),
            dtype_bytes=4,
        )
        # the tensors alone: no GPU items (test_a_gpu_plan_itemises_what_is_not_a_tensor_of_its_caches)
        small = replace(HARDWARE["rtx-4090"], memory_bytes=850 * 2**20, cuda_graphs=False, gpu=False)
        prediction = plan(target=SMOLLM2_135M, drafter=SMOLLM2_135M_DRAFTER, hardware=small, workload=workload)
        for offload in ("none", "kv"):
            row = prediction.row(mode, offload)
            config = replace(workload.engine, offload=offload, on_chip_layers=row.on_chip_layers)
            engine_plan = Engine(target, config, drafter).memory_plan(15360)
            expected = {what: (device, host) for what, device, host in engine_plan.items if what != "weights"}
            assert {i.what: (i.device_bytes, i.host_bytes) for i in row.memory if "weights" not in i.what} == expected
        assert 0 < prediction.row(mode, "kv").on_chip_layers < SMOLLM2_135M.num_layers

    @pytest.mark.parametrize(("hardware", "device"), [("rtx-4090", "cuda"), ("this-cpu", "cpu")])
    def test_the_drafter_cache_holds_a_prefill_chunk_of_the_planned_device(self, hardware, device):
        """A CPU prefills in chunks of 256 tokens, a GPU in chunks of 4,096, and the drafter's StreamingLLM cache
        holds its sinks, its window and one chunk (EngineConfig.prefill_block_on)."""
        payload = plan_json("--model", "SmolLM2-135M", "--hardware", hardware, "--context", "8k")
        positions = DEFAULTS.sink_tokens + DEFAULTS.draft_window + PREFILL_BLOCK[device]
        expected = kv_bytes(MODELS["SmolLM2-135M"].drafter, positions)
        assert row(payload, "triforce", "none")["memory"]["drafter cache"]["device"] == expected

    @pytest.mark.parametrize(("hardware", "device"), [("a100-80gb", "cuda"), ("this-cpu", "cpu")])
    def test_a_cpu_in_float32_holds_float16_caches(self, hardware, device):
        """On a CPU a float32 model's caches are float16 (cache.kv_dtype), the bytes of a bfloat16 model's; a GPU
        keeps float32 caches, twice a bfloat16 model's, in every cache's item."""
        payloads = {
            dtype: plan_json("--model", "SmolLM2-135M", "--hardware", hardware, "--context", "8k", "--dtype", dtype)
            for dtype in ("float32", "bfloat16")
        }
        kv_size = 2 if device == "cpu" else 4
        positions = DEFAULTS.sink_tokens + DEFAULTS.draft_window + PREFILL_BLOCK[device]
        drafter = kv_bytes(MODELS["SmolLM2-135M"].drafter, positions, kv_size)
        memory = {dtype: row(payload, "triforce", "none")["memory"] for dtype, payload in payloads.items()}
        assert memory["float32"]["drafter cache"]["device"] == drafter
        for item in ("full KV cache", "retrieval cache", "drafter cache"):
            halves = memory["float32"][item]["device"], memory["bfloat16"][item]["device"] * kv_size // 2
            assert halves[0] == halves[1] > 0, item

    def test_llama_3_1_8b_at_128k_needs_offloading_on_an_rtx_4090(self):
        payload = plan_json("--model", "Llama-3.1-8B", "--hardware", "rtx-4090", "--context", "128k")
        none, kv = row(payload, "triforce", "none"), row(payload, "triforce", "kv")
        weights, cache = none["memory"]["target weights"]["device"], none["memory"]["full KV cache"]["device"]
        assert 16.0e9 < weights < 16.1e9 and 17.1e9 < cache < 17.3e9  # 8.03B parameters; 128 KiB per position
        assert not none["fits"] and kv["fits"] and 0 < kv["on_chip_layers"] < 32
        assert kv["device_bytes"] <= 24 * GIB < none["device_bytes"]
        assert payload["recommendation"]["offload"] == "kv" and payload["recommendation"]["fits"]

    def test_a_gpu_plan_itemises_what_is_not_a_tensor_of_its_caches(self):
        """Beside the tensors, a row on a GPU holds the CUDA context (0.5 GiB), the graph pools of the longest
        fixed-shape step of each graphed model, the layer-wise prefill's hidden states where the cache is offloaded
        (1.06 GiB for 128K tokens of Llama-3.1-8B: one (T, C) each layer writes over, and its rotary tables) and 3% of the
        card for the allocator, so a row that fits leaves them free; on a CPU there is none."""
        payload = plan_json("--model", "Llama-3.1-8B", "--hardware", "rtx-4090", "--context", "128k")
        none, kv = row(payload, "triforce", "none"), row(payload, "triforce", "kv")
        target, drafter = MODELS["Llama-3.1-8B"].target, MODELS["Llama-3.1-8B"].drafter
        hidden = 131072 * (4096 + 2 * 128) * 2
        pools = target.step_activation_bytes(MAX_STEP_TOKENS, 2) + drafter.step_activation_bytes(MAX_STEP_TOKENS, 2)
        expected = {"CUDA context": 2**29, "CUDA graph pools": pools, "CUDA allocator slack": int(0.03 * 24 * GIB)}
        assert {what: kv["memory"][what]["device"] for what in GPU_ITEMS} == {
            **expected,
            "prefill hidden states": hidden,
        }
        assert {what: none["memory"][what]["device"] for what in GPU_ITEMS if what in none["memory"]} == expected
        assert 1.0 * GIB < hidden < 1.1 * GIB and 200 * 2**20 < pools < 300 * 2**20
        with torch.device("meta"):
            loaded = Transformer.from_hf_config(target.llama_config()).to(torch.bfloat16)
        assert loaded.prefill_layerwise_bytes(131072) == hidden
        assert kv["fits"] and kv["device_bytes"] <= 24 * GIB
        one_more_layer = kv_bytes(target, 131072) // 32
        assert kv["device_bytes"] + one_more_layer > 24 * GIB  # on-chip layers as many as leave them free
        cpu = plan_json("--model", "SmolLM2-135M", "--hardware", "this-cpu", "--context", "8k")
        assert all(what not in r["memory"] for r in cpu["rows"] for what in GPU_ITEMS)

    def test_an_eager_gpu_holds_no_graph_pools_and_offloaded_autoregressive_steps_the_targets(self):
        """Without CUDA graphs there are no pools; offloaded, the full tier's steps are graphed too (one recording
        per length bucket, in the target's pool), so autoregressive decoding holds the target's pool, as the
        retrieval tier does."""
        eager = predict("Llama-3.1-8B", replace(HARDWARE["rtx-4090"], cuda_graphs=False), 131072)
        assert all("CUDA graph pools" not in {i.what for i in r.memory} for r in eager.rows)
        graphed = predict("Llama-3.1-8B", HARDWARE["rtx-4090"], 131072)
        target_pool = MODELS["Llama-3.1-8B"].target.step_activation_bytes(MAX_STEP_TOKENS, 2)
        for mode in ("autoregressive", "retrieval"):
            pools = {i.what: i.device_bytes for i in graphed.row(mode, "kv").memory}["CUDA graph pools"]
            assert pools == target_pool, mode

    def test_offload_none_is_recommended_where_it_fits(self):
        advice = plan_json("--model", "SmolLM2-135M", "--hardware", "a100-80gb", "--context", "32k")["recommendation"]
        assert advice["offload"] == "none" and advice["fits"] and advice["on_chip_layers"] == 0

    def test_two_gpus_hold_what_one_cannot(self):
        """Tensor parallel: weights and KV heads split, the drafter whole on each GPU, forwards faster."""
        one = predict("Llama-2-7B-128K", HARDWARE["rtx-4090"], 49152)
        two = predict("Llama-2-7B-128K", replace(HARDWARE["rtx-4090"], gpus=2, link=25e9, all_reduce_s=30e-6), 49152)
        single, split = one.row("triforce", "none"), two.row("triforce", "none")
        assert not single.fits and split.fits
        per_device = {i.what: i.device_bytes for i in single.memory if i.what.startswith("drafter") or "CUDA" in i.what}
        assert split.device_bytes - single.device_bytes == sum(per_device.values())  # the drafter and reserve twice
        assert split.full_ms < single.full_ms


class TestLatency:
    @pytest.mark.parametrize("hardware", ["rtx-4090", "a100-80gb"])
    def test_latency_grows_with_context(self, hardware):
        rows = [predict("Llama-2-7B-128K", HARDWARE[hardware], context).rows for context in (8192, 32768, 131072)]
        for shorter, longer in pairwise(rows):
            for a, b in zip(shorter, longer):
                assert (a.mode, a.offload) == (b.mode, b.offload) and a.ms_per_token < b.ms_per_token

    def test_more_acceptance_lowers_triforce_latency(self):
        def triforce_ms(draft: float, retrieval: float) -> float:
            acceptance = Acceptance(draft=draft, retrieval=retrieval)
            prediction = predict("Llama-2-7B-128K", HARDWARE["rtx-4090"], 131072, acceptance, budget=4096)
            return prediction.row("triforce", "kv").ms_per_token

        assert triforce_ms(0.45, 0.95) < triforce_ms(0.45, 0.85)
        assert triforce_ms(0.7, 0.9) < triforce_ms(0.3, 0.9)

    def test_tokens_per_pass_follow_the_acceptance_formula(self):
        prediction = predict("Qwen2-7B", HARDWARE["h100"], 32768, Acceptance(draft=0.5, retrieval=0.8), gamma2=5)
        assert prediction.row("triforce", "none").tokens_per_pass == pytest.approx((1 - 0.8**6) / (1 - 0.8))
        assert prediction.row("streaming", "none").tokens_per_pass == pytest.approx((1 - 0.5**3) / (1 - 0.5))
        assert prediction.row("autoregressive", "none").tokens_per_pass == 1

    def test_offloaded_full_verification_is_bound_by_pcie(self):
        """Llama-2-7B at 128K on one RTX 4090: the streamed layers cross PCIe at 25 GB/s, overlapped with compute."""
        kv = predict("Llama-2-7B-128K", HARDWARE["rtx-4090"], 131072).row("autoregressive", "kv")
        streamed = 32 - kv.on_chip_layers
        assert kv.transfer_ms == pytest.approx(1e3 * streamed * 131072 * 2 * 32 * 128 * 2 / 25e9)
        assert kv.transfer_ms < kv.full_ms < kv.transfer_ms * 1.05


class TestCommandLine:
    def test_a_local_config_json(self, tmp_path):
        config = LlamaConfig(
            vocab_size=1000,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
        folder = tmp_path / "tiny-llama"
        config.save_pretrained(folder)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
        for given in (folder, folder / "config.json"):
            payload = plan_json("--model", str(given), "--hardware", "h100", "--context", "4k")
            assert payload["model"]["name"] == "tiny-llama" and payload["model"]["parameters"] == parameters
            target = row(payload, "autoregressive", "none")["memory"]["full KV cache"]["device"]
            positions = 4096 + DEFAULTS.max_new_tokens + 2 * DEFAULTS.speculation_depth
            assert target == 2 * 4 * 2 * 32 * -(-positions // SPLIT_SLOTS) * SPLIT_SLOTS * 2  # CUDA graphs' split

    def test_a_config_of_a_presets_shape_gets_the_drafter_shipped_for_it(self, tmp_path):
        config = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        )
        folder = tmp_path / "my-smollm2"
        config.save_pretrained(folder)
        model = plan_json("--model", str(folder), "--hardware", "this-cpu", "--context", "2k")["model"]
        assert model["name"] == "my-smollm2" and model["drafter"] == "smollm2-135m-instruct drafter"
        config.num_hidden_layers = 29  # another shape: the paper's drafter shape
        config.save_pretrained(folder)
        assert plan_json("--model", str(folder), "--context", "2k")["model"]["drafter"] == "llama-68m-shaped drafter"

    @pytest.mark.embedded
    def test_the_embedded_gguf_file_is_named_by_its_file_and_gets_its_drafter(self):
        from triforce_cli.runtime.embedded import embedded_gguf_path

        path = embedded_gguf_path()
        model = plan_json("--model", str(path), "--hardware", "this-cpu", "--context", "2k")["model"]
        assert model["name"] == path.stem and model["drafter"] == "smollm2-135m-instruct drafter"

    def test_this_cpu_is_the_measured_machine(self):
        payload = plan_json("--context", "2k")
        assert payload["model"]["name"] == SMOLLM2_135M.name
        assert payload["hardware"]["measured"] and payload["hardware"]["bandwidth_gbs"] == 20
        assert payload["hardware"]["pcie_gbs"] == 20  # host and device are one

    def test_figures_override_a_preset(self):
        hardware = plan_json("--hardware", "h100", "--context", "8k", "--memory-gb", "40", "--pcie-gbs", "12.5")[
            "hardware"
        ]
        assert hardware["memory_bytes_per_device"] == 40 * GIB and hardware["pcie_gbs"] == 12.5
        assert hardware["bandwidth_gbs"] == 3350 and not hardware["measured"]
        two = plan_json("--hardware", "h100", "--context", "8k", "--gpus", "2")["hardware"]
        assert two["gpus"] == 2 and two["link_gbs"] == 50 and two["all_reduce_us"] > 0  # linked over PCIe

    @pytest.mark.parametrize(
        ("spelling", "name"),
        [
            ("rtx4090", "rtx-4090"),
            ("RTX 4090", "rtx-4090"),
            ("4090", "rtx-4090"),
            ("NVIDIA GeForce RTX 4090", "rtx-4090"),
            ("rtx_4090", "rtx-4090"),
            ("2x RTX 4090", "2x-rtx-4090"),
            ("a100", "a100-80gb"),
            ("A100-80GB", "a100-80gb"),
            ("nvidia a100 80gb", "a100-80gb"),
            ("H100", "h100"),
            ("h100-80gb", "h100"),
            ("This CPU", "this-cpu"),
        ],
    )
    def test_hardware_spelled_as_people_do(self, spelling, name):
        assert plan_json("--hardware", spelling, "--context", "8k")["hardware"]["name"] == name

    def test_every_hardware_preset_answers_to_its_own_name(self):
        assert all(hardware_name(name) == name for name in HARDWARE_CHOICES)

    @pytest.mark.parametrize(
        ("spelling", "suggestion"),
        [("rtx-5090", " (did you mean rtx-4090?)"), ("a100-40gb", " (did you mean a100-80gb?)"), ("xyz", "")],
    )
    def test_unknown_hardware_names_the_presets_and_the_closest(self, spelling, suggestion):
        result = invoke("--hardware", spelling, "--context", "8k")
        choices = ", ".join(HARDWARE_CHOICES)
        line = (
            f"error: Invalid value for '--hardware': unknown hardware '{spelling}': choose from {choices}{suggestion}"
        )
        assert result.exit_code == 2 and result.stderr.startswith(line + " (see ") and result.stderr.count("\n") == 1

    @pytest.mark.parametrize(
        ("spelling", "name"),
        [
            ("llama 3.1 8b", "Llama-3.1-8B"),
            ("llama3.1-8B", "Llama-3.1-8B"),
            ("qwen2_7b", "Qwen2-7B"),
            ("LLAMA-2-7B-128K", "Llama-2-7B-128K"),
        ],
    )
    def test_model_spelled_as_people_do(self, spelling, name):
        assert plan_json("--model", spelling, "--hardware", "h100", "--context", "8k")["model"]["name"] == name

    def test_a_folder_named_like_a_preset_is_read_where_the_spelling_differs(self, tmp_path, monkeypatch):
        """A preset's exact name wins over a file of that name, as before; another spelling is a path where one
        exists."""
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
            tmp_path / "llama-3.1_8b"
        )
        monkeypatch.chdir(tmp_path)
        assert plan_json("--model", "llama-3.1_8b", "--hardware", "h100", "--context", "1k")["model"]["name"] == (
            "llama-3.1_8b"
        )

    def test_unknown_model_names_the_closest_preset(self):
        result = invoke("--model", "llama3", "--hardware", "h100", "--context", "8k")
        assert result.exit_code == 1 and result.stderr.count("\n") == 1
        assert result.stderr.startswith("error: unknown model 'llama3'")
        assert result.stderr.endswith(" (did you mean Llama-3.1-8B?)\n")

    @pytest.mark.parametrize(
        ("args", "fragment"),
        [
            (("--model", "Llama-9", "--context", "8k"), "error: unknown model 'Llama-9'"),
            (("--hardware", "rtx-5090", "--context", "8k"), "error: Invalid value for '--hardware'"),
            (("--context", "2k", "--dtype", "int8"), "error: Invalid value for '--dtype': 'int8' is not one of"),
            (("--context", "abc"), "error: Invalid value for '--context'"),
            (("--context", "0"), "error: Invalid value for '--context'"),
            (("--context", "2k", "--budget", "4k"), "error: budget 4096 is larger than the prompt"),
            (("--context", "2k", "--budget", "1000"), "error: budget 1000 is not a multiple of chunk size 16"),
            (("--context", "2k", "--acceptance-draft", "1.5"), "error: Invalid value for '--acceptance-draft'"),
            (("--context", "2k", "--memory-gb", "nan"), "error: Invalid value for '--memory-gb'"),
            (("--context", "2k", "--gpus", "2"), "error: --gpus 2 needs a GPU machine"),
            (("--context", "2k", "--plot", "latency.txt"), "error: --plot writes a PNG"),
            (("--hardware", "h100"), "error: Missing option '--context'"),
        ],
    )
    def test_bad_input_is_one_error_line(self, args, fragment):
        result = invoke(*args)
        assert result.exit_code != 0 and "Traceback" not in result.output and "Value error" not in result.output
        assert result.stderr.strip().startswith(fragment) and result.stderr.count("\n") == 1, result.stderr

    def test_a_model_folder_without_a_config_is_one_error_line(self, tmp_path):
        result = invoke("--model", str(tmp_path), "--hardware", "h100", "--context", "8k")
        assert result.exit_code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1

    @pytest.mark.parametrize(
        "args",
        [
            ("--model", "Llama-2-7B-128K", "--hardware", "2x-rtx-4090", "--context", "128k"),
            ("--model", "Qwen2-7B", "--hardware", "rtx-4090", "--context", "1000k", "--budget", "16k"),
            ("--context", "7.5k"),
        ],
    )
    def test_table_fits_80_columns(self, args):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert "predicted" in result.stdout and ("recommended" in result.stdout or "nothing fits" in result.stdout)
        assert "…" not in result.stdout
        assert max(len(line) for line in result.stdout.splitlines()) <= 80

    def test_plot_writes_a_png(self, tmp_path):
        pytest.importorskip("matplotlib")
        path = tmp_path / "latency.png"
        result = invoke("--model", "Llama-3.1-8B", "--hardware", "rtx-4090", "--context", "128k", "--plot", str(path))
        assert result.exit_code == 0, result.output
        assert path.read_bytes().startswith(b"\x89PNG")


def loaded(model: Transformer, hf) -> LoadedModel:
    return LoadedModel("meta", model, StubTokenizer(model.config.vocab_size), hf)


class TestGGUFWeights:
    """`plan --weights q4_k_m` (or a .gguf --model): the bytes the packed blocks hold, as the runtime packs them."""

    def test_a_mix_gives_llama_cpps_types_and_the_packed_bytes(self):
        from triforce_cli.kernels.gguf import BLOCK_TYPES

        from triforce_cli.plan.weights import mix_weight_bytes

        shape = MODELS[EMBEDDED_PRESET].target  # 576 wide: Q4_K falls back to Q5_0, Q6_K to Q8_0
        smol = mix_weight_bytes("q4_k_m", shape)
        assert smol.output == BLOCK_TYPES["Q8_0"].bytes_per_weight()
        # the types of llama.cpp's Q4_K_M file of it: 14 of 30 down projections Q6_K, 16 Q4_K (1536 wide); every
        # other matrix Q5_0 or, for 14 value projections, Q8_0 (both 1.125 bytes packed)
        down = shape.hidden_size * shape.intermediate_size
        others = shape.layer_parameters - 2 * shape.hidden_size - down  # norms are not matrices
        by_hand = (14 * down * 1.25 + 16 * down * 0.75 + 30 * others * 1.125) / (30 * (down + others))
        assert smol.layers == pytest.approx(by_hand)
        wide = mix_weight_bytes("q4_k_m", MODELS["Llama-3.1-8B"].target)  # 4096 wide: real K-quants
        assert 0.75 < wide.layers < 1.0 and wide.output == BLOCK_TYPES["Q6_K"].bytes_per_weight()
        assert mix_weight_bytes("q8_0", shape).layers == 1.125

    @pytest.mark.embedded  # the file carries the embedded model's tokenizer
    def test_a_file_gives_its_own_types_and_a_mix_predicts_them(self, tmp_path):
        from helpers import write_gguf_model

        from triforce_cli.plan.weights import _fitted, _more_bits, file_weight_bytes, mix_weight_bytes

        def q4_k_m(name: str) -> str:  # llama.cpp's choices for a 2-layer model 256 wide, as plan.weights models them
            if name == "token_embd":
                return "Q6_K"  # tied: the output layer's type
            promoted = name.endswith(("attn_v", "ffn_down")) and _more_bits(int(name.split(".")[1]), 2)
            return _fitted("Q6_K" if promoted else "Q4_K", 256)

        path = tmp_path / "tiny-Q4_K_M.gguf"
        write_gguf_model(path, q4_k_m)
        from_file = file_weight_bytes(path)
        payload = plan_json("--model", str(path), "--hardware", "this-cpu", "--context", "1k")
        shape = triforce_cli.plan.model_preset(str(path)).target
        assert (shape.hidden_size, shape.num_layers, shape.intermediate_size) == (256, 2, 512)
        assert payload["settings"]["weights"] == {"name": path.name, "layers": from_file.layers, "output": 1.25}
        assert mix_weight_bytes("q4_k_m", shape).layers == pytest.approx(from_file.layers)
        held = row(payload, "autoregressive", "none")["memory"]
        assert held["target weights"]["device"] == round(shape.weight_bytes(from_file))

    def test_fewer_bytes_a_weight_predict_a_faster_cpu_step(self):
        dense = plan_json("--model", "smollm2-135m", "--hardware", "this-cpu", "--context", "8k", "--dtype", "float32")
        packed = plan_json(*("--model", "smollm2-135m", "--hardware", "this-cpu", "--context", "8k"),
                           *("--dtype", "float32", "--weights", "q4_k_m"))  # fmt: skip
        for mode in ("autoregressive", "triforce"):
            assert row(packed, mode, "none")["ms_per_token"] < row(dense, mode, "none")["ms_per_token"]
        assert "weights q4_k_m" in invoke("--model", "smollm2-135m", "--context", "8k", "--weights", "q4_k_m").stdout

    def test_gguf_weights_on_a_gpu_are_one_error_line(self):
        result = invoke("--hardware", "rtx-4090", "--context", "8k", "--weights", "q4_k_m")
        assert result.exit_code == 1 and "GGUF blocks are computed on the CPU" in result.stderr
        assert "Traceback" not in result.output


class TestThisCpu:
    """`--hardware this-cpu`: its per-layer cost timed on the path decoding takes here."""

    @pytest.mark.skipif(kernel_error() is not None, reason=f"the CPU kernels cannot be built here: {kernel_error()}")
    def test_the_layer_probe_takes_the_path_of_decoding(self, monkeypatch):
        """The tiny model that prices a layer runs its step in one call into the extension on a float16 cache, as
        a loaded model's decode step does on this CPU; torch's op-by-op path costs several times more a layer."""
        measure, cpu = triforce_cli.plan.measure, torch.device("cpu")
        stacks = []
        run_one_call = Transformer.run_one_call
        monkeypatch.setattr(Transformer, "run_one_call", lambda *args: stacks.append(args[1]) or run_one_call(*args))
        model = measure.probe_model()
        cache = FullCache(measure.PROBE_LAYERS, 2, 16, 4, kv_dtype(cpu, torch.float32))
        assert cache.keys.dtype == torch.float16
        model(torch.zeros(1, dtype=torch.long), 0, cache, num_logits=1)
        assert len(stacks) == 1


class TestThisGpu:
    """`--hardware this-gpu`: the CUDA device measured now as this-cpu measures the CPU; one error line without it."""

    @pytest.mark.skipif(torch.cuda.is_available(), reason="the answer of a machine without CUDA")
    def test_without_cuda_it_is_one_error_line(self):
        result = CliRunner().invoke(app, ["plan", "--hardware", "this-gpu", "--context", "8k"])
        assert result.exit_code == 1
        assert result.output.strip().splitlines() == [
            "error: `hardware` this-gpu measures a CUDA GPU and this machine has none: use this-cpu or a preset"
        ]

    def test_its_figures_are_the_devices_measured(self, monkeypatch):
        """Memory within the share this process may use; the device's copy, bfloat16 matrix products and pinned
        uploads timed on the current device; decode steps replayed as CUDA graphs."""
        measure = triforce_cli.plan.measure
        asked = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.3)
        monkeypatch.setattr(measure, "copy_bandwidth", lambda device, size: asked.append(("copy", device)) or 3e12)
        monkeypatch.setattr(measure, "host_to_device_bandwidth", lambda device: asked.append(("pcie", device)) or 5e10)
        monkeypatch.setattr(measure, "matmul_flops", lambda device, dtype, size: asked.append((dtype, device)) or 7e14)
        hardware = plan_json("--model", "Llama-3.1-8B", "--hardware", "this gpu", "--context", "32k")["hardware"]
        assert hardware["name"] == "this-gpu" and hardware["measured"] and hardware["gpu"] and hardware["cuda_graphs"]
        assert hardware["memory_bytes_per_device"] == int(0.3 * 80 * GIB)
        assert (hardware["bandwidth_gbs"], hardware["pcie_gbs"], hardware["tflops"]) == (3000, 50, 700)
        gpu = torch.device("cuda", 0)
        assert sorted(asked, key=str) == sorted([("copy", gpu), ("pcie", gpu), (torch.bfloat16, gpu)], key=str)

    def test_the_timed_work_runs_on_the_cpu_too(self):
        measure, cpu = triforce_cli.plan.measure, torch.device("cpu")
        assert measure.copy_bandwidth(cpu, 2**20) > 0 and measure.matmul_flops(cpu, torch.bfloat16, 64) > 0

    @pytest.mark.cuda
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    def test_a_gpu_is_measured(self):
        hardware = triforce_cli.plan.measure.measure_this_gpu()
        assert hardware.bandwidth > 1e11 and hardware.flops > 1e13 and hardware.pcie > 1e9 and hardware.gpu
