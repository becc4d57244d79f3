"""`triforce distill`: the top-K loss, the draft vocabulary, training, checkpoints and resume, the written folder
(loaded beside its target, refused beside another), greedy equality with it as the drafter, CLI errors, and files
that are never unpickled."""

import json
import pathlib
import pickle
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import full_cache_for, save_checkpoint
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from triforce_cli.cli.app import app
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline, drafter_spec
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.distill.data import RECORD_KEY, TeacherTargets, text_windows
from triforce_cli.distill.trainer import (
    CHECKPOINT_NAME,
    PICKLED_CHECKPOINT_NAME,
    WORK_FOLDER,
    DistillConfig,
    Distiller,
    DistillProgress,
    DistillResult,
    frequent_tokens,
    load_teacher,
    read_checkpoint,
    topk_distillation_loss,
)
from triforce_cli.errors import ConfigError, ModelLoadError
from triforce_cli.runtime.embedded import EMBEDDED_NAME
from triforce_cli.runtime.loading import DRAFTER_METADATA, load_model

VOCAB = 32  # w0..w29, <unk>, <eos>
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_topk_loss_is_the_weighted_log_likelihood_of_the_targets_top_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10)
    teacher = torch.log_softmax(torch.randn(2, 3, 10), dim=-1)
    top_logp, top_ids = teacher.topk(4, dim=-1)
    draft_logp = torch.log_softmax(logits, dim=-1)
    expected = (
        -sum(
            top_logp[b, t, k].exp() * draft_logp[b, t, top_ids[b, t, k]]
            for b in range(2)
            for t in range(3)
            for k in range(4)
        )
        / 6
    )
    torch.testing.assert_close(topk_distillation_loss(logits, top_ids, top_logp), expected)


def test_topk_loss_over_the_whole_vocabulary_is_cross_entropy_minimised_by_the_target():
    torch.manual_seed(1)
    teacher_logits = torch.randn(1, 5, 8)
    logp = torch.log_softmax(teacher_logits, dim=-1)
    ids = torch.arange(8).expand(1, 5, 8)
    at_target = topk_distillation_loss(teacher_logits, ids, logp)
    torch.testing.assert_close(at_target, -(logp.exp() * logp).sum(-1).mean())  # the target's entropy
    for seed in range(10, 15):  # other distributions than the target's (seeded apart from it)
        other = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(seed))
        assert topk_distillation_loss(other, ids, logp) > at_target


def test_topk_loss_leaves_out_tokens_the_drafter_cannot_propose():
    logits = torch.tensor([[[0.0, 1.0, 2.0]]])
    logp = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    with_missing = topk_distillation_loss(logits, torch.tensor([[[2, -1, 0]]]), logp)
    draft_logp = torch.log_softmax(logits[0, 0], dim=-1)
    torch.testing.assert_close(with_missing, -(0.5 * draft_logp[2] + 0.2 * draft_logp[0]))


def test_frequent_tokens_keeps_the_most_frequent_and_the_required_ids():
    windows = torch.tensor([[5, 5, 5, 3, 3, 1], [5, 3, 7, 7, 7, 7]])
    assert frequent_tokens(windows, 10, 3, always={9}).tolist() == [5, 7, 9]
    assert frequent_tokens(windows, 10, 2, always=set()).tolist() == [5, 7]


def test_config_validation():
    with pytest.raises(ConfigError, match="training text"):
        DistillConfig()
    with pytest.raises(ConfigError, match="`init_layers`"):
        DistillConfig(builtin=("stdlib-train",), init_layers=())
    with pytest.raises(ConfigError, match="`draft_vocab`"):
        DistillConfig(builtin=("stdlib-train",), draft_vocab=-1)
    with pytest.raises(ConfigError, match="`save_dtype`"):
        DistillConfig(builtin=("stdlib-train",), save_dtype="int8")


# --- training on a tiny target ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-target"
    save_checkpoint(folder, seed=3, num_layers=3, vocab_size=VOCAB)
    return folder


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Word text with structure a drafter can learn: runs of rising word numbers."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 20, (400,), generator=generator).tolist()
    words = [f"w{start + step}" for start in starts for step in range(8)]
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text(" ".join(words))
    return path


