"""The library API: load the models once, then generate for many prompts.

from triforce_cli import EngineConfig, LoadOptions, Pipeline, SamplingConfig

pipe = Pipeline.load(LoadOptions(), config=EngineConfig(mode="triforce", sampling=SamplingConfig(temperature=0)))
result = pipe.generate("Summarise this report: ...", chat=True)
print(result.text, result.stats.ms_per_token)
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.prefill import PrefillCallback
from triforce_cli.decoding.prompt_state import PromptCache, PromptState, check_writable
from triforce_cli.decoding.rounds import StopCheck, TokenCallback
from triforce_cli.decoding.setup import LoadOptions, choose_setup
from triforce_cli.decoding.stats import GenerationResult
from triforce_cli.decoding.tuning import Tuning, slower_than_measured
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.embedded import EMBEDDED_DRAFTER, EMBEDDED_NAME
from triforce_cli.runtime.loading import (
    DRAFTER_METADATA,
    LoadedModel,
    StatusCallback,
    embedding_digest,
    load_model,
)
from triforce_cli.runtime.parallel import init_parallel, world_size
from triforce_cli.runtime.prompts import encode_prompt

SELF_DRAFT = "self"  # LoadOptions.draft value: the target drafts for itself on a StreamingLLM cache


def drafter_spec(target: LoadedModel, draft: str | None) -> str | None:
    """The drafter to load for the loaded target: draft as given, none for 'self', and without a draft the shipped
    distilled drafter where the target is the model it was distilled for (the embedded default, or another file of
    it, such as a K-quant GGUF: the drafter borrows the target's embedding, so it fits a target whose embedding is
    the one it was trained on), after the n-gram unless EngineConfig.ngram is False."""
    if draft == SELF_DRAFT:
        return None
    if draft is None and (EMBEDDED_DRAFTER / "config.json").is_file():
        shipped = json.loads((EMBEDDED_DRAFTER / "config.json").read_text())
        shape = ("vocab_size", "hidden_size")  # the embedding's: compared before it is read and hashed
        same_shape = all(shipped.get(key) == getattr(target.hf_config, key, None) for key in shape)
        digest = (shipped.get(DRAFTER_METADATA) or {}).get("embedding_sha256")
        if target.name == EMBEDDED_NAME or (
            same_shape and target.weight_files and embedding_digest(target.weight_files) == digest
        ):
            return str(EMBEDDED_DRAFTER)
    return draft


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
        options: LoadOptions | None = None,
        config: EngineConfig | None = None,
        status: StatusCallback | None = None,
    ) -> "Pipeline":
        """Load the target and drafter that options name (decoding.setup.LoadOptions; None: every default, the
        embedded target and its drafter, see drafter_spec); config defaults to EngineConfig().

        Every choice is made first, in one place (setup.choose_setup, from options, the machine and, where it
        decides something, the target's checkpoint; with options.tune, the configuration measured fastest); then
        the target loads, then the drafter, each built and then transformed as the Setup says by one function
        (loading.transform_model: weight form, sharding, weight offload, device, attention kernels, step mode).
        """
        options = options or LoadOptions()
        config = config or EngineConfig()
        chosen = choose_setup(options, config.offload, status)
        setup = chosen.setup
        init_parallel(setup.device)  # torchrun: join the process group, this rank on setup.device
        if setup.decode_threads is not None:
            torch.set_num_threads(setup.decode_threads)
        target_model = load_model(
            options.target,
            setup.dtype,
            setup.device,
            status,
            setup.weights,
            context_window=options.context_window,
            tensor_parallel=setup.tensor_parallel,  # the drafter stays whole on every rank
            offload_weights=setup.offload_weights,
            resident_layers=config.on_chip_layers,
            checkpoint=chosen.checkpoint,  # resolved once, where the set-up read it
            attention=setup.attention,
            steps=setup.steps,
        )
        draft = drafter_spec(target_model, options.draft)
        drafter = None
        if draft is not None:
            drafter = load_model(
                draft,
                setup.dtype,
                setup.device,
                status,
                weights=setup.drafter_weights,
                shared_from=target_model,
                context_window=options.context_window,
                attention=setup.attention,
                steps=setup.steps,
            )
        engine = Engine(target_model, config, drafter, setup.prefill_threads)
        return cls(target_model, drafter, engine, status, chosen.tuning)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def reconfigure(self, **changes) -> None:
        """Change settings (mode, budget, sampling, ...) keeping the loaded models and the caches they fit."""
        self.engine = self.engine.reconfigured(replace(self.config, **changes), self.drafter)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode_prompt(self.target.tokenizer, prompt, chat)

    @property
    def context_tokens(self) -> int:
        """The target's context: the most tokens a prompt and its answer may hold."""
        return self.target.model.config.max_position_embeddings

    def size_for_whole_context(self) -> None:
        """Unless the config sizes the caches already (EngineConfig.cache_positions), size them for the target's
        whole context, allocated once: a full cache grown for a longer prompt would lose what it holds, which the
        next prompt that shares a prefix with it reuses (a chat's conversation, a server's last request)."""
        if self.config.cache_positions is None:
            self.reconfigure(cache_positions=self.context_tokens)

    def prompt_cache(self, folder: Path, new_tokens: int | None = None) -> PromptCache:
        """The saved prefills of this target in folder, checked writable before any prefill, for runs of new_tokens
        new tokens (None: this pipeline's max_new_tokens)."""
        if world_size() > 1:
            raise ConfigError("--prompt-cache holds whole prefills: run it without torchrun")
        check_writable(folder)
        new_tokens = self.engine.config.max_new_tokens if new_tokens is None else new_tokens
        return PromptCache(folder, self.target, self.status, self.engine.prefill_block, new_tokens)

    def generate_ids(
        self,
        prompt_ids: list[int],
        on_prefill: PrefillCallback | None = None,
        on_tokens: TokenCallback | None = None,
        prompt_cache: Path | None = None,
        should_stop: StopCheck | None = None,
    ) -> GenerationResult:
        """Generate after token ids; with prompt_cache (a folder), reuse a saved prefill of them or save this one,
        reusing the prefix shared with the saved prompt that shares the most whole prefill chunks with them (prefix
        reuse: the whole shared prefix under the numeric contract, Engine.exact_positions). A note
        tells where the machine ran much slower than when its set-up was measured. should_stop: asked once per
        verification, True ends the generation there (Engine.generate)."""
        if prompt_cache is None:
            result = self.engine.generate(prompt_ids, on_prefill, on_tokens, should_stop=should_stop)
        else:
            cache = self.prompt_cache(prompt_cache)
            state = cache.load(prompt_ids)
            saved = [] if state is None else [state]  # the prompt's entry, saved again with the answer after
            if state is not None:
                result = self.engine.generate(
                    prompt_ids, on_prefill, on_tokens, prompt_state=state, should_stop=should_stop
                )
            else:
                earlier = cache.load_longest_prefix(prompt_ids)
                if earlier is not None:
                    self.engine.restore(earlier, next_prompt_tokens=len(prompt_ids))

                def save(fresh: PromptState) -> None:
                    if cache.save(fresh, prompt_ids):  # kept without its keys and values: the cache holds them
                        empty = fresh.keys[:, :, :0].clone()  # (layers, Hkv, 0, D), none of the copy's storage
                        saved.append(replace(fresh, keys=empty, values=empty))

                result = self.engine.generate(
                    prompt_ids, on_prefill, on_tokens, on_prompt_state=save, should_stop=should_stop
                )
            answered = None
            if saved and result.stats.stop_reason != "interrupted":
                answered = self.engine.answered_state(saved[0])
            if answered is not None:
                cache.save(answered, prompt_ids)
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


def prefill_or_restore(
    engine: Engine,
    prompt_ids: list[int],
    cache: PromptCache | None = None,
    on_prefill: PrefillCallback | None = None,
    *,
    restore: bool = True,
) -> tuple[PromptState | None, bool]:
    """Load the saved prefill of prompt_ids from cache, or prefill them and save it there.

    Args:
        engine: prefills, and restores a saved prefill where restore is set.
        prompt_ids: the prompt's token ids.
        cache: the saved prefills (Pipeline.prompt_cache), or None: prefill.
        on_prefill: receives (model name, tokens done, tokens total) as the prefill goes on.
        restore: leave the prefill in the engine's full cache, for the next prompt that starts with prompt_ids
            (prefix reuse: a chat's document); False: return it for Engine.generate(prompt_state=...), which puts
            it there itself (a benchmark's runs of one prompt).
    Returns:
        The prefilled state (None where restore is set and nothing is saved: it is not copied), and whether it came
        from cache.
    """
    saved = None if cache is None else cache.load(prompt_ids)
    if saved is not None:
        if restore:
            engine.restore(saved)
        return saved, True
    state = engine.prefill(prompt_ids, on_prefill, capture=cache is not None or not restore)
    if cache is not None:
        cache.save(state, prompt_ids)
    return state, False
