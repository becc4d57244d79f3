"""The library API: load the models once, then generate for many prompts.

from triforce_cli import EngineConfig, Pipeline, SamplingConfig

pipe = Pipeline.load(config=EngineConfig(mode="triforce", sampling=SamplingConfig(temperature=0)))
result = pipe.generate("Summarise this report: ...", chat=True)
print(result.text, result.stats.ms_per_token)
"""

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from triforce_cli.decoding.chat import ChatSession
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine, PrefillCallback, TokenCallback
from triforce_cli.decoding.prompt_state import PromptCache, check_writable
from triforce_cli.decoding.stats import GenerationResult
from triforce_cli.decoding.tuning import Tuning, fastest_configuration, slower_than_measured, tuning_enabled
from triforce_cli.errors import ConfigError
from triforce_cli.kernels import attention_backend, half_weights_available
from triforce_cli.runtime.embedded import EMBEDDED_DRAFTER
from triforce_cli.runtime.environment import physical_cores
from triforce_cli.runtime.loading import (
    LoadedModel,
    StatusCallback,
    load_model,
    resolve_checkpoint,
    resolve_compile,
    resolve_weights,
)
from triforce_cli.runtime.parallel import init_parallel, world_size
from triforce_cli.runtime.prompts import encode_prompt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SELF_DRAFT = "self"  # --draft value: the target drafts for itself on a StreamingLLM cache


def drafter_spec(target: str | None, draft: str | None) -> str | None:
    """The drafter to load: --draft as given, none for 'self', and for the embedded default target without
    --draft its shipped distilled drafter (after the n-gram, unless --no-ngram)."""
    if draft == SELF_DRAFT:
        return None
    if draft is None and target is None and (EMBEDDED_DRAFTER / "config.json").is_file():
        return str(EMBEDDED_DRAFTER)
    return draft


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device '{device}' (use auto, cpu or cuda[:N])") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device '{device}' (use auto, cpu or cuda[:N])")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but no CUDA GPU is available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def resolve_attention(requested: str, device: torch.device, dtype: torch.dtype, weights: str) -> str:
    """The attention kernel family to run (kernels.attention_backend), or a ConfigError saying why the requested
    one cannot run. Half weights read the prompt's keys and values from a packed float16 copy that only the cpu
    kernels read: the model they define is computed there alone."""
    try:
        backend = attention_backend(device, dtype, requested)
    except ValueError as err:
        raise ConfigError(f"--attention {requested}: {err}") from None
    if weights in ("half", "gguf") and backend != "cpu":  # 'auto' weights then resolve to dense
        raise ConfigError(
            f"--attention {backend} cannot read {weights} weights' float16 prompt cache: use --weights dense"
        )
    return backend


def drafter_weights(weights: str) -> str:
    """A 'half' or 'gguf' target gets a 'half' drafter (a drafter has no GGUF file of its own)."""
    return "half" if weights in ("half", "gguf") and half_weights_available() else "dense"