def tiny_config(text_file, **changes) -> DistillConfig:
    settings = {
        "data": (str(text_file),), "init_layers": (0, 2), "seq_len": 16, "batch_size": 4, "max_steps": 12,
        "eval_every": 4, "held_out_windows": 4, "learning_rate": 3e-3, "warmup_steps": 2, "draft_vocab": 0,
    }  # fmt: skip
    return DistillConfig(**{**settings, **changes})


def distill(target_folder, out, config, resume=False, on_progress=lambda event: None):
    checkpoint, teacher, tokenizer = load_teacher(str(target_folder))
    distiller = Distiller(config, teacher, tokenizer, checkpoint, out, resume=resume)
    return distiller, distiller.run(on_progress)


def test_training_lowers_the_loss_and_raises_held_out_acceptance(target_folder, text_file, tmp_path):
    config = tiny_config(text_file, max_steps=40, eval_every=5)
    events = []
    _, result = distill(target_folder, tmp_path / "d", config, on_progress=events.append)
    assert result.finished and result.steps == 40 and result.tokens == 40 * 4 * 16
    train = [e for e in events if e.phase == "train"]
    assert [e.done for e in train] == list(range(1, 41))
    assert sum(e.loss for e in train[-5:]) < sum(e.loss for e in train[:5])
    assert {e.phase for e in events} == {"teacher", "train"}
    assert [h["step"] for h in result.history] == [5, 10, 15, 20, 25, 30, 35, 40]
    first, last = result.history[0], result.history[-1]
    assert last["acceptance"] > first["acceptance"] + 0.05
    assert [e.acceptance is not None for e in train] == [e.done % 5 == 0 for e in train]
    assert not (tmp_path / "d" / CHECKPOINT_NAME).exists()  # finished: nothing left to resume


def test_written_folder_loads_beside_its_target_only(target_folder, text_file, tmp_path):
    out = tmp_path / "drafter"
    distiller, _ = distill(target_folder, out, tiny_config(text_file, save_dtype="float16"))
    tensors = load_file(out / "model.safetensors")
    assert "model.embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    assert all(t.dtype == torch.float16 for t in tensors.values())
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config[DRAFTER_METADATA]["target"] == "tiny-target"
    assert (out / "tokenizer.json").is_file()

    target = load_model(str(target_folder))
    drafter = load_model(str(out), shared_from=target)
    shared, own = drafter.model.model.embed_tokens, target.model.model.embed_tokens
    assert shared is own or shared.weight is own.weight  # the table held once (a tiled one is the target's module)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.inference_mode():
        expected = distiller.drafter.eval()(ids).logits[0]
    cache = full_cache_for(drafter.model, 16)
    torch.testing.assert_close(drafter.model.forward(ids[0], 0, cache), expected, atol=2e-2, rtol=1e-2)

    with pytest.raises(ModelLoadError, match="borrows its embeddings"):
        load_model(str(out))
    other_folder = tmp_path / "other-target"
    save_checkpoint(other_folder, seed=4, num_layers=3, vocab_size=VOCAB)
    with pytest.raises(ModelLoadError, match="not those of other-target"):
        load_model(str(out), shared_from=load_model(str(other_folder)))


def test_draft_vocabulary_restricts_proposals_and_greedy_output_stays_exact(target_folder, text_file, tmp_path):
    out = tmp_path / "small-vocab"
    distill(target_folder, out, tiny_config(text_file, draft_vocab=12))
    output_ids = json.loads((out / "config.json").read_text())[DRAFTER_METADATA]["output_ids"]
    assert len(output_ids) == 12 and VOCAB - 1 in output_ids  # the end-of-sequence token always stays
    target = load_model(str(target_folder))
    drafter = load_model(str(out), shared_from=target)
    cache = full_cache_for(drafter.model, 16)
    logits = drafter.model.forward(torch.tensor([1, 2, 3]), 0, cache)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[output_ids] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()

    prompt = target.tokenizer(" ".join(f"w{i % 25}" for i in range(60))).input_ids
    greedy = SamplingConfig(temperature=0)
    reference = Pipeline.load(
        LoadOptions(target=str(target_folder)),
        config=EngineConfig(mode="autoregressive", sampling=greedy, max_new_tokens=24, budget=32, chunk_size=8),
    )
    expected = reference.generate_ids(prompt).token_ids
    for mode in ("triforce", "streaming"):
        # fixed lengths: every tier drafts, the restricted drafter included, whatever a policy would choose
        config = EngineConfig(mode=mode, sampling=greedy, max_new_tokens=24, budget=32, chunk_size=8, draft_window=16,
                              sink_tokens=4, ngram=False, gamma_policy="fixed")  # fmt: skip
        pipe = Pipeline.load(LoadOptions(target=str(target_folder), draft=str(out)), config=config)
        result = pipe.generate_ids(prompt)
        assert result.token_ids == expected, mode
        drafter_rows = [a for a in result.stats.acceptance if a.proposer == "drafter"]
        assert drafter_rows[0].drafted > 0  # drafter -> retrieval (triforce) or drafter -> target (streaming)


