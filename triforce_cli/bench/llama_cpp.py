"""llama.cpp as a `triforce bench` peer: the CPU engine users would otherwise pick, through llama-cpp-python.

It decodes the target's own GGUF file in its stored (quantized) form, with the bench's thread count, sampling
settings and context window (YaRN where ``--context-window`` extends the model, as in context_window.py).
llama-cpp-python builds from source, so it is an optional extra; ``llama_cpp_available`` says whether it is here.
"""

import importlib.util
import time
from pathlib import Path

from transformers import PretrainedConfig

from triforce_cli.bench.peers import TimedRun
from triforce_cli.decoding.chat import shared_length
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.context_window import trained_context

LLAMA_CPP_PEER = "llama.cpp"
INSTALL_HINT = "pip install llama-cpp-python (it builds from source, about ten minutes on 2 cores)"


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_sampling_kwargs(sampling: SamplingConfig) -> dict:
    """Arguments of ``Llama.generate`` for the same distribution as ours: no min-p, typical-p or penalties."""
    common = {"min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}
    if sampling.greedy:
        return {**common, "temp": 0.0, "top_k": 1, "top_p": 1.0}
    return {**common, "temp": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def llama_cpp_rope_kwargs(hf_config: PretrainedConfig, llama_cpp) -> dict:
    """Context-extension arguments of ``Llama`` matching the runtime's RoPE setting (YaRN or none)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "yarn":
        return {}
    return {
        "rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
        "rope_freq_scale": 1.0 / rope["factor"],
        "yarn_orig_ctx": trained_context(hf_config),
    }


class LlamaCppPeer:
    """One llama.cpp context for the whole bench; prompts are prefilled once and reused across repeats."""

    def __init__(self, gguf: Path | None, hf_config: PretrainedConfig, threads: int):
        if not llama_cpp_available():
            raise ConfigError(f"the {LLAMA_CPP_PEER} peer needs llama-cpp-python: {INSTALL_HINT}")
        if gguf is None:
            raise ConfigError(f"the {LLAMA_CPP_PEER} peer needs a GGUF target (`target` file.gguf)")
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=hf_config.max_position_embeddings,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **llama_cpp_rope_kwargs(hf_config, llama_cpp),
        )
        self._prompt: list[int] | None = None
        self._cold_prefill_seconds = 0.0

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, eos_ids: set[int]
    ) -> TimedRun:
        """One timed run, stopping after max_new_tokens or at any of eos_ids (none: never). prefill_seconds is the
        cold prefill of this prompt (its first run): later runs reuse the prompt's KV cache, as llama-cpp-python
        does for a repeated prefix."""
        cold = prompt_ids != self._prompt
        if cold:
            self.llm.reset()
        run = self._timed(prompt_ids, max_new_tokens, sampling, eos_ids)
        if cold:
            self._prompt = list(prompt_ids)
            self._cold_prefill_seconds = run.prefill_seconds
        return TimedRun(run.token_ids, self._cold_prefill_seconds, run.decode_seconds)

    def answer(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, eos_ids: set[int]
    ) -> tuple[TimedRun, int]:
        """One timed answer of a conversation: llama-cpp-python keeps what its context evaluated last and computes
        only the prompt's positions after the longest prefix they share. Returns the run (prefill_seconds: until the
        first token) and how many prompt positions it kept. forget() starts a new conversation."""
        kept = shared_length(self.llm.input_ids[: self.llm.n_tokens].tolist(), prompt_ids[:-1])
        run = self._timed(prompt_ids, max_new_tokens, sampling, eos_ids)
        self._prompt = None  # generate() prefills its next prompt cold
        return run, kept

    def _timed(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, eos_ids: set[int]
    ) -> TimedRun:
        """llama-cpp-python's generate after what the context holds, timed to the first token and to the last."""
        if sampling.seed is not None:
            self.llm.set_seed(sampling.seed)
        tokens: list[int] = []
        started = time.perf_counter()
        first_at = started
        for token in self.llm.generate(prompt_ids, **llama_cpp_sampling_kwargs(sampling)):
            if not tokens:
                first_at = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) >= max_new_tokens or token in eos_ids:
                break
        return TimedRun(tokens, first_at - started, time.perf_counter() - first_at)

    def forget(self) -> None:
        """Drop what the context holds: the next answer computes its whole prompt."""
        self.llm.reset()
        self._prompt = None
