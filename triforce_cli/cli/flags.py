"""Library messages in command-line words: each backticked setting becomes the flag that sets it.

The library is used from Python too, so its errors and notes name a setting by its Python keyword in backticks
(LoadOptions', EngineConfig's and SamplingConfig's fields, generate's keyword arguments, DistillConfig's and
BenchConfig's fields): "use `weights` dense", "`offload` kv+weights runs eager steps: use `steps` eager".
Only the command line knows its flags; console.py passes every error and note through flag_text, which reads those
as "use --weights dense" and "--offload kv+weights runs eager steps: use --steps eager". A backticked name that is no
setting here (`triforce info`, a setting without a flag) is left as it is.
"""

import re

# Setting (Python keyword) -> the flag that sets it. tests/test_flags.py checks each is an option of some command.
FLAGS = {
    # LoadOptions
    "target": "--target",
    "draft": "--draft",
    "dtype": "--dtype",
    "device": "--device",
    "weights": "--weights",
    "context_window": "--context-window",
    "attention": "--attention",
    "steps": "--steps",
    "threads": "--threads",
    # EngineConfig
    "mode": "--mode",
    "budget": "--budget",
    "chunk_size": "--chunk-size",
    "chunk_score": "--chunk-score",
    "sink_tokens": "--sink-tokens",
    "draft_window": "--draft-window",
    "gamma1": "--gamma1",
    "gamma2": "--gamma2",
    "gamma_policy": "--gamma-policy",
    "max_new_tokens": "--max-new-tokens",
    "refresh_interval": "--refresh-interval",
    "ngram": "--ngram",
    "ignore_eos": "--ignore-eos",
    "offload": "--offload",
    "on_chip_layers": "--on-chip-layers",
    # SamplingConfig
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    # Pipeline.generate and ChatSession.prefill
    "chat": "--chat",
    "prompt_cache": "--prompt-cache",
    # BenchConfig
    "modes": "--modes",
    "contexts": "--context",
    "budgets": "--budget",
    "chunk_sizes": "--chunk-size",
    "gamma_policies": "--gamma-policy",
    "forward_tokens": "--forward-costs",
    "repeats": "--repeats",
    "warmup": "--warmup",
    # DistillConfig
    "data": "--data",
    "builtin": "--builtin",
    "init_layers": "--init-layers",
    "init_from": "--init-from",
    "draft_vocab": "--draft-vocab",
    "self_generate": "--self-generate",
    "self_temperature": "--self-temperature",
    "seq_len": "--seq-len",
    "batch_size": "--batch-size",
    "learning_rate": "--learning-rate",
    "max_steps": "--max-steps",
    "held_out_windows": "--held-out-windows",
    "held_out_text": "--held-out",
    "eval_every": "--eval-every",
    "acceptance_temperature": "--acceptance-temperature",
    "save_dtype": "--save-dtype",
    # Distiller (where the drafter is written, and whether to go on from its checkpoint)
    "out": "--out",
    "resume": "--resume",
    # plan.presets.with_figures
    "gpus": "--gpus",
}

# A switch given a value: "`ngram` False" is --no-ngram, not "--ngram False". Read before FLAGS.
PHRASES = {
    "`ngram` True": "--ngram",
    "`ngram` False": "--no-ngram",
    "`chat` True": "--chat",
    "`chat` False": "no --chat",
    "`ignore_eos` True": "--ignore-eos",
    "`ignore_eos` False": "no --ignore-eos",
}

SETTING = re.compile("|".join(re.escape(phrase) + r"\b" for phrase in PHRASES) + r"|`([A-Za-z_][A-Za-z0-9_]*)`")


def flag_text(message: str) -> str:
    """message with each backticked setting (or switch phrase) of PHRASES and FLAGS replaced by its flag."""

    def replace(match: re.Match) -> str:
        text = match.group(0)
        if text in PHRASES:
            return PHRASES[text]
        return FLAGS.get(match.group(1), text)

    return SETTING.sub(replace, message)