def interrupted_at_step_6(target_folder, out, config) -> tuple[Distiller, DistillResult]:
    """A run stopped by Ctrl-C after its sixth step, as the CLI stops it, and what stopping it reported."""

    def interrupt_at_step_6(event: DistillProgress):
        if event.phase == "train" and event.done == 6:
            raise KeyboardInterrupt

    checkpoint, teacher, tokenizer = load_teacher(str(target_folder))
    distiller = Distiller(config, teacher, tokenizer, checkpoint, out)
    with pytest.raises(KeyboardInterrupt):
        distiller.run(interrupt_at_step_6)
    return distiller, distiller.stop(interrupted=True)


def assert_same_weights(folder_a, folder_b):
    a, b = load_file(folder_a / "model.safetensors"), load_file(folder_b / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)


def assert_identical(a, b, where="state"):
    """a and b hold the same values of the same types, tensors equal in dtype, shape and every element."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


def test_interrupted_run_resumes_to_the_same_weights(target_folder, text_file, tmp_path):
    config = tiny_config(text_file)
    distill(target_folder, tmp_path / "straight", config)
    out = tmp_path / "resumed"
    interrupted, stopped = interrupted_at_step_6(target_folder, out, config)
    checkpoint, teacher, tokenizer = load_teacher(str(target_folder))
    assert (stopped.steps, stopped.finished, stopped.interrupted) == (6, False, True)
    assert (out / CHECKPOINT_NAME).is_file() and (out / "model.safetensors").is_file()
    assert not list(out.rglob("*.pt")) and not list(out.rglob("*.partial"))

    restored = Distiller(config, teacher, tokenizer, checkpoint, out, resume=True)
    restored._build(restored._windows(lambda event: None)[0])  # what run() does before its first step
    assert_identical(restored.optimizer.state_dict(), interrupted.optimizer.state_dict(), "optimizer")
    assert_identical(restored.drafter.state_dict(), interrupted.drafter.state_dict(), "drafter")
    assert (restored.step, restored.history, restored.output_ids) == (6, interrupted.history, None)
    assert stopped.seconds <= restored.seconds <= stopped.seconds + 1  # saved just after the report
    with pytest.raises(ConfigError, match="`resume`"):
        Distiller(config, teacher, tokenizer, checkpoint, out)
    with pytest.raises(ConfigError, match="other settings"):
        Distiller(tiny_config(text_file, top_k=3), teacher, tokenizer, checkpoint, out, resume=True)
    _, resumed = distill(target_folder, out, config, resume=True)
    assert resumed.finished and resumed.steps == 12
    assert_same_weights(tmp_path / "straight", out)


def test_self_generated_windows_join_the_training_data(target_folder, text_file, tmp_path):
    events = []
    distill(
        target_folder, tmp_path / "d", tiny_config(text_file, self_generate=3, max_steps=2), on_progress=events.append
    )
    generated = load_file(tmp_path / "d" / WORK_FOLDER / "self-generated.safetensors")["windows"]
    assert generated.shape == (3, 16)
    assert [e.done for e in events if e.phase == "self-generate"] == [3]


def test_held_out_text_measures_acceptance_apart_from_the_training_text(target_folder, text_file, tmp_path):
    falling = tmp_path / "falling.txt"  # runs of falling word numbers: unlike anything in the training text
    starts = torch.randint(8, 28, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    falling.write_text(" ".join(f"w{start - step}" for start in starts for step in range(8)))
    checkpoint, teacher, tokenizer = load_teacher(str(target_folder))
    config = tiny_config(text_file, held_out_text=(str(falling),), max_steps=40, eval_every=40)
    distiller = Distiller(config, teacher, tokenizer, checkpoint, tmp_path / "apart")
    train, held_out = distiller._windows(lambda event: None)
    real = text_windows(tokenizer, [text_file.read_text()], 16)
    assert sorted(map(tuple, train.tolist())) == sorted(map(tuple, real.tolist()))  # every window is trained on
    assert not torch.equal(train, real)  # shuffled: --self-generate seeds come from all over the text
    pool = text_windows(tokenizer, [falling.read_text()], 16, minimum=1)
    assert len(held_out) == 4 and all((pool == window).all(dim=1).any() for window in held_out)
    apart = distiller.run(lambda event: None).history[-1]["acceptance"]
    _, mixed = distill(target_folder, tmp_path / "mixed", tiny_config(text_file, max_steps=40, eval_every=40))
    assert apart < mixed.history[-1]["acceptance"] - 0.03  # the training text's own windows flatter the drafter


def test_held_out_text_must_not_be_training_text(text_file, tmp_path):
    with pytest.raises(ConfigError, match="`held_out_text` stdlib-train is also training text"):
        DistillConfig(builtin=("stdlib-train",), held_out_text=("stdlib-a", "stdlib-train"))
    same_file = f"{text_file.parent}/../{text_file.parent.name}/{text_file.name}"
    with pytest.raises(ConfigError, match="is also training text"):
        tiny_config(text_file, held_out_text=(same_file,))
    with pytest.raises(ConfigError, match="`held_out_text` stdlib-train-source is also training text"):
        DistillConfig(builtin=("stdlib-train",), held_out_text=("stdlib-train-source",))  # the same docstrings
    with pytest.raises(ConfigError, match="`held_out_text` stdlib-train is also training text"):
        DistillConfig(builtin=("stdlib-train-source",), held_out_text=("stdlib-train",))
    with pytest.raises(ConfigError, match="neither a file nor a built-in text"):
        tiny_config(text_file, held_out_text=("stdlib-c",))
    assert tiny_config(text_file, held_out_text=("stdlib-a",)).held_out_text == ("stdlib-a",)


def test_teacher_targets_are_saved_on_leaving_not_per_batch(target_folder, text_file, tmp_path, monkeypatch):
    _, teacher, tokenizer = load_teacher(str(target_folder))
    windows = text_windows(tokenizer, [text_file.read_text()], 16)[:20]
    path = tmp_path / "teacher-top-k.safetensors"
    saves, real_save = [], TeacherTargets._save
    monkeypatch.setattr(TeacherTargets, "_save", lambda targets: saves.append(targets.done) or real_save(targets))

    def interrupt_after_3_batches(done, total):
        if done == 12:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        TeacherTargets(windows, 5, path, "t").fill(teacher, 4, interrupt_after_3_batches)
    assert saves == [12]  # once, on leaving: no rewrite of the file per batch
    assert TeacherTargets(windows, 5, path, "another target").done == 0  # another target's top-K: computed again
    resumed = TeacherTargets(windows, 5, path, "t")
    assert resumed.done == 12
    resumed.fill(teacher, 4)
    whole = TeacherTargets(windows, 5, tmp_path / "whole.safetensors", "t")
    whole.fill(teacher, 4)
    assert saves == [12, 20, 20] and torch.equal(resumed.ids, whole.ids) and torch.equal(resumed.logp, whole.logp)
    monkeypatch.setattr(TeacherTargets, "SAVE_SECONDS", 0.0)
    TeacherTargets(windows, 5, tmp_path / "each.safetensors", "t").fill(teacher, 8)
    assert saves[3:] == [8, 16, 20] and not list(tmp_path.glob("*.partial"))  # due at every batch now


def test_max_minutes_zero_stops_before_training_and_resumes(target_folder, text_file, tmp_path):
    checkpoint, teacher, tokenizer = load_teacher(str(target_folder))
    out = tmp_path / "d"
    result = Distiller(tiny_config(text_file), teacher, tokenizer, checkpoint, out).run(lambda e: None, max_minutes=0)
    assert (result.steps, result.finished) == (0, False)
    assert (out / CHECKPOINT_NAME).is_file() and not (out / "model.safetensors").exists()
    _, resumed = distill(target_folder, out, tiny_config(text_file), resume=True)
    assert resumed.finished


def test_init_from_starts_from_an_earlier_drafter_with_its_vocabulary(target_folder, text_file, tmp_path):
    first = tmp_path / "first"
    distill(target_folder, first, tiny_config(text_file, draft_vocab=12))
    other_text = tmp_path / "other.txt"  # other words, so a vocabulary chosen afresh from it would differ
    other_text.write_text(" ".join(f"w{20 + i % 10}" for i in range(600)))
    again = tmp_path / "again"
    negligible = {"max_steps": 1, "warmup_steps": 1, "learning_rate": 1e-12}
    distill(target_folder, again, tiny_config(other_text, draft_vocab=12, init_from=str(first), **negligible))
    assert_same_weights(first, again)
    metadata = [json.loads((folder / "config.json").read_text())[DRAFTER_METADATA] for folder in (first, again)]
    assert metadata[1]["output_ids"] == metadata[0]["output_ids"]
    assert metadata[1]["distill"]["init_from"] == "first"
    fresh = tmp_path / "fresh"
    distill(target_folder, fresh, tiny_config(other_text, draft_vocab=12, **negligible))
    assert json.loads((fresh / "config.json").read_text())[DRAFTER_METADATA]["output_ids"] != metadata[0]["output_ids"]


def test_init_from_refuses_what_does_not_fit(target_folder, text_file, tmp_path):
    first = tmp_path / "first"
    distill(target_folder, first, tiny_config(text_file, draft_vocab=12))
    foreign = tmp_path / "foreign"
    shutil.copytree(first, foreign)
    settings = json.loads((foreign / "config.json").read_text())
    settings[DRAFTER_METADATA] |= {"target": "another-target", "embedding_sha256": "0" * 64}
    (foreign / "config.json").write_text(json.dumps(settings))
    checkpoint, teacher, tokenizer = load_teacher(str(target_folder))
    cases = [
        ({"init_from": str(tmp_path / "missing")}, "no readable config.json"),
        ({"init_from": str(target_folder)}, "is not a drafter folder written by triforce distill"),
        ({"init_from": str(foreign)}, "distilled for another-target; its embeddings are not those of tiny-target"),
        (
            {"init_from": str(first), "init_layers": (0, 1)},
            "started from target layers 0,2; pass `init_layers` 0,2",
        ),
        ({"init_from": str(first)}, "covers 12 output tokens; pass `draft_vocab` 12"),
    ]
    for changes, message in cases:
        with pytest.raises(ConfigError, match=message):
            Distiller(tiny_config(text_file, **changes), teacher, tokenizer, checkpoint, tmp_path / "out")


def test_init_from_run_resumes_from_its_checkpoint_alone(target_folder, text_file, tmp_path):
    """A resumed --init-from run takes weights and vocabulary from its checkpoint, even with the start gone."""
    first = tmp_path / "first"
    distill(target_folder, first, tiny_config(text_file, draft_vocab=12))
    start = tmp_path / "start"
    shutil.copytree(first, start)
    config = tiny_config(text_file, draft_vocab=12, init_from=str(start))
    distill(target_folder, tmp_path / "straight", config)
    out = tmp_path / "resumed"
    interrupted, _ = interrupted_at_step_6(target_folder, out, config)
    assert_identical(read_checkpoint(out / CHECKPOINT_NAME)["output_ids"], interrupted.output_ids, "output_ids")
    shutil.rmtree(start)
    _, resumed = distill(target_folder, out, config, resume=True)
    assert resumed.finished and resumed.steps == 12
    assert_same_weights(tmp_path / "straight", out)
    output_ids = [json.loads((f / "config.json").read_text())[DRAFTER_METADATA]["output_ids"] for f in (first, out)]
    assert output_ids[0] == output_ids[1]


def test_default_drafter_choice(tmp_path, monkeypatch):
    import triforce_cli.decoding.pipeline

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "config.json").write_text("{}")
    monkeypatch.setattr(triforce_cli.decoding.pipeline, "EMBEDDED_DRAFTER", shipped)
    embedded = SimpleNamespace(name=EMBEDDED_NAME, hf_config=SimpleNamespace(), weight_files=())
    other = SimpleNamespace(name="some/model", hf_config=SimpleNamespace(vocab_size=32, hidden_size=8), weight_files=())
    assert drafter_spec(embedded, None) == str(shipped)  # with or without the n-gram before it
    assert drafter_spec(embedded, "self") is None
    assert drafter_spec(other, None) is None
    assert drafter_spec(embedded, "mine") == "mine"


# --- the command line ---------------------------------------------------------------------------------------------


def run_cli(*args):
    return CliRunner().invoke(app, ["distill", *map(str, args)])


def test_cli_writes_a_drafter_that_generate_uses(target_folder, text_file, tmp_path):
    out = tmp_path / "cli-drafter"
    result = run_cli("--target", target_folder, "--data", text_file, "--builtin", "", "--out", out,
                     "--init-layers", "0,1", "--seq-len", 16, "--batch-size", 4, "--max-steps", 4, "--eval-every", 2,
                     "--held-out-windows", 2, "--draft-vocab", 0)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "held-out acceptance" in result.stderr and f"--draft {out}" in result.stderr
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{i % 20}" for i in range(40)))
    generated = CliRunner().invoke(app, ["generate", "-p", str(prompt), "--target", str(target_folder), "--draft",
                                         str(out), "--budget", "16", "--chunk-size", "8", "--max-new-tokens", "6",
                                         "--temperature", "0", "--json"])  # fmt: skip
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.stdout)["drafter"] == "n-gram prompt lookup (training-free), else cli-drafter"


@pytest.mark.parametrize(
    "args, message",
    [
        (("--builtin", ""), "training text"),
        (("--init-layers", "0,x"), "layer numbers"),
        (("--init-layers", "0,7"), "the target has 3"),
        (("--builtin", "novel"), "'novel': choose from"),
        (("--resume",), "nothing to resume"),
        (("--data", "/nonexistent/text.txt", "--builtin", ""), "does not exist"),
        (("--init-from", "/nonexistent/drafter"), "no readable config.json"),
        (("--held-out", "/nonexistent/held.txt"), "neither a file nor a built-in text"),
    ],
    ids=[
        "no-data",
        "bad-layers",
        "layer-out-of-range",
        "unknown-builtin",
        "nothing-to-resume",
        "missing-file",
        "missing-init-drafter",
        "missing-held-out-file",
    ],
)
def test_cli_errors_are_one_line(target_folder, tmp_path, args, message):
    result = run_cli("--target", target_folder, "--out", tmp_path / "d", *args)
    assert result.exit_code in (1, 2), result.output  # 2: a usage error, a value the option cannot read
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def assert_one_error_line(result, message):
    """The command failed with exit code 1 and one stderr line, an error naming message, not a traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert "Traceback" not in result.output


