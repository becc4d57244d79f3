"""The `triforce generate` command: errors as one line, --json, options reaching the backend, Ctrl-C; and options
of `triforce bench` reaching the bench.

Most tests swap the loader (``triforce_cli.decoding.pipeline.load_model``) for tiny random Llama models wrapped into the
runtime with a character-level stub tokenizer, so ``Pipeline.load`` and ``Engine`` still run for real.
``TestRealLoader`` and the Ctrl-C subprocess test use the real loader on a tiny checkpoint saved to a temporary
folder; no test here touches the embedded model (see test_embedded.py).
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from helpers import ALPHABET, CONTEXT, PROMPT, CharTokenizer, save_word_checkpoint
from triforce_cli.kernels import half_weights_available
from typer.testing import CliRunner

import triforce_cli.cli.bench
from triforce_cli.bench.runner import Bench, BenchConfig
from triforce_cli.cli.app import app
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.interrupts import INTERRUPTED_EXIT_CODE, InterruptWatch, interrupted_exit_code
from triforce_cli.runtime.loading import LoadedModel

LIBRARY_LOAD_DEFAULTS = LoadOptions()


def invoke(*args, input=None):
    return CliRunner().invoke(app, ["generate", *map(str, args)], input=input)


def assert_one_error_line(result, *fragments: str) -> str:
    """Exit code 1 (2 for a usage error), nothing on stdout, and stderr is exactly one non-empty line starting with
    'error:'."""
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (1, 2), result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert result.stdout in ("", json.dumps({"error": lines[0].removeprefix("error: ")}) + "\n")  # --json: the same
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def run_json(*args, input=None) -> dict:
    result = invoke(*args, "--json", input=input)
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout  # one JSON object and nothing else on stdout
    return json.loads(lines[0])


GREEDY = ("--temperature", "0")
SMALL_CACHES = ("--budget", 32, "--chunk-size", 8, "--draft-window", 16, "--sink-tokens", 4)


# ---------------------------------------------------------------------------------------------- prompt files


@pytest.mark.usefixtures("tiny")
class TestPromptErrors:
    def test_missing_file(self, tmp_path):
        missing = tmp_path / "nope.txt"
        assert_one_error_line(invoke("-p", missing), str(missing), "does not exist")

    @pytest.mark.parametrize("content", ["", "   \n\t  \n"], ids=["empty", "whitespace"])
    def test_empty_file(self, tmp_path, content):
        path = tmp_path / "empty.txt"
        path.write_text(content)
        assert_one_error_line(invoke("-p", path), "empty")

    def test_folder(self, tmp_path):
        assert_one_error_line(invoke("-p", tmp_path), "folder")

    def test_binary_file(self, tmp_path):
        path = tmp_path / "blob.bin"
        path.write_bytes(b"hello\x00\x01\x02world" * 10)
        assert_one_error_line(invoke("-p", path), "binary")

    def test_not_utf8(self, tmp_path):
        path = tmp_path / "latin1.txt"
        path.write_bytes("café crème, déjà vu".encode("latin-1"))
        assert_one_error_line(invoke("-p", path), "UTF-8")

    @pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files with mode 000")
    def test_unreadable_file(self, tmp_path):
        path = tmp_path / "secret.txt"
        path.write_text(PROMPT)
        path.chmod(0)
        try:
            assert_one_error_line(invoke("-p", path), "cannot read")
        finally:
            path.chmod(0o600)

    def test_empty_stdin(self):
        assert_one_error_line(invoke("-p", "-", input="  \n"), "standard input", "empty")

    def test_prompt_longer_than_context(self, tmp_path):
        path = tmp_path / "long.txt"
        path.write_text("x" * (CONTEXT + 10))
        assert_one_error_line(invoke("-p", path, "--max-new-tokens", 4), "context", str(CONTEXT), "--context-window")

    def test_context_window_reaches_both_loads(self, tiny, prompt_file):
        result = invoke("-p", prompt_file, "--draft", "drafter", "--context-window", "2k", "--max-new-tokens", 2)
        assert result.exit_code == 0, result.output
        assert [c.context_window for c in tiny["calls"]] == [2048, 2048]

    def test_bad_context_window(self, prompt_file):
        assert_one_error_line(invoke("-p", prompt_file, "--context-window", "1k,2k"), "not a token count")

    def test_prompt_plus_new_tokens_longer_than_context(self, tmp_path):
        path = tmp_path / "long.txt"
        path.write_text("x" * (CONTEXT - 10))
        assert_one_error_line(invoke("-p", path, "--max-new-tokens", 20), "context")

    def test_chat_without_template(self, prompt_file):
        assert_one_error_line(invoke("-p", prompt_file, "--chat", "--max-new-tokens", 4), "chat template")

    def test_utf8_prompt_is_accepted(self, tmp_path):
        path = tmp_path / "unicode.txt"
        text = "héllo wörld ✓ — ünïcödé prose, " * 3
        path.write_text(text, encoding="utf-8")
        data = run_json("-p", path, "--max-new-tokens", 3, "--mode", "autoregressive", *GREEDY)
        assert data["prompt_tokens"] == len(text)


# ---------------------------------------------------------------------------------------------- settings


@pytest.mark.usefixtures("tiny")
class TestSettingErrors:
    @pytest.mark.parametrize(
        "args, fragment",
        [
            (("--budget", 20, "--chunk-size", 16), "multiple of chunk size"),
            (("--budget", 0), "--budget"),
            (("--chunk-size", 0), "--chunk-size"),
            (("--gamma1", 0), "gamma1"),
            (("--gamma2", -1), "gamma2"),
            (("--gamma-policy", "eager"), "Invalid value for '--gamma-policy': 'eager' is not one of"),
            (("--draft-window", 0), "--draft-window"),
            (("--sink-tokens", -1), "--sink-tokens"),
            (("--refresh-interval", 0), "--refresh-interval"),
            (("--max-new-tokens", 0), "--max-new-tokens"),
            (("--temperature=-0.5",), "temperature"),
            (("--top-p", 0), "top-p"),
            (("--top-p", 1.5), "top-p"),
            (("--top-k=-1",), "top-k"),
            (("--mode", "fast"), "Invalid value for '--mode': 'fast' is not one of"),
            (("--ngram", "--mode", "autoregressive"), "--ngram"),
            (("--dtype", "int8"), "Invalid value for '--dtype': 'int8' is not one of"),
            (("--device", "bogus"), "'bogus' is not one of auto, cpu, cuda, cuda:N"),
            (("--gamma1", 65), "gamma1 must lie in 1..64"),
            (("--temperature", "inf"), "temperature must be a finite number"),
        ],
        ids=lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else None,
    )
    def test_invalid_setting(self, prompt_file, args, fragment):
        assert_one_error_line(invoke("-p", prompt_file, "--max-new-tokens", 4, *args), fragment)

    def test_zero_chunk_size_with_budget(self, prompt_file):
        assert_one_error_line(invoke("-p", prompt_file, "--chunk-size", 0, "--budget", 32), "--chunk-size")

    def test_budget_larger_than_prompt(self, tmp_path):
        path = tmp_path / "short.txt"
        path.write_text("a short prompt of 40 characters........")
        assert_one_error_line(invoke("-p", path, "--budget", 64, "--max-new-tokens", 4), "budget 64", "larger")

    def test_prompt_shorter_than_one_chunk(self, tmp_path):
        path = tmp_path / "tiny.txt"
        path.write_text("hi there")
        assert_one_error_line(invoke("-p", path, "--max-new-tokens", 4), "shorter than one retrieval chunk")

    @pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
    def test_cuda_without_gpu(self, prompt_file):
        assert_one_error_line(invoke("-p", prompt_file, "--device", "cuda"), "no CUDA GPU")

    def test_drafter_with_another_vocabulary(self, prompt_file):
        assert_one_error_line(
            invoke("-p", prompt_file, "--draft", "other-vocab", "--max-new-tokens", 4), "vocabulary", "other-vocab"
        )

    def test_drafter_refused_for_a_mode_without_drafter_tier(self, prompt_file, tiny):
        """A --draft that no tier of the mode would use is refused before any model loads, not loaded for nothing;
        'self' (no drafter) agrees with such a mode."""
        for mode in ("retrieval", "autoregressive"):
            assert_one_error_line(
                invoke("-p", prompt_file, "--draft", "other-vocab", "--mode", mode, "--max-new-tokens", 3),
                f"--draft names the model of a drafter tier, which --mode {mode} does not run",
                "(streaming or triforce)",
            )
        assert tiny["calls"] == []
        data = run_json("-p", prompt_file, "--draft", "self", "--mode", "retrieval", "--max-new-tokens", 3)
        assert data["new_tokens"] == 3 and data["drafter"] is None

    def test_on_chip_layers_need_an_offloaded_cache(self, prompt_file):
        assert_one_error_line(
            invoke("-p", prompt_file, "--on-chip-layers", 2, "--max-new-tokens", 3),
            "--on-chip-layers keeps layers of an offloaded KV cache on the device: give --offload kv",
        )

    def test_blank_prompt_cache_is_not_the_current_folder(self, prompt_file, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        for blank in ("", " "):
            result = invoke("-p", prompt_file, "--prompt-cache", blank, "--max-new-tokens", 3)
            assert_one_error_line(result, "--prompt-cache", "give a folder, not an empty path")
        assert [path.name for path in tmp_path.iterdir()] == [prompt_file.name]  # no prefill saved there

    @pytest.mark.parametrize(
        "error",
        [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), MemoryError()],
        ids=["torch-oom", "MemoryError"],
    )
    def test_out_of_memory(self, monkeypatch, prompt_file, error):
        def explode(self, *args, **kwargs):
            raise error

        monkeypatch.setattr(Engine, "generate", explode)
        assert_one_error_line(invoke("-p", prompt_file, "--json"), "out of memory")
        # Without --json the drafter line and tier legend come before generation starts; the error ends stderr.
        result = invoke("-p", prompt_file)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert "Traceback" not in result.output and result.stdout.strip() == ""
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert [line for line in lines if line.startswith("error:")] == lines[-1:]
        assert "out of memory" in lines[-1]


# ---------------------------------------------------------------------------------------------- real loader


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_word_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture
def word_prompt(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text(" ".join(f"w{i % 31}" for i in range(40)))
    return path


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "triforce-cache"))
    return tmp_path / "triforce-cache"


def copy_folder(src, dst, skip=()):
    dst.mkdir()
    for file in src.iterdir():
        if file.name not in skip:
            (dst / file.name).write_bytes(file.read_bytes())
    return dst


class TestRealLoader:
    def test_unknown_model_path(self, prompt_file, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        assert_one_error_line(invoke("-p", prompt_file, "--target", "./does-not-exist"), "does not exist")

    def test_unknown_drafter_path(self, word_prompt, tiny_folder, tmp_path):
        missing = tmp_path / "no-drafter"
        assert_one_error_line(invoke("-p", word_prompt, "--target", tiny_folder, "--draft", missing), str(missing))

    def test_unknown_hub_id(self, prompt_file, tmp_path, monkeypatch):
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError

        def offline(repo_id, **kwargs):
            raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder (offline)")

        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
        assert_one_error_line(
            invoke("-p", prompt_file, "--target", "no-org/no-model"), "unknown model 'no-org/no-model'"
        )

    def test_file_that_is_not_a_checkpoint(self, prompt_file):
        assert_one_error_line(invoke("-p", prompt_file, "--target", prompt_file), "not a folder, a .gguf")

    def test_folder_without_config(self, prompt_file, tiny_folder, tmp_path):
        folder = copy_folder(tiny_folder, tmp_path / "noconf", skip={"config.json"})
        assert_one_error_line(invoke("-p", prompt_file, "--target", folder), "config.json")

    def test_folder_without_weights(self, prompt_file, tiny_folder, tmp_path):
        folder = copy_folder(tiny_folder, tmp_path / "noweights", skip={"model.safetensors"})
        assert_one_error_line(invoke("-p", prompt_file, "--target", folder), "safetensors")

    def test_not_llama_family(self, prompt_file, tiny_folder, tmp_path):
        folder = copy_folder(tiny_folder, tmp_path / "gpt")
        config = json.loads((folder / "config.json").read_text())
        config["model_type"] = "gpt2"
        (folder / "config.json").write_text(json.dumps(config))
        assert_one_error_line(invoke("-p", prompt_file, "--target", folder), "not Llama-family")

    def test_invalid_gguf(self, prompt_file, tmp_path, own_cache):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"this is not a GGUF file at all")
        result = invoke("-p", prompt_file, "--target", bad)
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert isinstance(result.exception, SystemExit)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        # A status line announcing the one-time conversion may come first; the error is the last line.
        assert lines[-1].startswith("error:") and "GGUF" in lines[-1]
        assert not any(line.startswith("error:") for line in lines[:-1])
        assert not list(own_cache.rglob("*.partial"))  # no half-converted folder is left behind

    @pytest.mark.parametrize("kept", [0.9, 0.01])
    def test_a_gguf_file_cut_short_is_one_line(self, prompt_file, tmp_path, own_cache, kept):
        from triforce_cli.runtime.embedded import embedded_gguf_path

        whole = embedded_gguf_path().read_bytes()
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(whole[: int(len(whole) * kept)])
        result = invoke("-p", prompt_file, "--target", cut)
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("error: cannot read GGUF file")  # after the conversion's note
        assert not any(line.startswith("error:") for line in lines[:-1])

    @pytest.mark.parametrize(
        ("setting", "fragment"),
        [({"hidden_size": 63}, "not a multiple"), ({"num_hidden_layers": -1}, "num_hidden_layers -1")],
    )
    def test_a_config_of_impossible_sizes_is_one_line(self, prompt_file, tiny_folder, tmp_path, setting, fragment):
        folder = copy_folder(tiny_folder, tmp_path / "sizes")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **setting}))
        assert_one_error_line(invoke("-p", prompt_file, "--target", folder), fragment)
        planned = CliRunner().invoke(app, ["plan", "--model", str(folder), "--context", "1k", "--hardware", "h100"])
        assert_one_error_line(planned, fragment)

    def test_corrupt_weights(self, prompt_file, tiny_folder, tmp_path):
        folder = copy_folder(tiny_folder, tmp_path / "corrupt")
        (folder / "model.safetensors").write_bytes((tiny_folder / "model.safetensors").read_bytes()[:100])
        assert_one_error_line(invoke("-p", prompt_file, "--target", folder), "corrupt")

    def test_folder_without_tokenizer(self, prompt_file, tiny_folder, tmp_path):
        folder = copy_folder(tiny_folder, tmp_path / "notok", skip={"tokenizer.json", "tokenizer_config.json"})
        assert_one_error_line(invoke("-p", prompt_file, "--target", folder), "tokenizer")

    def test_device_cpu_index(self, word_prompt, tiny_folder):
        run_json("-p", word_prompt, "--target", tiny_folder, "--device", "cpu:0", "--max-new-tokens", 2)

    def test_unsupported_device_type(self, word_prompt, tiny_folder):
        assert_one_error_line(invoke("-p", word_prompt, "--target", tiny_folder, "--device", "mps"), "'mps' is not")

    @pytest.mark.parametrize(
        "weights, fragment", [("bogus", "'bogus' is not one of"), ("gguf", "GGUF")], ids=["bogus", "gguf"]
    )
    def test_weights_option(self, word_prompt, tiny_folder, weights, fragment):
        assert_one_error_line(invoke("-p", word_prompt, "--target", tiny_folder, "--weights", weights), fragment)

    def test_chat_on_real_tokenizer_without_template(self, word_prompt, tiny_folder):
        assert_one_error_line(invoke("-p", word_prompt, "--target", tiny_folder, "--chat"), "chat template")

    @pytest.mark.parametrize(
        "template",
        ["{{ raise_exception('no user turns') }}", "{% for m in messages %}", "{{ ''.__class__.__mro__ }}"],
        ids=["refused", "unparsed", "sandboxed"],
    )
    def test_a_chat_template_that_fails_is_one_line(self, word_prompt, tiny_folder, tmp_path, template):
        folder = copy_folder(tiny_folder, tmp_path / "templated")
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": template}))
        assert_one_error_line(invoke("-p", word_prompt, "--target", folder, "--chat"), "chat template refuses")

    def test_generates_from_a_saved_folder(self, word_prompt, tiny_folder):
        data = run_json("-p", word_prompt, "--target", tiny_folder, "--max-new-tokens", 5, *GREEDY)
        assert data["prompt_tokens"] == 40 and data["new_tokens"] == 5 and len(data["token_ids"]) == 5
        assert data["text"].split() == [f"w{i - 1}" for i in data["token_ids"] if i != 0]  # 0 is [UNK], special


# ---------------------------------------------------------------------------------------------- output


@pytest.mark.usefixtures("tiny")
class TestOutput:
    def test_json_object(self, prompt_file, tiny):
        data = run_json("-p", prompt_file, "--max-new-tokens", 9, "--seed", 3)
        expected = {
            "token_ids",
            "text",
            "mode",
            "drafter",
            "prompt_tokens",
            "new_tokens",
            "prefill_seconds",
            "decode_seconds",
            "ms_per_token",
            "median_ms_per_token",
            "tokens_per_second",
            "stop_reason",
            "acceptance",
        }
        assert expected <= set(data)
        assert data["mode"] == "triforce"
        assert data["prompt_tokens"] == len(PROMPT)
        assert data["new_tokens"] == len(data["token_ids"]) == 9
        assert data["stop_reason"] == "max_new_tokens"
        assert data["text"] == tiny["models"]["tiny"].tokenizer.decode(data["token_ids"])
        assert all(0 <= t < 32 for t in data["token_ids"])
        assert data["ms_per_token"] >= 0 and data["prefill_seconds"] >= 0
        tiers = [(a["proposer"], a["verifier"]) for a in data["acceptance"]]
        # the costed default, seeded too, may also draft for the target straight from the drafter
        assert tiers == [("retrieval", "target"), ("drafter", "retrieval"), ("drafter", "target")]
        for a in data["acceptance"]:
            assert 0 <= a["accepted"] <= a["drafted"] and 0 <= a["acceptance_rate"] <= 1

    def test_text_on_stdout_report_on_stderr(self, prompt_file):
        args = ("-p", prompt_file, "--max-new-tokens", 12, *GREEDY)
        data = run_json(*args)
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert result.stdout == data["text"] + "\n"
        assert "stopped by" in result.stderr and "acceptance per tier" in result.stderr and "passes" in result.stderr
        assert "Traceback" not in result.output

    def test_stdin_prompt(self, tiny):
        text = "a prompt that arrives on standard input, long enough for two chunks"
        data = run_json("-p", "-", "--max-new-tokens", 3, "--mode", "autoregressive", input=text)
        assert data["prompt_tokens"] == len(text)
        assert data["new_tokens"] == 3

    def test_stdin_prompt_same_as_file(self, prompt_file):
        from_file = run_json("-p", prompt_file, "--max-new-tokens", 6, *GREEDY)
        from_stdin = run_json("-p", "-", "--max-new-tokens", 6, *GREEDY, input=PROMPT)
        assert from_stdin["token_ids"] == from_file["token_ids"]

    def test_generated_text_printed_verbatim(self, prompt_file):
        args = ("-p", prompt_file, "--target", "markup", "--max-new-tokens", 8, *GREEDY)
        data = run_json(*args)
        assert "[bold]" in data["text"] or ":fire:" in data["text"]
        result = invoke(*args)
        assert result.exit_code == 0
        assert result.stdout == data["text"] + "\n"

    def test_drafter_name_printed_verbatim(self, monkeypatch, prompt_file, tiny):
        named = LoadedModel("drafter[v2]", tiny["models"]["drafter"].model, CharTokenizer(list(ALPHABET)),
                            tiny["models"]["drafter"].hf_config)  # fmt: skip
        monkeypatch.setitem(tiny["models"], "v2", named)
        result = invoke("-p", prompt_file, "--draft", "v2", "--mode", "streaming", "--max-new-tokens", 3)
        assert result.exit_code == 0, result.output
        assert "drafter: n-gram prompt lookup (training-free), else drafter[v2]" in result.stderr

    @pytest.mark.parametrize("name", ["notes[/x].txt", "notes[bold].txt"])
    def test_error_message_keeps_brackets(self, tmp_path, name):
        missing = tmp_path / name
        assert_one_error_line(invoke("-p", missing), str(missing))


@pytest.mark.usefixtures("tiny")
class TestPromptCache:
    ARGS = ("--max-new-tokens", 12, "--refresh-interval", 1, *GREEDY, *SMALL_CACHES)

    def test_second_run_restores_the_prefill_and_generates_the_same(self, prompt_file, tmp_path):
        folder = tmp_path / "prompts"
        fresh = run_json("-p", prompt_file, *self.ARGS)
        first = run_json("-p", prompt_file, *self.ARGS, "--prompt-cache", folder)
        assert not first["prompt_cached"]
        assert len(list(folder.glob("*.safetensors"))) == 1
        for mode in ("triforce", "autoregressive", "streaming"):
            again = run_json("-p", prompt_file, *self.ARGS, "--prompt-cache", folder, "--mode", mode)
            assert again["prompt_cached"], mode
            assert again["token_ids"] == fresh["token_ids"], mode
        assert len(list(folder.glob("*.safetensors"))) == 1

    def test_other_prompt_gets_its_own_file(self, prompt_file, tmp_path):
        folder = tmp_path / "prompts"
        run_json("-p", prompt_file, *self.ARGS, "--prompt-cache", folder)
        other = run_json("-p", "-", *self.ARGS, "--prompt-cache", folder, input=PROMPT[::-1])
        assert not other["prompt_cached"]
        assert len(list(folder.glob("*.safetensors"))) == 2

    def test_corrupt_cache_file_is_prefilled_again(self, prompt_file, tmp_path):
        folder = tmp_path / "prompts"
        first = run_json("-p", prompt_file, *self.ARGS, "--prompt-cache", folder)
        (cached,) = folder.glob("*.safetensors")
        cached.write_bytes(b"not a safetensors file")
        result = invoke("-p", prompt_file, *self.ARGS, "--prompt-cache", folder)
        assert result.exit_code == 0 and "prompt cache entry" in result.stderr and "prefilling again" in result.stderr
        again = run_json("-p", prompt_file, *self.ARGS, "--prompt-cache", folder)
        assert again["prompt_cached"] and again["token_ids"] == first["token_ids"]


# ---------------------------------------------------------------------------------------------- backend


@pytest.fixture
def captured_load(monkeypatch, tiny) -> dict:
    """Records the keyword arguments the CLI passes to Pipeline.load (which then runs for real): options, config
    and status."""
    captured = {}
    original = Pipeline.load.__func__

    def spy(cls, **kwargs):
        captured.update(kwargs)
        return original(cls, **kwargs)

    monkeypatch.setattr(Pipeline, "load", classmethod(spy))
    return captured


class TestOptionsReachBackend:
    def test_every_option(self, prompt_file, captured_load, tiny):
        data = run_json(
            "-p", prompt_file,
            "--target", "tiny",
            "--draft", "drafter",
            "--mode", "streaming",
            "--budget", 48,
            "--chunk-size", 8,
            "--draft-window", 24,
            "--sink-tokens", 4,
            "--gamma1", 3,
            "--gamma2", 5,
            "--gamma-policy", "heuristic",
            "--refresh-interval", 3,
            "--max-new-tokens", 7,
            "--temperature", 0.7,
            "--top-p", 0.8,
            "--top-k", 5,
            "--seed", 123,
            "--ngram",
            "--dtype", "float32",
            "--device", "cpu",
            "--weights", "gguf",
        )  # fmt: skip
        config: EngineConfig = captured_load["config"]
        assert (config.mode, config.budget, config.chunk_size) == ("streaming", 48, 8)
        assert (config.draft_window, config.sink_tokens) == (24, 4)
        assert (config.gamma1, config.gamma2, config.refresh_interval) == (3, 5, 3)
        assert config.gamma_policy == "heuristic"
        assert config.max_new_tokens == 7
        assert config.ngram is True
        s = config.sampling
        assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 0.8, 5, 123)
        options: LoadOptions = captured_load["options"]
        assert (options.target, options.draft) == ("tiny", "drafter")
        assert (options.dtype, options.device) == ("float32", "cpu")
        assert [c.spec for c in tiny["calls"]] == ["tiny", "drafter"]
        assert options.weights == "gguf"
        assert all(c.dtype == torch.float32 and c.device == torch.device("cpu") for c in tiny["calls"])
        target_call, drafter_call = tiny["calls"]
        drafter_weights = "half" if half_weights_available() else "dense"  # a drafter has no GGUF file of its own
        assert (target_call.weights, drafter_call.weights) == ("gguf", drafter_weights)
        assert drafter_call.shared_from is tiny["models"]["tiny"] and target_call.shared_from is None
        assert data["mode"] == "streaming" and data["new_tokens"] == 7
        assert data["drafter"] == "n-gram prompt lookup (training-free), else drafter"  # --ngram with --draft

    def test_no_ngram_leaves_the_model_drafter_alone(self, prompt_file, captured_load):
        data = run_json("-p", prompt_file, "--draft", "drafter", "--no-ngram", "--max-new-tokens", 3)
        assert captured_load["config"].ngram is False
        assert data["drafter"] == "drafter"

    def test_defaults_match_library_defaults(self, prompt_file, captured_load):
        result = invoke("-p", prompt_file, "--json")
        assert result.exit_code == 0, result.output
        assert captured_load["config"] == EngineConfig()
        options: LoadOptions = captured_load["options"]
        assert (options.target, options.draft) == (None, None)
        assert (options.dtype, options.device) == ("auto", "auto")
        assert options == replace(LIBRARY_LOAD_DEFAULTS, tune=True)  # a command measures where it may

    def test_json_mode_passes_no_status_callback(self, prompt_file, captured_load):
        invoke("-p", prompt_file, "--json", "--max-new-tokens", 2)
        assert captured_load["status"] is None

    def test_threads(self, monkeypatch, prompt_file, tiny):
        calls = []
        monkeypatch.setattr(torch, "set_num_threads", calls.append)
        run_json("-p", prompt_file, "--threads", 1, "--max-new-tokens", 2)
        assert calls == [1]

    def test_seed_makes_sampling_reproducible(self, prompt_file, tiny):
        args = ("-p", prompt_file, "--temperature", 1.5, "--top-p", 1, "--max-new-tokens", 24)
        first = run_json(*args, "--seed", 7)
        assert run_json(*args, "--seed", 7)["token_ids"] == first["token_ids"]
        others = [run_json(*args, "--seed", s)["token_ids"] for s in (8, 9, 10)]
        assert any(o != first["token_ids"] for o in others)


@pytest.fixture
def captured_bench(monkeypatch, tiny) -> list:
    """Records each Bench the bench command makes (which then runs for real on the tiny models)."""
    made = []

    def spy(pipe, config, rates=None):
        made.append(Bench(pipe, config, rates))
        return made[-1]

    monkeypatch.setattr(triforce_cli.cli.bench, "Bench", spy)
    return made


class TestBenchOptions:
    @pytest.mark.parametrize(("flags", "ignore_eos"), [((), False), (("--ignore-eos",), True)])
    def test_ignore_eos_reaches_the_bench_and_its_engines(self, prompt_file, captured_bench, flags, ignore_eos):
        args = ("bench", "-p", prompt_file, "--context", 64, "--max-new-tokens", 3, "--repeats", 1, "--warmup", 0)
        result = CliRunner().invoke(app, [*map(str, args), "--modes", "autoregressive", *flags])
        assert result.exit_code == 0, result.output
        (runner,) = captured_bench
        assert runner.config.ignore_eos is ignore_eos and runner.base_config.ignore_eos is ignore_eos
        assert BenchConfig().ignore_eos is False

    def test_ignore_eos_takes_no_value(self, prompt_file, tiny):
        result = CliRunner().invoke(app, ["bench", "-p", str(prompt_file), "--ignore-eos", "yes"])
        assert result.exit_code == 2 and "yes" in result.output  # an unexpected extra argument


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.usefixtures("tiny")
class TestGreedyModesAgree:
    ARGS = ("--max-new-tokens", 40, "--refresh-interval", 1, *GREEDY, *SMALL_CACHES)

    @pytest.fixture(scope="class")
    def reference(self, tmp_path_factory, tiny_models):
        """Greedy autoregressive continuation of PROMPT by the tiny target, computed without the CLI."""
        ids = tiny_models["tiny"].tokenizer(PROMPT).input_ids
        cfg = EngineConfig(mode="autoregressive", max_new_tokens=40, sampling=SamplingConfig(temperature=0))
        result = Engine(tiny_models["tiny"], cfg).generate(ids)
        assert len(set(result.token_ids)) > 3  # not a degenerate repetition of one token
        return result

    def test_autoregressive_cli_matches_engine(self, prompt_file, reference):
        data = run_json("-p", prompt_file, "--mode", "autoregressive", *self.ARGS)
        assert data["token_ids"] == reference.token_ids

    @pytest.mark.parametrize(
        "extra",
        [("--mode", "triforce"), ("--mode", "retrieval"), ("--mode", "streaming", "--draft", "drafter", "--no-ngram"),
         ("--mode", "triforce", "--draft", "drafter", "--gamma1", 3, "--no-ngram"), ("--mode", "triforce", "--ngram"),
         ("--mode", "triforce", "--draft", "drafter")],
        ids=["triforce", "retrieval", "streaming-drafter", "triforce-drafter", "triforce-ngram", "ngram-drafter"],
    )  # fmt: skip
    def test_speculative_text_equals_autoregressive(self, prompt_file, reference, extra):
        data = run_json("-p", prompt_file, *self.ARGS, *extra)
        assert data["token_ids"] == reference.token_ids
        result = invoke("-p", prompt_file, *self.ARGS, *extra)
        assert result.exit_code == 0, result.output
        assert result.stdout == reference.text + "\n"

    def test_drafts_are_both_accepted_and_rejected(self, prompt_file):
        """The exactness checks above exercise the rejection path of every tier, not only all-accepted rounds."""
        data = run_json("-p", prompt_file, *self.ARGS, "--mode", "triforce", "--gamma-policy", "fixed")
        tiers = data["acceptance"]  # the fixed policy passes every draft through all three tiers
        assert [(a["proposer"], a["verifier"]) for a in tiers] == [("retrieval", "target"), ("drafter", "retrieval")]
        for stats in tiers:
            assert 0 < stats["accepted"] < stats["drafted"], stats


# ---------------------------------------------------------------------------------------------- Ctrl-C


@pytest.mark.usefixtures("tiny")
class TestInterruptInProcess:
    @pytest.fixture
    def interrupt_after(self, monkeypatch, tiny_models):
        """Make the target model raise KeyboardInterrupt on its n-th forward (as Ctrl-C would)."""
        model = tiny_models["tiny"].model

        def arm(n):
            calls = {"n": 0}
            original = model.forward

            def forward(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] >= n:
                    raise KeyboardInterrupt
                return original(*args, **kwargs)

            monkeypatch.setattr(model, "forward", forward)

        return arm

    def test_partial_text_and_exit_130(self, prompt_file, interrupt_after):
        interrupt_after(6)
        result = invoke("-p", prompt_file, "--max-new-tokens", 200, "--mode", "autoregressive", *GREEDY)
        assert result.exit_code == INTERRUPTED_EXIT_CODE == 130
        assert isinstance(result.exception, SystemExit)
        assert result.stdout.strip()  # the tokens generated before Ctrl-C
        assert "interrupted" in result.stderr
        assert "Traceback" not in result.output

    def test_json_reports_interruption(self, prompt_file, interrupt_after):
        interrupt_after(6)
        result = invoke("-p", prompt_file, "--max-new-tokens", 200, "--mode", "autoregressive", "--json", *GREEDY)
        assert result.exit_code == 130
        data = json.loads(result.stdout)
        assert data["stop_reason"] == "interrupted"
        assert 0 < data["new_tokens"] < 200 and len(data["token_ids"]) == data["new_tokens"]


def test_ctrl_c_in_a_real_process(tiny_folder, tmp_path):
    """SIGINT while generating: partial text on stdout, 'interrupted' on stderr, exit code 130, no traceback."""
    prompt = tmp_path / "words.txt"
    prompt.write_text(" ".join(f"w{i % 31}" for i in range(20)))
    command = [
        sys.executable,
        "-c",
        # A shell starts background jobs with SIGINT ignored, and Python keeps an inherited SIG_IGN: restore the
        # KeyboardInterrupt handler, as a terminal user has it, whoever started the tests.
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from triforce_cli.cli.app import app; app()",
        "generate",
        "-p", str(prompt),
        "--target", str(tiny_folder),
        "--max-new-tokens", "60000",  # half a minute or more of work, so the signal lands mid-generation
        "--context-window", "64k",
        "--temperature", "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # cwd=tmp_path: `python -c` puts the working directory first on sys.path.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env)
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        seen = b""
        deadline = time.monotonic() + 120
        while not seen.strip() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            seen += proc.stdout.read() or b""
        assert seen.strip(), "no token reached stdout before the deadline"
        assert proc.poll() is None, "generation ended before it could be interrupted"
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        os.set_blocking(proc.stdout.fileno(), True)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = (seen + rest).decode(), err.decode()
    assert proc.returncode == 130, stderr
    assert stdout.split() and all(w.startswith("w") or w == "[UNK]" for w in stdout.split())
    assert "interrupted" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("tensor", ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight"])
def test_weight_of_the_wrong_shape_is_one_line(tiny_folder, word_prompt, tmp_path, tensor):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(tiny_folder, tmp_path / "reshaped")
    weights = load_file(folder / "model.safetensors")
    weights[tensor] = weights[tensor][:, :-1].contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert_one_error_line(invoke("-p", word_prompt, "--target", folder), "reshaped: its weights do not fit")


def test_a_deferred_watch_notes_ctrl_c_without_raising():
    """While the command line imports torch, Ctrl-C is only noted: raised inside a compiled module's initialisation
    it would abort the process (pybind11 cannot pass it on)."""
    import signal

    from triforce_cli.interrupts import InterruptWatch

    with InterruptWatch(deferred=True) as watch:
        signal.raise_signal(signal.SIGINT)
        still_running = True
    assert watch.seen and still_running
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt), InterruptWatch() as watch:
        signal.raise_signal(signal.SIGINT)


def test_sigterm_is_watched_like_ctrl_c_and_ends_with_143():
    """SIGTERM inside a watch raises KeyboardInterrupt as Ctrl-C does, and the command then ends with 128 + SIGTERM;
    the next command starts afresh, and a SIGTERM someone chose to ignore stays ignored."""
    with pytest.raises(KeyboardInterrupt), InterruptWatch() as watch:
        signal.raise_signal(signal.SIGTERM)
    assert watch.seen and interrupted_exit_code() == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with InterruptWatch():
        assert interrupted_exit_code() == INTERRUPTED_EXIT_CODE
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with InterruptWatch():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("delay", [0.3, 1.5, 3.0], ids=["importing", "loading", "later"])
def test_ctrl_c_at_any_moment_is_one_line(tiny_folder, tmp_path, delay):
    """SIGINT while Python imports torch, while the model loads, or while it prefills/generates: exit code 130 and
    no traceback, whatever the moment."""
    prompt = tmp_path / "words.txt"
    prompt.write_text(" ".join(f"w{i % 31}" for i in range(2000)))
    command = [
        sys.executable,
        "-c",
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from triforce_cli.__main__ import main"
        + "; main()",
        "generate", "-p", str(prompt), "--target", str(tiny_folder), "--max-new-tokens", "60000",
        "--context-window", "64k", "--temperature", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        time.sleep(delay)
        assert proc.poll() is None, "the command ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr, stderr


def test_a_checkpoints_own_code_never_runs_even_when_stdin_says_yes(tiny_folder, word_prompt, tmp_path):
    """A folder whose config and tokenizer name Python classes of its own (`auto_map`) is refused in one line:
    transformers' question whether to run that code is never asked, so a 'y' on stdin runs nothing."""
    folder = copy_folder(tiny_folder, tmp_path / "custom")
    marker = tmp_path / "ran"
    (folder / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'llama'\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    for file, auto_map in (
        ("config.json", {"AutoConfig": "custom_code.CustomConfig"}),
        ("tokenizer_config.json", {"AutoTokenizer": [None, "custom_code.CustomTokenizer"]}),
    ):
        settings = {**json.loads((folder / file).read_text()), "auto_map": auto_map}
        if file == "tokenizer_config.json":
            settings["tokenizer_class"] = "CustomTokenizer"  # no class of the library's: only the folder's code has it
        (folder / file).write_text(json.dumps(settings))
    result = invoke("-p", word_prompt, "--target", folder, "--max-new-tokens", 2, input="y\n" * 4)
    assert_one_error_line(result, "custom code")
    assert not marker.exists()


@pytest.mark.parametrize("root", ["a file", "under a file"])
def test_a_cache_root_that_cannot_be_a_folder_is_one_line_before_torch_imports(tmp_path, root):
    """torch makes its compiled-code caches' folders in the cache root as it imports: a root that cannot be a folder
    is said in one line first, not as that import's traceback."""
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    env = {**os.environ, "TRIFORCE_CACHE": str(file if root == "a file" else file / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "triforce_cli", "cache", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: the cache folder") and "TRIFORCE_CACHE" in lines[0]