@dataclass
class Pipeline:
    target: LoadedModel
    drafter: LoadedModel | None
    engine: Engine
    status: StatusCallback | None = None  # one-line notes: what is loaded, a prompt-cache entry replaced
    tuning: Tuning | None = None  # the measurement the set-up came from, if it came from one

    @classmethod
    def load(
        cls,
        target: str | None = None,
        draft: str | None = None,
        config: EngineConfig | None = None,
        dtype: str = "auto",
        device: str = "auto",
        status: StatusCallback | None = None,
        weights: str = "auto",
        context_window: int | None = None,
        attention: str = "auto",
        compile_steps: bool | None = None,
        tune: bool = False,
        threads: int | None = None,
    ) -> "Pipeline":
        """Load target (None: the embedded default) and drafter (see drafter_spec); config defaults to EngineConfig().

        weights: 'auto' (the fastest exact form for the device, loading.resolve_weights), 'dense', 'half' (float16
        weight matrices for target and drafter) or 'gguf' (the target from its GGUF file's blocks); see
        loading.load_model. Output is exact with respect to the target in the form chosen.
        context_window: positions both models accept, YaRN-scaled beyond their trained context.
        attention: 'auto' (the fastest kernel for the device and dtype), 'flash', 'sdpa' or 'cpu'; see
        resolve_attention.
        compile_steps: run decode steps as compiled fixed-shape graphs, CUDA graphs on a GPU; None: on CUDA only (see
        loading.resolve_compile).
        tune: on the CPU in float32, let 'auto' weights, an unset compile_steps and unset threads take the
        configuration measured fastest for this target and machine (decoding.tuning; measured the first time).
        threads: the torch threads the caller set, or None: then a CPU's prefill runs on every physical core, and
        decoding on the threads measured fastest (with tune) or torch's.
        """
        config = config or EngineConfig()
        torch_device = init_parallel(resolve_device(device))  # torchrun: this rank's device in the process group
        parallel = world_size() > 1
        torch_dtype = resolve_dtype(dtype, torch_device)
        backend = resolve_attention(attention, torch_device, torch_dtype, weights)
        if parallel and compile_steps:
            raise ConfigError("tensor-parallel steps run eager (an all-reduce per block): use --no-compile")
        compiled = resolve_compile(False if parallel else compile_steps, torch_device, weights)
        streamed = config.offload == "kv+weights"
        if streamed and compiled:
            raise ConfigError("--offload kv+weights runs eager steps: use --no-compile")
        if weights == "auto" and (streamed or parallel):
            weights = "dense"  # streamed and sharded weights are parameters, which packed half weights are not
        tunable = torch_device.type == "cpu" and torch_dtype == torch.float32 and backend == "cpu" and not parallel
        # only there can 'auto' become gguf, so only there does it matter whether the target is a GGUF file
        checkpoint = resolve_checkpoint(target, status) if weights == "auto" and tunable and not compiled else None
        unset = checkpoint is not None and compile_steps is None and config.offload == "none"
        tuning = None
        if tune and tunable and unset and tuning_enabled():
            tuning = fastest_configuration(target, checkpoint, status)
            weights, compiled = tuning.choice.weights, tuning.choice.compiled
            if threads is None:
                torch.set_num_threads(tuning.choice.threads)
        gguf_source = checkpoint is not None and checkpoint.gguf is not None
        weights = resolve_weights(weights, torch_dtype, torch_device, backend, compiled, gguf_source)
        target_model = load_model(
            target,
            torch_dtype,
            torch_device,
            status,
            weights,
            context_window=context_window,
            tensor_parallel=parallel,  # the drafter stays whole on every rank
            offload_weights=streamed,
            resident_layers=config.on_chip_layers,
        )
        draft = drafter_spec(target, draft)
        drafter = None
        if draft is not None:
            drafter = load_model(
                draft,
                torch_dtype,
                torch_device,
                status,
                weights=drafter_weights(weights),
                shared_from=target_model,
                context_window=context_window,
            )
        for loaded in (target_model, drafter):
            if loaded is not None:
                loaded.model.use_attention(backend)
                if compiled:
                    loaded.model.compile_steps("reduce-overhead" if torch_device.type == "cuda" else None)
        prefill_threads = physical_cores() if threads is None and torch_device.type == "cpu" else None
        return cls(target_model, drafter, Engine(target_model, config, drafter, prefill_threads), status, tuning)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def reconfigure(self, **changes) -> None:
        """Change settings (mode, budget, sampling, ...) keeping the loaded models and the caches they fit."""
        self.engine = self.engine.reconfigured(replace(self.config, **changes), self.drafter)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode_prompt(self.target.tokenizer, prompt, chat)

    def chat(self, document: str) -> ChatSession:
        """A chat about document (decoding/chat.py): each question answered after the whole conversation so far, as
        the target's chat template renders it, the document's token ids the same in every prompt.

        Args:
            document: the text the questions are about.
        Returns:
            The session, nothing prefilled yet (ChatSession.prefill reads the document). A PromptError where the
            target's tokenizer has no chat template or the document leaves no room for an answer.

        Unless the config sizes the caches already (EngineConfig.cache_positions), they are sized for the target's
        whole context, allocated once: a full cache grown for a longer prompt would lose the conversation's keys and
        values, which each next question reuses (prefix reuse).
        """
        chat = ChatSession(self, document)
        if self.config.cache_positions is None:
            self.reconfigure(cache_positions=self.target.model.config.max_position_embeddings)
        return chat

    def prompt_cache(self, folder: Path) -> PromptCache:
        """The saved prefills of this target in folder, checked writable before any prefill."""
        if world_size() > 1:
            raise ConfigError("--prompt-cache holds whole prefills: run it without torchrun")
        check_writable(folder)
        return PromptCache(folder, self.target, self.status, self.engine.prefill_chunk)

    def generate_ids(
        self,
        prompt_ids: list[int],
        on_prefill: PrefillCallback | None = None,
        on_tokens: TokenCallback | None = None,
        prompt_cache: Path | None = None,
    ) -> GenerationResult:
        """Generate after token ids; with prompt_cache (a folder), reuse a saved prefill of them or save this one,
        reusing the whole prefill chunks of the saved prompt that shares the most of them (prefix reuse). A note
        tells where the machine ran much slower than when its set-up was measured."""
        if prompt_cache is None:
            result = self.engine.generate(prompt_ids, on_prefill, on_tokens)
        else:
            cache = self.prompt_cache(prompt_cache)
            state = cache.load(prompt_ids)
            if state is not None:
                result = self.engine.generate(prompt_ids, on_prefill, on_tokens, prompt_state=state)
            else:
                earlier = cache.load_longest_prefix(prompt_ids)
                if earlier is not None:
                    self.engine.restore(earlier, next_prompt_tokens=len(prompt_ids))
                result = self.engine.generate(
                    prompt_ids, on_prefill, on_tokens, on_prompt_state=lambda fresh: cache.save(fresh, prompt_ids)
                )
        slow = None if self.tuning is None else slower_than_measured(self.tuning, result.stats.prefill_chunk_seconds)
        if slow is not None and self.status is not None:
            self.status(slow)
        return result

    def generate(
        self,
        prompt: str,
        chat: bool = False,
        on_prefill: PrefillCallback | None = None,
        on_tokens: TokenCallback | None = None,
        prompt_cache: Path | None = None,
    ) -> GenerationResult:
        return self.generate_ids(self.encode(prompt, chat), on_prefill, on_tokens, prompt_cache)