def cheap_run(target_folder, text_file, out, *args):
    """A few steps of `triforce distill` on the tiny target: the CLI's result."""
    return run_cli("--target", target_folder, "--data", text_file, "--builtin", "", "--out", out,
                   "--init-layers", "0,1", "--seq-len", 16, "--batch-size", 4, "--max-steps", 4, "--eval-every", 2,
                   "--held-out-windows", 2, "--draft-vocab", 0, *args)  # fmt: skip


# --- files that are never unpickled -------------------------------------------------------------------------------


class TouchOnUnpickling:
    """An object whose unpickling creates its marker file: what a planted pickle could run instead."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def plant_pickle(path: pathlib.Path, marker: pathlib.Path, saver: str = "torch") -> None:
    """Write at path a pickle whose loading creates marker: torch.save's zip of pickles, or a bare pickle."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": 6, "payload": TouchOnUnpickling(marker)}
    if saver == "torch":
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(state))


def test_a_planted_pickle_runs_its_payload_when_unpickled(tmp_path):
    plant_pickle(tmp_path / "planted.pt", tmp_path / "ran")
    torch.load(tmp_path / "planted.pt", weights_only=False)
    plant_pickle(tmp_path / "bare.pkl", tmp_path / "ran-too", saver="pickle")
    pickle.loads((tmp_path / "bare.pkl").read_bytes())
    assert (tmp_path / "ran").is_file() and (tmp_path / "ran-too").is_file()  # so no marker below: nothing unpickled


