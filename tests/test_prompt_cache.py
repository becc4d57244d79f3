"""The prompt cache never serves a state that does not match its inputs, never loses a generation, and stays small.

Two checkpoints given by the same relative name from two folders, a flipped byte, a truncated file, a folder that
cannot be written to, a save that fails after the prefill, and the size limit with least-recently-used eviction;
`triforce cache list|clear`.
"""

import dataclasses
import json
import os
import time

import pytest
import torch
from helpers import save_word_checkpoint
from typer.testing import CliRunner

from triforce_cli.cli.app import app
from triforce_cli.cli.console import NOTE_INDENT
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.prompt_state import PromptCache, check_writable
from triforce_cli.errors import ConfigError
from triforce_cli.runtime import store
from triforce_cli.runtime.loading import load_model

GREEDY_SHORT = ("--max-new-tokens", 6, "--temperature", 0, "--mode", "autoregressive", "--json")


def generate(*args, input=None):
    return CliRunner().invoke(app, ["generate", *map(str, args)], input=input)


def json_run(*args) -> dict:
    result = generate(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


@pytest.fixture
def two_checkpoints(tmp_path):
    """Two different tiny checkpoints, each saved as a folder called 'model' in its own parent folder."""
    first = save_word_checkpoint(tmp_path / "a" / "model", seed=0)
    second = save_word_checkpoint(tmp_path / "b" / "model", seed=1)
    return first, second


@pytest.fixture
def words(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text(" ".join(f"w{i % 31}" for i in range(40)))
    return path


class TestEntriesMatchTheirInputs:
    def test_same_relative_name_for_two_models_shares_no_entry(self, two_checkpoints, words, tmp_path, monkeypatch):
        folder = tmp_path / "prompts"
        uncached = []
        for checkpoint in two_checkpoints:
            uncached.append(json_run("-p", words, "--target", checkpoint, *GREEDY_SHORT)["token_ids"])
        assert uncached[0] != uncached[1]  # the two models really differ
        for checkpoint, expected in zip(two_checkpoints, uncached):
            monkeypatch.chdir(checkpoint.parent)
            data = json_run("-p", words, "--target", "model", "--prompt-cache", folder, *GREEDY_SHORT)
            assert not data["prompt_cached"]  # the second model does not get the first one's prefill
            assert data["token_ids"] == expected
        assert len(list(folder.glob("*.safetensors"))) == 2

    @pytest.mark.parametrize("offload", ["none", "kv"])
    def test_a_saved_state_serves_a_run_whose_full_cache_is_offloaded(self, two_checkpoints, words, tmp_path, offload):
        """The saved keys and values are read and checked in host memory and copied to wherever the run's full
        cache lives (the device, or host memory offloaded): the reused run is the fresh one."""
        folder, args = tmp_path / "prompts", ("-p", words, "--target", two_checkpoints[0], *GREEDY_SHORT)
        fresh = json_run(*args, "--offload", offload, "--prompt-cache", folder)
        reused = json_run(*args, "--offload", offload, "--prompt-cache", folder)
        assert not fresh["prompt_cached"] and reused["prompt_cached"] and reused["token_ids"] == fresh["token_ids"]

    def test_states_hold_the_float16_cache_and_one_of_another_dtype_is_not_served(self, two_checkpoints, tmp_path):
        """A float32 model on the CPU saves its float16 keys and values, under a key that names that dtype; a state
        of another dtype, even under the right key and checksum, is prefilled again."""
        target = load_model(str(two_checkpoints[0]))
        notes = []
        cache = PromptCache(tmp_path / "prompts", target, status=notes.append, prefill_chunk=256)
        ids = list(range(1, 20))
        state = Engine(target, EngineConfig(mode="autoregressive", max_new_tokens=2)).prefill(ids)
        assert state.keys.dtype == state.values.dtype == torch.float16
        assert json.loads(cache.key(ids))["kv_dtype"] == "torch.float16"
        cache.save(state, ids)
        assert cache.load(ids) is not None and not notes
        cache.save(dataclasses.replace(state, keys=state.keys.float(), values=state.values.float()), ids)
        assert cache.load(ids) is None
        assert "holds keys and values in torch.float32, where the cache holds torch.float16" in notes[0]

    def test_weights_changed_in_place_miss_the_cache(self, two_checkpoints, words, tmp_path):
        first, second = two_checkpoints
        folder = tmp_path / "prompts"
        json_run("-p", words, "--target", first, "--prompt-cache", folder, *GREEDY_SHORT)
        (first / "model.safetensors").write_bytes((second / "model.safetensors").read_bytes())
        data = json_run("-p", words, "--target", first, "--prompt-cache", folder, *GREEDY_SHORT)
        assert not data["prompt_cached"]
        assert data["token_ids"] == json_run("-p", words, "--target", second, *GREEDY_SHORT)["token_ids"]

    def test_an_edited_config_misses_the_cache(self, two_checkpoints, words, tmp_path):
        """The weights and tokenizer unchanged, a setting of config.json that the forward reads changed: another
        model, whose prefill the saved one is not."""
        first = two_checkpoints[0]
        folder = tmp_path / "prompts"
        json_run("-p", words, "--target", first, "--prompt-cache", folder, *GREEDY_SHORT)
        config = json.loads((first / "config.json").read_text())
        (first / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
        data = json_run("-p", words, "--target", first, "--prompt-cache", folder, *GREEDY_SHORT)
        assert not data["prompt_cached"]
        assert data["token_ids"] == json_run("-p", words, "--target", first, *GREEDY_SHORT)["token_ids"]

    @pytest.mark.parametrize("damage", ["flip a byte", "truncate", "garbage"])
    def test_damaged_entry_is_prefilled_again_and_replaced(self, two_checkpoints, words, tmp_path, damage):
        checkpoint = two_checkpoints[0]
        folder = tmp_path / "prompts"
        args = (
            "-p",
            words,
            "--target",
            checkpoint,
            "--prompt-cache",
            folder,
            "--max-new-tokens",
            6,
            "--temperature",
            0,
        )
        expected = json_run(*args, "--json")
        (entry,) = folder.glob("*.safetensors")
        data = bytearray(entry.read_bytes())
        if damage == "flip a byte":
            data[-100] ^= 0x01  # inside the tensors, past the header
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data = bytearray(b"not a safetensors file")
        entry.write_bytes(bytes(data))
        result = generate(*args, "--mode", "autoregressive")
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output
        notes = [
            line for line in result.stderr.replace("\n" + NOTE_INDENT, " ").splitlines() if "prompt cache entry" in line
        ]
        assert len(notes) == 1 and "prefilling again" in notes[0], result.stderr
        assert result.stdout.split() == expected["text"].split()
        again = json_run(*args, "--json")
        assert again["prompt_cached"] and again["token_ids"] == expected["token_ids"]  # the entry was replaced

    @pytest.mark.parametrize("cut", ["logits", "layers", "positions"])
    def test_an_entry_of_other_shapes_with_its_own_checksum_is_prefilled_again(self, two_checkpoints, words, cut):
        """A file rewritten by hand, its checksum computed again, cannot serve tensors this model's forward does
        not make: a note, and the prompt prefilled again."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        from triforce_cli.decoding.prompt_state import _read_file

        folder = two_checkpoints[0].parent / "prompts"
        args = ("-p", words, "--target", two_checkpoints[0], "--prompt-cache", folder, *GREEDY_SHORT)
        expected = json_run(*args)
        (entry,) = folder.glob("prompt-*.safetensors")
        state, _ = _read_file(entry)
        with safe_open(str(entry), "pt") as handle:
            metadata = handle.metadata()
        changes = {
            "logits": {"last_logits": state.last_logits[:, :10]},
            "layers": {"keys": state.keys[:1], "values": state.values[:1]},
            "positions": {"keys": state.keys[:, :, :0], "values": state.values[:, :, :0]},
        }[cut]
        tampered = dataclasses.replace(state, **{name: t.contiguous() for name, t in changes.items()})
        tensors = {name: t.contiguous() for name, t in tampered.tensors.items()}
        save_file(tensors, entry, metadata={**metadata, "checksum": tampered.checksum()})
        data = json_run(*args)
        assert not data["prompt_cached"] and data["token_ids"] == expected["token_ids"]
        assert json_run(*args)["prompt_cached"]  # the entry replaced by a good one

    def test_key_holds_every_setting_that_shapes_the_state(self, two_checkpoints, monkeypatch):
        from dataclasses import replace

        from triforce_cli.decoding import prompt_state
        from triforce_cli.runtime.loading import load_model

        loaded = load_model(str(two_checkpoints[0]))
        base = PromptCache(two_checkpoints[0], loaded).path_for([1, 2, 3])
        assert PromptCache(two_checkpoints[0], loaded).path_for([1, 2, 4]) != base
        assert PromptCache(two_checkpoints[0], replace(loaded, weights="half")).path_for([1, 2, 3]) != base
        other = load_model(str(two_checkpoints[0]), context_window=8192)
        assert PromptCache(two_checkpoints[0], other).path_for([1, 2, 3]) != base
        bf16 = load_model(str(two_checkpoints[0]), dtype=torch.bfloat16)
        assert PromptCache(two_checkpoints[0], bf16).path_for([1, 2, 3]) != base
        assert PromptCache(two_checkpoints[0], loaded, prefill_chunk=64).path_for([1, 2, 3]) != base
        monkeypatch.setattr(prompt_state, "kernel_build", lambda: "triforce_cpu-0123456789abcdef.so")
        assert PromptCache(two_checkpoints[0], loaded).path_for([1, 2, 3]) != base  # other CPU kernels


class TestSharedPrefixes:
    """A prompt that starts like a saved one reuses the prefix it shares with it, whole prefill chunks (256 positions
    each on the CPU) and the part of a chunk after them: the saved state is found through the block hash index of
    its whole chunks, the shared length is the ids' own. The output is the fresh run's, token for token (past the
    whole chunks, resting on the numeric contract, test_numeric_contract.py)."""

    DOCUMENT = " ".join(f"w{i * 7 % 31}" for i in range(530))  # two whole chunks and 18 words

    @pytest.fixture
    def ask(self, two_checkpoints, tmp_path):
        def ask(document: str, question: str, checkpoint=two_checkpoints[0], cache=True, *more):
            prompt = tmp_path / "prompt.txt"
            prompt.write_text(f"{document} {question}")
            folder = ("--prompt-cache", tmp_path / "prompts") if cache else ()
            return json_run("-p", prompt, "--target", checkpoint, *folder, *GREEDY_SHORT, *more)

        return ask

    def test_a_second_question_about_a_saved_document_prefills_only_its_new_tokens(self, ask):
        assert ask(self.DOCUMENT, "w1 w2 w3")["reused_tokens"] == 0
        second = ask(self.DOCUMENT, "w4 w5")
        shared = second["prompt_tokens"] - 2  # the document's ids: 530 words, past two whole chunks
        assert second["reused_tokens"] == shared and shared % 256 and not second["prompt_cached"]
        assert second["token_ids"] == ask(self.DOCUMENT, "w4 w5", cache=False)["token_ids"]
        assert ask(self.DOCUMENT, "w4 w5")["prompt_cached"]  # saved whole, found whole

    def test_a_prompt_going_on_from_a_saved_answer_keeps_the_answer_too(self, ask, tmp_path):
        """After a generation the prompt's entry is saved again with the answer (all but its last token): a later
        prompt that goes on from the answer prefills only that token and its own, and the prompt alone is still
        served whole."""
        first = ask(self.DOCUMENT, "w1 w2 w3")
        answer = first["text"].strip()  # the word tokenizer: one word an id, the same ids again
        assert len(list((tmp_path / "prompts").glob("*.safetensors"))) == 1  # the prefill, saved again with the answer
        follow_up = ask(self.DOCUMENT, f"w1 w2 w3 {answer} w4")
        assert follow_up["reused_tokens"] == first["prompt_tokens"] + len(first["token_ids"]) - 1
        assert follow_up["token_ids"] == ask(self.DOCUMENT, f"w1 w2 w3 {answer} w4", cache=False)["token_ids"]
        again = ask(self.DOCUMENT, "w1 w2 w3")  # the prompt alone is still served whole, its logits saved
        assert again["prompt_cached"] and again["token_ids"] == first["token_ids"]

    def test_a_changed_document_or_another_model_reuses_nothing(self, ask, two_checkpoints):
        ask(self.DOCUMENT, "w1 w2 w3")
        changed = "w9 " + self.DOCUMENT.split(" ", 1)[1]
        assert ask(changed, "w4 w5")["reused_tokens"] == 0
        assert ask(self.DOCUMENT, "w4 w5", two_checkpoints[1])["reused_tokens"] == 0

    def test_a_damaged_entry_found_by_its_prefix_is_a_note_and_a_whole_prefill(self, ask, tmp_path, capsys):
        ask(self.DOCUMENT, "w1 w2 w3")
        (entry,) = (tmp_path / "prompts").glob("*.safetensors")
        data = bytearray(entry.read_bytes())
        data[-100] ^= 0x01
        entry.write_bytes(bytes(data))
        prompt = tmp_path / "prompt.txt"
        prompt.write_text(f"{self.DOCUMENT} w4 w5")
        args = ("-p", prompt, "--target", tmp_path / "a" / "model", "--prompt-cache", tmp_path / "prompts")
        result = generate(*args, *GREEDY_SHORT[:-1])  # text and notes, not JSON
        assert result.exit_code == 0 and "Traceback" not in result.output
        notes = result.stderr.replace("\n" + NOTE_INDENT, " ")
        assert "checksum does not match" in notes and "prefilling the prompt whole" in notes, notes
        assert "kept from" not in notes
        assert result.stdout.split() == ask(self.DOCUMENT, "w4 w5", cache=False)["text"].split()

    def test_the_index_is_read_instead_of_the_saved_states(self, ask, tmp_path, monkeypatch):
        for question in ("w1", "w2 w3", "w4 w5 w6"):
            ask(self.DOCUMENT, question)
        opened = []
        real = PromptCache._read
        monkeypatch.setattr(PromptCache, "_read", lambda self, path, *a: opened.append(path) or real(self, path, *a))
        assert ask(self.DOCUMENT, "w7")["reused_tokens"] > 512
        assert len(opened) == 1  # the one state reused, none of the others


class TestNothingIsLost:
    def test_folder_that_cannot_be_written_is_refused_before_loading(self, two_checkpoints, words, tmp_path):
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        result = generate("-p", words, "--target", two_checkpoints[0], "--prompt-cache", blocker / "prompts")
        assert result.exit_code == 1 and "Traceback" not in result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and "--prompt-cache" in lines[0], result.stderr
        assert "converting" not in result.stderr and result.stdout == ""

    def test_the_library_names_the_setting(self, tmp_path):
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        with pytest.raises(ConfigError, match="^`prompt_cache` .* is not a folder that can be written to"):
            check_writable(blocker / "prompts")

    @pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
    def test_read_only_folder_is_refused(self, two_checkpoints, words, tmp_path):
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        result = generate("-p", words, "--target", two_checkpoints[0], "--prompt-cache", folder)
        assert result.exit_code == 1 and "--prompt-cache" in result.stderr

    def test_a_save_that_fails_after_the_prefill_warns_and_generates_on(
        self, two_checkpoints, words, tmp_path, monkeypatch
    ):
        from triforce_cli.decoding import prompt_state

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(prompt_state, "save_file", full_disk)
        folder = tmp_path / "prompts"
        args = ("-p", words, "--target", two_checkpoints[0], "--max-new-tokens", 6, "--temperature", 0)
        result = generate(*args, "--prompt-cache", folder)
        assert result.exit_code == 0, result.output
        warnings = [
            line for line in result.stderr.replace("\n" + NOTE_INDENT, " ").splitlines() if "could not save" in line
        ]
        assert len(warnings) == 1 and "No space left" in warnings[0]
        assert f"--prompt-cache {folder}" in warnings[0]  # the library's `prompt_cache`, as the flag
        assert result.stdout.split() == json_run(*args, "--json")["text"].split()
        assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.partial"))

    @pytest.mark.parametrize("written", ["half", "whole"])
    def test_a_save_killed_before_its_rename_is_never_served(
        self, two_checkpoints, words, tmp_path, monkeypatch, written
    ):
        """What SIGKILL during a save leaves (tests/test_processes.py kills real runs): the entry's bytes, half or
        all of them, under a partial name of that save's own. The next run prefills again, saves the entry and
        gives the same output; `cache list` shows the entry only."""
        folder = tmp_path / "prompts"
        args = ("-p", words, "--target", two_checkpoints[0], "--prompt-cache", folder, *GREEDY_SHORT)
        first = json_run(*args)
        (entry,) = folder.glob("*.safetensors")
        content = entry.read_bytes()
        left = store.partial_path(entry)
        left.write_bytes(content if written == "whole" else content[: len(content) // 2])
        entry.unlink()
        again = json_run(*args)
        assert not again["prompt_cached"] and again["token_ids"] == first["token_ids"]
        assert entry.is_file() and left.exists()  # saved anew; a fresh partial may be another run's write
        monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
        listed = CliRunner().invoke(app, ["cache", "list", "--prompt-cache", str(folder)], env={"COLUMNS": "200"})
        assert listed.exit_code == 0 and listed.stdout.count("prompt-") == 1, listed.output


class TestSizeLimit:
    def test_least_recently_used_entries_go_first(self, tmp_path):
        folder = tmp_path / "prompts"
        folder.mkdir()
        for age, name in enumerate(["newest", "middle", "oldest"]):
            (folder / name).write_bytes(b"x" * 100)
            os.utime(folder / name, (1_000_000 - age * 10, 1_000_000 - age * 10))
        (folder / "written").write_bytes(b"x" * 100)
        store.mark_used(folder / "written")
        store.mark_used(folder / "oldest")  # used again: now the most recent but for the new entry
        removed = store.evict(folder, keep=folder / "written", limit=250)
        assert [e.path.name for e in removed] == ["middle", "newest"]
        assert sorted(p.name for p in folder.iterdir()) == ["oldest", "written"]

    def test_the_entry_just_written_stays_even_over_the_limit(self, tmp_path):
        folder = tmp_path / "prompts"
        folder.mkdir()
        (folder / "big").write_bytes(b"x" * 1000)
        assert store.evict(folder, keep=folder / "big", limit=10) == []
        assert store.evict(folder, keep=folder / "big", limit=0) == []  # 0: no limit

    def test_partials_left_by_a_killed_process_go_after_a_day_fresh_ones_stay(self, tmp_path):
        """A killed writer's partial is removed by the next eviction once it is a day old, whatever the limit; a
        younger one may be another process's write in progress."""
        folder = tmp_path / "prompts"
        folder.mkdir()
        (folder / "entry").write_bytes(b"x" * 100)
        stale_file = store.partial_path(folder / "entry")
        stale_file.write_bytes(b"half")
        stale_folder = store.partial_path(folder / "model")
        (stale_folder / "weights").mkdir(parents=True)
        fresh = store.partial_path(folder / "entry")
        fresh.write_bytes(b"being written")
        day_and_a_bit = time.time() - store.STALE_PARTIAL_SECONDS - 60
        for path in (stale_file, stale_folder):
            os.utime(path, (day_and_a_bit, day_and_a_bit))
        os.utime(fresh, (time.time() - store.STALE_PARTIAL_SECONDS + 60,) * 2)  # a minute short of a day
        assert store.evict(folder, keep=folder / "entry", limit=0) == []  # no entry removed: only partials
        assert sorted(p.name for p in folder.iterdir()) == ["entry", fresh.name]

    def test_limit_from_the_environment(self, monkeypatch):
        monkeypatch.setenv(store.LIMIT_VARIABLE, "1.5G")
        assert store.cache_limit() == int(1.5 * 2**30)
        monkeypatch.setenv(store.LIMIT_VARIABLE, "500M")
        assert store.cache_limit() == 500 * 2**20
        monkeypatch.delenv(store.LIMIT_VARIABLE)
        assert store.cache_limit() == store.DEFAULT_LIMIT

    @pytest.mark.parametrize("text", ["lots", "-1G", "infG", "nan"])
    def test_unreadable_limit_is_one_line(self, monkeypatch, tmp_path, words, text):
        monkeypatch.setenv(store.LIMIT_VARIABLE, text)
        monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
        result = CliRunner().invoke(app, ["cache", "list"])
        assert result.exit_code == 1 and store.LIMIT_VARIABLE in result.stderr and "Traceback" not in result.output

    def test_generate_evicts_beyond_the_limit(self, two_checkpoints, words, tmp_path, monkeypatch):
        folder = tmp_path / "prompts"
        base = ("--target", two_checkpoints[0], "--prompt-cache", folder, *GREEDY_SHORT)
        json_run("-p", words, *base)
        (entry,) = folder.glob("*.safetensors")
        monkeypatch.setenv(store.LIMIT_VARIABLE, str(entry.stat().st_size + 1))
        other = tmp_path / "other.txt"
        other.write_text(" ".join(f"w{(7 * i) % 31}" for i in range(40)))
        json_run("-p", other, *base)
        assert [p.name for p in folder.glob("*.safetensors")] != [entry.name]
        assert len(list(folder.glob("*.safetensors"))) == 1

    def test_the_users_own_files_in_the_folder_are_never_evicted(self, two_checkpoints, words, tmp_path, monkeypatch):
        """A --prompt-cache folder is the user's: the limit counts and evicts saved prefills only."""
        folder = tmp_path / "prompts"
        (folder / "project").mkdir(parents=True)
        (folder / "project" / "notes.txt").write_text("mine")
        (folder / "draft.partial").write_text("mine too")
        old = time.time() - store.STALE_PARTIAL_SECONDS - 60
        os.utime(folder / "draft.partial", (old, old))
        monkeypatch.setenv(store.LIMIT_VARIABLE, "1")  # past the limit with any entry at all
        json_run("-p", words, "--target", two_checkpoints[0], "--prompt-cache", folder, *GREEDY_SHORT)
        assert (folder / "project" / "notes.txt").read_text() == "mine"
        assert (folder / "draft.partial").read_text() == "mine too"
        assert len(list(folder.glob("prompt-*.safetensors"))) == 1


class TestCacheCommand:
    def test_list_and_clear(self, two_checkpoints, words, tmp_path, monkeypatch):
        monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
        prompts = tmp_path / "cache" / "prompts"
        other = tmp_path / "elsewhere"
        for folder in (prompts, other):
            json_run("-p", words, "--target", two_checkpoints[0], "--prompt-cache", folder, *GREEDY_SHORT)
        listed = CliRunner().invoke(app, ["cache", "list", "--prompt-cache", str(other)], env={"COLUMNS": "200"})
        assert listed.exit_code == 0, listed.output
        assert listed.stdout.count("prompt-") == 2 and "KiB" in listed.stdout
        cleared = CliRunner().invoke(app, ["cache", "clear", "--prompts"])
        assert cleared.exit_code == 0 and "removed 1 entries" in cleared.stderr
        assert not list(prompts.iterdir())
        assert sorted(path.name.split("-")[0] for path in other.iterdir()) == [".prefix", "prompt"]  # entry, index
        (other / "thesis.txt").write_text("mine")
        (other / "sub").mkdir()
        cleared = CliRunner().invoke(app, ["cache", "clear", "--prompts", "--prompt-cache", str(other)])
        assert cleared.exit_code == 0 and "removed 1 entries" in cleared.stderr
        assert sorted(path.name for path in other.iterdir()) == ["sub", "thesis.txt"]

    def test_compiled_steps_are_listed_and_cleared_apart(self, tmp_path, monkeypatch):
        """torch inductor's caches of compiled decode steps (store.compiled_folder) are cache entries like the
        others: listed, cleared by --compiled alone, left alone by --prompts."""
        monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
        compiled = tmp_path / "cache" / "inductor"
        (compiled / "fxgraph").mkdir(parents=True)
        (compiled / "fxgraph" / "entry").write_bytes(b"x" * 2048)
        listed = CliRunner().invoke(app, ["cache", "list"], env={"COLUMNS": "200"})
        assert listed.exit_code == 0 and "compiled steps in" in listed.stdout and "fxgraph" in listed.stdout
        assert CliRunner().invoke(app, ["cache", "clear", "--prompts"]).exit_code == 0
        assert (compiled / "fxgraph").exists()
        cleared = CliRunner().invoke(app, ["cache", "clear", "--compiled"])
        assert cleared.exit_code == 0 and "removed 1 entries, 2.0 KiB" in cleared.stderr
        assert not list(compiled.iterdir())
