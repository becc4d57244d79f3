"""What `triforce bench` measures our modes against: Hugging Face transformers `generate`, plain, with an
assistant model (assisted generation) and with prompt lookup, on the same weights, dtype and threads."""

import time
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from triforce_cli.decoding.sampling import SamplingConfig

HF_PEERS = ("hf", "hf-assisted", "hf-lookup")
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value


@dataclass
class TimedRun:
    token_ids: list[int]
    prefill_seconds: float  # until the first new token
    decode_seconds: float  # from the first new token to the last

    @property
    def answer_seconds(self) -> float:
        """Until the last new token: what a user waits for the whole answer."""
        return self.prefill_seconds + self.decode_seconds

    @property
    def ms_per_token(self) -> float:
        decoded = len(self.token_ids) - 1
        return 1000 * self.decode_seconds / decoded if decoded > 0 else 0.0


class FirstTokenClock(BaseStreamer):
    """Notes when generate pushes its first new token (its first push is the prompt)."""

    def __init__(self) -> None:
        self.pushes = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.pushes += 1
        if self.pushes == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


def hf_sampling_kwargs(sampling: SamplingConfig) -> dict:
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}


def hf_generate(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    *,
    assistant: PreTrainedModel | None = None,
    prompt_lookup: int | None = None,
    ignore_eos: bool = False,
    cache: Cache | None = None,
) -> TimedRun:
    """One transformers generate run, timed to the first new token and to the end.

    ignore_eos: generate max_new_tokens tokens whatever the model samples. No end-of-sequence ids rather than
    min_new_tokens, which would forbid them and so change greedy output where the model picks one; this way it is
    what our engine generates with EngineConfig.ignore_eos.
    cache: a cache holding the keys and values of prompt_ids' first positions (fewer than all of them),
    which generate then computes only after; it holds those of the prompt and the answer afterwards.
    """
    input_ids = torch.tensor([prompt_ids], device=model.device)
    clock = FirstTokenClock()
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            streamer=clock,
            assistant_model=assistant,
            prompt_lookup_num_tokens=prompt_lookup,
            pad_token_id=model.generation_config.eos_token_id,
            **({} if cache is None else {"cache": cache}),
            **({"eos_token_id": []} if ignore_eos else {}),  # None would fall back to the model's
            **hf_sampling_kwargs(sampling),
        )
        if output.is_cuda:
            torch.cuda.synchronize(output.device)  # the last token's work done before reading the clock
    finished = time.perf_counter()
    first = clock.first_token_at or finished
    return TimedRun(output[0, len(prompt_ids) :].tolist(), first - started, finished - first)
