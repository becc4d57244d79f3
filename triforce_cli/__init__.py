"""triforce-cli: lossless long-context speculative generation (TriForce, arXiv 2404.11912).

The library API, imported on first use so that the command line starts (and answers Ctrl-C) before torch loads:

    from triforce_cli import EngineConfig, LoadOptions, Pipeline, SamplingConfig
"""

import importlib

_EXPORTS = {
    "ChatSession": "triforce_cli.decoding.chat",
    "EngineConfig": "triforce_cli.decoding.config",
    "GenerationResult": "triforce_cli.decoding.stats",
    "GenerationStats": "triforce_cli.decoding.stats",
    "LoadOptions": "triforce_cli.decoding.setup",
    "Pipeline": "triforce_cli.decoding.pipeline",
    "SamplingConfig": "triforce_cli.decoding.sampling",
}
__all__ = [
    "ChatSession",
    "EngineConfig",
    "GenerationResult",
    "GenerationStats",
    "LoadOptions",
    "Pipeline",
    "SamplingConfig",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'triforce_cli' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
