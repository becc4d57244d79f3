"""The newer families through the command line as a user runs them: a saved Qwen3 checkpoint and a Phi-3 one (its
LongRoPE long set, the context passing original_max_position_embeddings) go through `triforce generate` in every
mode with autoregressive's greedy tokens, and through `triforce bench`, whose every row matches autoregressive."""

import json

import pytest
from helpers import save_tokenizer
from test_model import qwen3
from test_phi3 import ORIGINAL, phi3
from typer.testing import CliRunner

from triforce_cli.cli.app import app

SETTINGS = ["--chunk-size", 8, "--budget", 32, "--draft-window", 16, "--sink-tokens", 4, "--draft", "self"]


@pytest.fixture(scope="module", params=["qwen3", "phi3"])
def family_checkpoint(request, tmp_path_factory):
    """(the checkpoint folder, a prompt file of its word-level tokens)."""
    cfg, ref = {"qwen3": qwen3, "phi3": phi3}[request.param](seed=3)
    folder = tmp_path_factory.mktemp(request.param) / request.param
    ref.save_pretrained(folder)
    save_tokenizer(folder, cfg.vocab_size)
    prompt = folder.parent / "prompt.txt"
    words = 2 * ORIGINAL if request.param == "phi3" else 96  # Phi-3: past its original context, the long set
    prompt.write_text(" ".join(f"w{(7 * i) % (cfg.vocab_size - 2)}" for i in range(words)))
    return folder, prompt


def run(*args) -> dict:
    result = CliRunner().invoke(app, list(map(str, args)))
    assert result.exit_code == 0, result.output
    return result


def test_generate_every_mode_gives_the_autoregressive_tokens(family_checkpoint):
    folder, prompt = family_checkpoint

    def tokens(mode: str) -> list[int]:
        result = run("generate", "--target", folder, "-p", prompt, "--temperature", 0, "--max-new-tokens", 24,
                     "--ignore-eos", "--mode", mode, "--json", *SETTINGS)  # fmt: skip
        return json.loads(result.stdout.splitlines()[-1])["token_ids"]

    expected = tokens("autoregressive")
    assert len(expected) == 24 and len(set(expected)) > 3
    for mode in ("retrieval", "streaming", "triforce"):
        assert tokens(mode) == expected, mode


def test_bench_rows_match_autoregressive(family_checkpoint, tmp_path):
    folder, prompt = family_checkpoint
    out = tmp_path / "rows.json"
    run("bench", "--target", folder, "-p", prompt, "--context", 96, "--max-new-tokens", 8, "--ignore-eos",
        "--repeats", 1, "--warmup", 0, "--modes", "autoregressive,retrieval,triforce", "--out", out, *SETTINGS)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["autoregressive", "retrieval", "triforce"]
    assert all(row["matches_autoregressive"] for row in rows)
