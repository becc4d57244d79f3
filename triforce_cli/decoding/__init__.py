"""The decoding core: tiers and proposers, speculative sampling, speculation lengths, the engine and its API."""