OLD_WORK_FILES = (f"{WORK_FOLDER}/self-generated.pt", f"{WORK_FOLDER}/teacher-top-k.pt")


@pytest.mark.parametrize(
    "planted, args, message",
    [
        ((PICKLED_CHECKPOINT_NAME, *OLD_WORK_FILES), ("--resume",), "written in an older format"),
        ((PICKLED_CHECKPOINT_NAME,), (), "cannot be read safely: start again with a new --out"),
        ((CHECKPOINT_NAME, *OLD_WORK_FILES), ("--resume",), "is not a file triforce distill wrote"),
        ((f"{WORK_FOLDER}/teacher-top-k.safetensors",), (), "is not a file triforce distill wrote: delete it"),
        ((f"{WORK_FOLDER}/self-generated.safetensors",), ("--self-generate", 2), "delete it to compute it again"),
    ],
    ids=["old-checkpoint-resumed", "old-checkpoint-started-over", "checkpoint", "teacher-targets", "self-generated"],
)
@pytest.mark.parametrize("saver", ["torch", "pickle"])
def test_a_planted_pickle_is_refused_in_one_line_unread(
    target_folder, text_file, tmp_path, planted, args, message, saver
):
    out, marker = tmp_path / "d", tmp_path / "ran"
    for name in planted:
        plant_pickle(out / name, marker, saver)
    assert_one_error_line(cheap_run(target_folder, text_file, out, *args), message)
    assert not marker.exists()


