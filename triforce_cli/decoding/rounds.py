"""Rounds of the top tier until the answer is complete: the decoding loop of a generation."""

import time
from collections.abc import Callable

from triforce_cli.decoding.cache_pool import Held
from triforce_cli.decoding.speculative import ModelTier, TokenSequence
from triforce_cli.decoding.stats import GenerationStats, StopReason

TokenCallback = Callable[[list[int], list[str]], None]  # (new token ids, tier that sampled each)
StopCheck = Callable[[], bool]  # asked once before each verification round: True stops the generation there


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
) -> None:
    """Rounds of the top tier (ModelTier.step) until max_new_tokens, an end-of-sequence token or should_stop.

    Args:
        top: the top tier, its caches prefilled.
        prompt_ids: the prompt; generated: the tokens so far (the first, sampled from the prompt's logits),
            appended to in place.
        held: what the full cache holds (Held of the prompt and the first token), kept up to date round by round
            for the next prompt to reuse: its ids are the prompt and every committed token, its length the full
            cache's after the last round that ended (each round leaves it at the committed tokens' length, less the
            last one, whose keys the next round writes), so that a round interrupted in the middle of a forward
            leaves only positions that hold what their ids say.
        stats: receives each round's seconds and tokens, and why decoding stopped.
        on_tokens: receives each round's tokens and the tier that sampled each.
        should_stop: asked before each round; True stops there ("cancelled").

    The committed ids live on the device (TokenSequence), copied there once: each round appends its tokens from the
    device, and the host learns them from the round's one read (a verification's, or where the top tier sampled its
    own token, the read that hands it out).
    """
    if generated[-1] in eos_ids:
        stats.stop_reason = StopReason.EOS
        return
    capacity = len(prompt_ids) + max_new_tokens
    committed = TokenSequence.of([*prompt_ids, *generated], top.model.device, capacity)
    while len(generated) < max_new_tokens:
        if should_stop is not None and should_stop():
            stats.stop_reason = StopReason.CANCELLED
            return
        started = time.perf_counter()
        verified = top.step(committed, limit=max_new_tokens - len(generated))  # never more than wanted
        tokens = verified.tokens  # an own step's token is read here (autoregressive decoding: one read per token)
        stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
        elapsed = time.perf_counter() - started
        stats.decode_seconds += elapsed
        stats.round_seconds.append(elapsed)
        stats.round_tokens.append(len(tokens))
        committed.append(verified.ids[: len(tokens)], tokens)
        generated += tokens
        held.ids += tokens
        held.length = min(top.cache.length, len(held.ids))  # an end-of-sequence token may cut accepted drafts
        if on_tokens is not None:
            on_tokens(tokens, verified.origins[: len(tokens)])
        if stop is not None:
            stats.stop_reason = StopReason.EOS
            return
