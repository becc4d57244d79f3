"""The CPU extension's sampling (kernels/sampling.py, csrc/sampling.cpp) against decoding.sampling's torch ops."""

import pytest
import torch
from triforce_cli.kernels.sampling import sample_rows, sampling_kernels_available, sampling_probabilities

from triforce_cli.decoding.sampling import SamplingConfig, probabilities, probabilities_reference
from triforce_cli.runtime.native import kernel_error

pytestmark = pytest.mark.skipif(kernel_error() is not None, reason="the CPU extension does not build here")

VOCAB = 4099  # not a multiple of 16: the vector bodies' tails too
CONFIGS = (
    SamplingConfig(temperature=0.6, top_p=0.9),
    SamplingConfig(temperature=1.0, top_p=1.0),
    SamplingConfig(temperature=0.8, top_p=0.5, top_k=40),
    SamplingConfig(temperature=0.7, top_p=0.95, min_p=0.05),
    SamplingConfig(temperature=1.3, top_p=1.0, top_k=7),
)


def peaked_logits(rows: int, seed: int) -> torch.Tensor:
    """Logits (rows, VOCAB) shaped like a language model's: a few likely tokens over a long tail."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 2
    head = torch.randint(0, VOCAB, (rows, 8), generator=g)
    return logits.scatter_add(1, head, 6 + 4 * torch.rand(rows, 8, generator=g))


def run(cfg: SamplingConfig, logits: torch.Tensor) -> torch.Tensor:
    return sampling_probabilities(logits, cfg.temperature, cfg.top_k, cfg.min_p, cfg.top_p)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"T{c.temperature}-p{c.top_p}-k{c.top_k}-m{c.min_p}")
def test_probabilities_match_the_torch_ops(body, cfg):
    for seed in range(20):
        logits = peaked_logits(3, seed)
        ours, reference = run(cfg, logits), probabilities_reference(logits, cfg)
        # the same tokens kept but where float32 roundings place one at the nucleus' edge, which holds almost no mass
        differ = (ours > 0) != (reference > 0)
        assert (ours[differ].sum() + reference[differ].sum()).item() < 1e-4
        assert torch.allclose(ours[~differ], reference[~differ], rtol=1e-4, atol=1e-7)
        assert torch.allclose(ours.sum(dim=-1), torch.ones(3), atol=1e-5)


def test_a_row_gets_the_same_bits_whatever_rows_go_with_it(body):
    logits = peaked_logits(4, 0)
    for cfg in CONFIGS:
        together = run(cfg, logits)
        for row in range(4):
            assert torch.equal(run(cfg, logits[row : row + 1])[0], together[row])


def test_avx2_and_avx512_bodies_give_the_same_bits():
    if torch.ops.triforce_cpu.isa() != "avx512":
        pytest.skip("this CPU runs one vector body")
    logits = peaked_logits(3, 1)
    try:
        outs = []
        for isa in ("avx512", "avx2"):
            torch.ops.triforce_cpu.use_isa(isa)
            outs.append([run(cfg, logits) for cfg in CONFIGS])
    finally:
        torch.ops.triforce_cpu.use_isa("avx512")
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_the_nucleus_keeps_the_fewest_tokens_that_hold_top_p():
    # 0.5, 0.3, 0.15, 0.05: the first three hold 0.95, the first two only 0.8
    logits = torch.tensor([[0.5, 0.05, 0.3, 0.15]]).log()
    probs = sampling_probabilities(logits, 1.0, 0, 0.0, 0.9)
    assert probs[0, 1] == 0
    assert torch.allclose(probs, torch.tensor([[0.5, 0.0, 0.3, 0.15]]) / 0.95)
    assert sampling_probabilities(logits, 1.0, 0, 0.0, 0.01)[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # the top stays


def test_draws_match_the_torch_search():
    g = torch.Generator().manual_seed(3)
    probs = probabilities_reference(peaked_logits(64, 2), SamplingConfig(temperature=0.9, top_p=0.95))
    probs[0] = 0.0
    probs[0, 5] = 1.0  # a one-hot row
    uniform = torch.rand(64, 1, generator=g, dtype=torch.float64)
    cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
    expected = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)[:, 0]
    assert torch.equal(sample_rows(probs, uniform), expected)
    assert sample_rows(probs[:1], torch.tensor([0.999999], dtype=torch.float64)).item() == 5


def test_decoding_takes_the_kernels_on_the_cpu_and_the_torch_ops_for_gradients():
    logits = peaked_logits(2, 4)
    cfg = SamplingConfig(temperature=0.6, top_p=0.9)
    assert sampling_kernels_available(logits)
    assert torch.equal(probabilities(logits, cfg), run(cfg, logits))
    wanted = logits.clone().requires_grad_()
    assert not sampling_kernels_available(wanted)
    assert probabilities(wanted, cfg).grad_fn is not None
    assert not sampling_kernels_available(logits.double())


def test_bad_operands_are_refused():
    with pytest.raises(RuntimeError, match="temperature: above 0"):
        sampling_probabilities(torch.zeros(1, 4), 0.0, 0, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="uniform: float64"):
        sample_rows(torch.ones(2, 4) / 4, torch.zeros(2))
