"""sampling.py's per-row sampler: each row draws what `sample` draws for it alone."""
from __future__ import annotations

import torch

from redline.sampling import TOP_P_DISABLED, exponential_noise, sample, sample_rows


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
