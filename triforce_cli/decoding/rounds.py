"""Rounds of the top tier until the answer is complete: the decoding loop of a generation."""

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from triforce_cli.decoding.cache_pool import Held
from triforce_cli.decoding.speculative import ModelTier, Proposal, TokenSequence
from triforce_cli.decoding.stats import GenerationStats, StopReason
from triforce_cli.runtime.model import Transformer

TokenCallback = Callable[[list[int], list[str]], None]  # (new token ids, tier that sampled each)
StopCheck = Callable[[], bool]  # asked once before each verification round: True stops the generation there
TokenRead = Callable[[], list[int]]  # waits for a round's tokens and returns them on the host


def forward_mode(*models: Transformer) -> AbstractContextManager:
    """The autograd mode decoding runs the models' forwards in: inference mode where every one steps eager, so that
    no forward enters it again (~50 us each once a step has emptied the CPU's caches); else none, since a compiled
    step would compile again for it (dynamo keys a graph by that mode)."""
    if all(model.fixed_step is None for model in models):
        return torch.inference_mode()
    return contextlib.nullcontext()


def queued_read(ids: torch.Tensor) -> TokenRead:
    """ids (n,) on the device, their copy to the host queued now, behind the work that computes them: a read that
    waits for that copy alone, not for work queued after it (on the CPU, where nothing is queued, a plain read)."""
    if ids.device.type != "cuda":
        return ids.tolist
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return read


def decode(
    top: ModelTier,
    prompt_ids: list[int],
    generated: list[int],
    held: Held,
    stats: GenerationStats,
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    on_tokens: TokenCallback | None = None,
    should_stop: StopCheck | None = None,
    lookahead: bool | None = None,
) -> None:
    """Rounds of the top tier (ModelTier.step) until max_new_tokens, an end-of-sequence token or should_stop.

    Args:
        top: the top tier, its caches prefilled.
        prompt_ids: the prompt; generated: the tokens so far (the first, sampled from the prompt's logits),
            appended to in place.
        held: what the full cache holds (Held of the prompt and the first token), kept up to date round by round
            for the next prompt to reuse: its ids are the prompt and every committed token, its length the full
            cache's after the last round that ended, at most the committed tokens' length (a round leaves it one
            short, the next round writing the last token's keys, or, where that round was queued ahead, at it),
            so that a round interrupted in the middle of a forward leaves only positions that hold what their ids
            say.
        stats: receives each round's seconds and tokens, and why decoding stopped.
        on_tokens: receives each round's tokens and the tier that sampled each.
        should_stop: asked before each round; True stops there ("cancelled").
        lookahead: after a round whose token the top tier sampled itself (an own step, left unread on the device:
            autoregressive decoding, or the policy's choice), queue the next round before reading that token, so
            that the host's work for a step (its launch: a CUDA graph of an 8B model takes ~1.5 ms to launch on an
            H200) overlaps the device's work for the one before. A round queued past an end-of-sequence token is
            dropped, its keys (the committed tokens') kept. None: where the model runs asynchronously (CUDA).

    The committed ids live on the device (TokenSequence), copied there once: each round appends its tokens from the
    device, and the host learns them from the round's one read (a verification's, or where the top tier sampled its
    own token, the read that hands it out).
    """
    if generated[-1] in eos_ids:
        stats.stop_reason = StopReason.EOS
        return
    if lookahead is None:
        lookahead = top.model.device.type == "cuda"
    capacity = len(prompt_ids) + max_new_tokens
    committed = TokenSequence.of([*prompt_ids, *generated], top.model.device, capacity)

    def round_of(limit: int) -> tuple[Proposal, TokenRead | None]:
        """A round of the top tier after committed, and where it left its token unread, that token's read queued
        behind it (lookahead)."""
        verified = top.step(committed, limit=limit)  # never more than wanted
        return verified, queued_read(verified.ids) if lookahead and verified.host is None else None

    queued: tuple[Proposal, TokenRead | None] | None = None
    while len(generated) < max_new_tokens:
        if should_stop is not None and should_stop():
            stats.stop_reason = StopReason.CANCELLED
            return
        started = time.perf_counter()
        verified, read = queued or round_of(max_new_tokens - len(generated))
        queued = None
        ahead = read is not None and len(generated) + len(verified) < max_new_tokens
        if ahead:  # the next round goes to the device before this one's token comes back
            committed.append(verified.ids)
            queued = round_of(max_new_tokens - len(generated) - len(verified))
        tokens = read() if read is not None else verified.tokens  # an own step's token is read here
        stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
        elapsed = time.perf_counter() - started
        stats.decode_seconds += elapsed
        stats.round_seconds.append(elapsed)
        stats.round_tokens.append(len(tokens))
        if ahead:
            committed.learn(tokens)
        else:
            committed.append(verified.ids[: len(tokens)], tokens)
        generated += tokens
        held.ids += tokens
        held.length = min(top.cache.length, len(held.ids))  # an end-of-sequence token may cut accepted drafts
        if on_tokens is not None:
            on_tokens(tokens, verified.origins[: len(tokens)])
        if stop is not None:
            stats.stop_reason = StopReason.EOS
            return
