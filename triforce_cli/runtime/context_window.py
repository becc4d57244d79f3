"""Contexts longer than a model was trained on, by YaRN RoPE scaling (Peng et al., 2023, arXiv 2309.00071).

``extend_context`` rewrites a transformers config in place, so the runtime, the transformers peers and the
drafter all read the same rotary setting from it: rope type ``yarn`` with factor window / trained context.
"""

from transformers import PretrainedConfig

from triforce_cli.errors import ConfigError


def trained_context(hf_config: PretrainedConfig) -> int:
    """The context length the model was trained on (before any scaling)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return int(rope.get("original_max_position_embeddings") or hf_config.max_position_embeddings)


def extend_context(hf_config: PretrainedConfig, window: int) -> float | None:
    """Make hf_config accept window positions; return the YaRN factor, or None where it already does."""
    if window < 1:
        raise ConfigError(f"context window must be positive, not {window}")
    if window <= hf_config.max_position_embeddings:
        return None
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(
            f"the model already scales RoPE ('{rope_type}', {hf_config.max_position_embeddings} tokens);"
            " `context_window` cannot extend it further"
        )
    original = hf_config.max_position_embeddings
    factor = window / original
    hf_config.rope_parameters = {
        **rope,
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
    }
    hf_config.max_position_embeddings = window
    return factor
