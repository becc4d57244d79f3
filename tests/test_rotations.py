"""The rotation table eager forwards read (runtime.rotations): rotary's own bits for every run of positions, blocks
kept within their bound and computed again when the frequencies change."""

import pytest
import torch
from helpers import make_model

from triforce_cli.runtime.rotations import BLOCK, KEPT


@pytest.fixture
def model():
    # head_dim 64: the embedded model's, whose D/2 rotations are whole vectors at any count
    return make_model(hidden_size=128, num_heads=2, num_kv_heads=1).model


@pytest.mark.parametrize(
    "start, count",
    [(0, 1), (5, 1), (BLOCK - 1, 1), (BLOCK - 3, 6), (BLOCK, 256), (7, 3 * BLOCK + 11), (10 * BLOCK + 9, 2)],
)
def test_a_run_of_positions_reads_the_rotation_rotary_computes(model, start, count):
    expected = model.rotary(torch.arange(start, start + count), torch.float32)
    got = model.rotation(start, count, torch.float32)
    assert got.shape == (count, 2, 2, 32)
    assert torch.equal(got, expected)


def test_a_position_reads_the_same_bits_from_every_run_that_holds_it(model):
    alone = model.rotation(BLOCK + 2, 1, torch.float32)
    assert torch.equal(model.rotation(BLOCK - 4, 9, torch.float32)[6:7], alone)
    assert torch.equal(model.rotation(0, 2 * BLOCK, torch.float32)[BLOCK + 2 : BLOCK + 3], alone)


def test_blocks_kept_are_bounded_the_latest_read_and_none_for_a_run_over_several(model):
    for index in range(KEPT + 5):
        model.rotation(index * BLOCK + 1, 1, torch.float32)
    assert list(model.rotations.blocks) == list(range(5, KEPT + 5))
    model.rotation(20 * BLOCK - 3, 6, torch.float32)  # a prefill chunk over blocks 19 and 20: computed for it alone
    assert list(model.rotations.blocks) == list(range(5, KEPT + 5))
    chunk = model.rotation(30 * BLOCK, BLOCK, torch.float32)  # an aligned chunk: its block, kept
    assert list(model.rotations.blocks)[-1] == 30 and chunk.data_ptr() == model.rotations.blocks[30].data_ptr()


def test_frequencies_changed_in_place_are_read_again(model):
    before = model.rotation(3, 4, torch.float32)
    with torch.no_grad():
        model.inv_freq.mul_(0.5)  # as fit_rope copies LongRoPE's other set in
    after = model.rotation(3, 4, torch.float32)
    assert not torch.equal(after, before)
    assert torch.equal(after, model.rotary(torch.arange(3, 7), torch.float32))
    assert torch.equal(model.rotation(3, 4, torch.bfloat16), model.rotary(torch.arange(3, 7), torch.bfloat16))