def test_work_files_of_the_older_format_are_never_read(target_folder, text_file, tmp_path):
    out, marker = tmp_path / "d", tmp_path / "ran"
    for name in OLD_WORK_FILES:
        plant_pickle(out / name, marker)
    result = cheap_run(target_folder, text_file, out, "--self-generate", 2)
    assert result.exit_code == 0, result.output
    assert not marker.exists()
    work = out / WORK_FOLDER
    assert load_file(work / "self-generated.safetensors")["windows"].shape == (2, 16)
    assert (work / "teacher-top-k.safetensors").is_file()


def truncated(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def without_record(path: pathlib.Path) -> None:
    save_file(load_file(path), path)


def with_record(record: str):
    """A change to a checkpoint: its tensors kept, its JSON record replaced by record."""
    return lambda path: save_file(load_file(path), path, metadata={RECORD_KEY: record})


@pytest.mark.parametrize(
    "damage, message",
    [
        (truncated, "is not a file triforce distill wrote"),
        (lambda path: path.write_bytes(b"\x00" * 64), "is not a file triforce distill wrote"),
        (lambda path: path.write_bytes(b""), "is not a file triforce distill wrote"),
        (without_record, "is not a file triforce distill wrote"),
        (with_record("{not json"), "is not a file triforce distill wrote"),
        (with_record("[1, 2]"), "is not a file triforce distill wrote"),
        (with_record('{"step": 6}'), "is not a checkpoint triforce distill wrote"),
    ],
    ids=["truncated", "zeros", "empty", "no-record", "record-not-json", "record-not-an-object", "record-incomplete"],
)
def test_an_unreadable_checkpoint_is_one_line(target_folder, text_file, tmp_path, damage, message):
    out = tmp_path / "d"
    stopped = cheap_run(target_folder, text_file, out, "--max-minutes", 0)
    assert stopped.exit_code == 0 and (out / CHECKPOINT_NAME).is_file(), stopped.output
    damage(out / CHECKPOINT_NAME)
    assert_one_error_line(cheap_run(target_folder, text_file, out, "--max-minutes", 0, "--resume"), message)


def test_no_module_loads_a_pickle():
    """Nothing the tool reads may run code: no source file of it unpickles, however it is spelled."""
    unpickling = re.compile(
        r"\btorch\.load\b|\bpickle\.loads?\b|\bUnpickler\b|weights_only\s*=\s*False|allow_pickle\s*=\s*True"
        r"|^\s*(import|from)\s+(c?pickle|dill|joblib)\b"
    )
    sources = [
        path for folder in ("triforce_cli", "cache", "kernels", "offload") for path in (ROOT / folder).rglob("*.py")
    ]
    assert len(sources) > 20 and ROOT / "triforce_cli" / "distill" / "trainer.py" in sources
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if unpickling.search(line)
    ]
    assert not found, "\n".join(found)
