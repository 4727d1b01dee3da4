"""sampling.py's per-row sampler: each row draws what `sample` draws for it alone."""
from __future__ import annotations

import pytest
import torch

from redline.sampling import ARGMAX_CHUNK, TOP_P_DISABLED, argmax_rows, exponential_noise, sample, sample_rows


def test_each_row_draws_what_it_draws_alone_and_temperature_zero_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 97) * 3  # (B, V)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.0, 0.9])
    top_k = torch.tensor([97, 97, 10, 97, 5, 3])
    top_p = torch.tensor([TOP_P_DISABLED, TOP_P_DISABLED, 0.9, 0.5, TOP_P_DISABLED, TOP_P_DISABLED])
    seed = torch.tensor([1, 2, 3, 4, 5, 2**62 + 7])
    position = torch.tensor([4, 9, 0, 130, 7, 1])
    got = sample_rows(logits, temperature, top_k, top_p, seed, position)
    for r in range(6):
        if temperature[r] == 0:
            assert got[r] == logits[r].argmax()
            continue
        alone = sample(logits[r:r + 1], temperature[r], top_k[r], top_p[r], seed[r], position[r:r + 1])
        assert got[r] == alone.item()
    # The same row with another seed or position draws from other noise.
    noise = exponential_noise(seed.view(-1, 1), position, 1, 97)
    assert torch.equal(noise[1], exponential_noise(seed[1], position[1:2], 1, 97)[0])
    assert not torch.equal(noise[1], exponential_noise(seed[1], position[1:2] + 1, 1, 97)[0])


def test_rows_follow_their_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)  # (B, 3)
    ones = torch.ones(4000)
    draws = sample_rows(logits, ones, torch.full((4000,), 3), torch.full((4000,), TOP_P_DISABLED),
                        torch.arange(4000), torch.zeros(4000, dtype=torch.long))
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


@pytest.mark.parametrize("vocab", [97, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK, 152064])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax_ties_and_infinities_included(vocab, dtype):
    """The two-stage argmax gives torch.argmax's index: the first maximum, also for ties within and across chunks,
    rows of -inf (a vocabulary bias), a maximum in the padded last chunk, compiled as well as eager."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-4, 4, (6, vocab), generator=g).to(dtype)  # many ties
    logits[1] = float("-inf")
    logits[2, -1] = 9.0  # the last id, in the padded chunk
    logits[3, [5, vocab - 1]] = 9.0  # a tie across chunks: the first wins
    logits[4, :] = 0.0
    logits[5, vocab // 2:] = float("-inf")
    want = torch.argmax(logits, dim=-1)
    assert torch.equal(argmax_rows(logits), want)
    torch._dynamo.reset()  # one compile per shape: ten would pass dynamo's recompile limit
    assert torch.equal(torch.compile(argmax_rows, fullgraph=True, dynamic=False)(logits), want)
