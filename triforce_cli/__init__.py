"""triforce-cli: lossless long-context speculative generation (TriForce, arXiv 2404.11912)."""

from triforce_cli.config import EngineConfig
from triforce_cli.pipeline import Pipeline
from triforce_cli.sampling import SamplingConfig
from triforce_cli.stats import GenerationResult, GenerationStats

__all__ = ["EngineConfig", "GenerationResult", "GenerationStats", "Pipeline", "SamplingConfig"]
