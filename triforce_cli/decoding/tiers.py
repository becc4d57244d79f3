"""The tiers of a mode, built on the caches of one generation, each the proposer of the one above.

``build_tiers`` reads the chain off the configuration: a drafter tier on the StreamingLLM cache (a model drafter, the
n-gram proposer before it, or both), the target on the retrieval cache above it where the mode has that tier, and the
target on its full cache on top. MODE_TIERS in config.py says which tiers a mode runs.
"""

from collections.abc import Callable

import torch

from triforce_cli.decoding.cache_pool import InUse
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.ngram import NGramProposer
from triforce_cli.decoding.speculation_length import SOURCE_POLICIES
from triforce_cli.decoding.speculative import FallbackProposer, ModelTier, Proposer, Tier
from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.parallel import world_size


def build_tiers(
    config: EngineConfig,
    target: Transformer,
    drafter: Transformer,
    caches: InUse,
    generator: torch.Generator,
    *,
    ngram: bool,
    model_drafter: bool,
    set_up_drafter: Callable[..., None] | None = None,
) -> ModelTier:
    """The tiers of config's mode on caches; the top one.

    Args:
        config: the engine's settings (mode, gammas, policy, sampling).
        target: the target model; drafter: the model on the StreamingLLM cache (the target itself without one).
        caches: the generation's caches; a tier whose cache is None is left out.
        generator: every tier's random stream.
        ngram: whether the n-gram proposer drafts first (Engine.uses_ngram).
        model_drafter: whether a model drafts on the StreamingLLM cache (Engine.uses_model_drafter).
        set_up_drafter: fills the StreamingLLM cache where the drafter first drafts (ModelTier.set_up), or None:
            it is filled already.
    Returns:
        The target on its full cache, whose proposer is the next tier down.
    """
    policy = config.speculation_policy
    if policy == "throughput" and world_size() > 1:
        policy = "heuristic"  # the clock differs between ranks; acceptance, which heuristic follows, does not
    shared = {"sampling": config.sampling, "generator": generator, "gamma_policy": policy}
    below: Proposer | None = None  # None without a drafter tier: the tier it would draft for samples every token
    if caches.streaming is not None:
        below = ModelTier(name=Tier.DRAFTER, model=drafter, cache=caches.streaming, set_up=set_up_drafter, **shared)
    lookup = None
    if ngram:
        lookup = NGramProposer(
            target.config.vocab_size, config.ngram_max, min_match=config.ngram_min_match, device=target.device
        )
        below = lookup if below is None else FallbackProposer(lookup, below)
    if not config.uses_retrieval:
        proposer, gamma, shortcut = below, config.gamma1, None
    else:
        proposer = ModelTier(
            name=Tier.RETRIEVAL,
            model=target,
            cache=caches.retrieval,
            proposer=below,
            gamma=config.gamma1,
            refresh_interval=config.refresh_interval,
            **shared,
        )
        # the adaptive policies may skip the middle tier where verifying at it does not pay (speculation_length.py);
        # only a model drafter, which always drafts, makes a shortcut (an n-gram alone often finds nothing)
        gamma, shortcut = config.gamma2, below if policy in SOURCE_POLICIES and model_drafter else None
    return ModelTier(
        name=Tier.TARGET,
        model=target,
        cache=caches.full,
        proposer=proposer,
        gamma=gamma,
        shortcut=shortcut,
        # the lookup's drafts offered at every step, where it does not already draft here alone
        lookup=lookup if policy == "costed" and proposer is not lookup else None,
        own_steps=True,
        **shared,
    )


def tier_chain(top: ModelTier) -> list[ModelTier]:
    """The model tiers from top down, each the proposer of the one before."""
    chain = [top]
    while isinstance(chain[-1].proposer, ModelTier):
        chain.append(chain[-1].proposer)
    return chain
