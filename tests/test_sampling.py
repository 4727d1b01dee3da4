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


# ---------------------------------------------------------------------------------------------------------------------
# Penalties, logit bias and min_p (the batching engine's per-row settings).


def test_penalized_logits_match_a_plain_reference():
    """Bias, min_tokens bans, repetition (HF's processor), frequency and presence penalties per row."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from redline.sampling import penalized_logits

    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 4  # (B, V)
    prompts = [[1, 2, 3], [4, 4, 40], [7]]
    replies = [[5, 5, 2], [], [9, 9, 9, 1]]
    presence, frequency, repetition = torch.tensor([0.5, 0.0, -1.0]), torch.tensor([1.0, 0.0, 2.0]), \
        torch.tensor([1.3, 2.0, 0.7])
    bias_ids, bias = torch.tensor([[3, 0], [10, 11], [0, 0]]), torch.tensor([[5.0, 0.0], [-100.0, 2.5], [0.0, 0.0]])
    banned_ids, banned = torch.tensor([[2], [4], [9]]), torch.tensor([[0.0], [float("-inf")], [0.0]])
    counts = torch.zeros(3, 50, dtype=torch.int32)
    in_prompt = torch.zeros(3, 50, dtype=torch.bool)
    for r in range(3):
        in_prompt[r, prompts[r]] = True
        for t in replies[r]:
            counts[r, t] += 1
    got = penalized_logits(logits, counts, in_prompt, presence, frequency, repetition, bias_ids, bias, banned_ids,
                           banned)
    for r in range(3):
        want = logits[r:r + 1].clone()
        for t, b in zip(bias_ids[r].tolist(), bias[r].tolist()):
            want[0, t] += b
        want[0, banned_ids[r]] += banned[r]
        ids = torch.tensor([prompts[r] + replies[r]])
        want = RepetitionPenaltyLogitsProcessor(float(repetition[r]))(ids, want)
        reply = torch.bincount(torch.tensor(replies[r], dtype=torch.long), minlength=50).float()
        want = want - frequency[r] * reply - presence[r] * (reply > 0).float()
        assert torch.allclose(got[r], want[0], atol=1e-5), r
    assert got[1, 4] == float("-inf") and got[1, 10] < logits[1, 10] - 99


def test_min_p_draws_what_the_logits_without_the_unlikely_tokens_draw():
    torch.manual_seed(2)
    logits = torch.randn(5, 80) * 3  # (B, V)
    temperature = torch.tensor([0.7, 1.0, 2.0, 0.0, 1.3])
    min_p = torch.tensor([0.1, 0.0, 0.5, 0.9, 1.0])
    top_k, top_p = torch.full((5,), 80), torch.full((5,), TOP_P_DISABLED)
    seed, position = torch.arange(5) + 10, torch.arange(5)
    probs = torch.softmax(logits / temperature.clamp_min(1e-5).unsqueeze(1), dim=-1)
    dropped = probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    want = sample_rows(logits.masked_fill(dropped, float("-inf")), temperature, top_k, top_p, seed, position)
    got = sample_rows(logits, temperature, top_k, top_p, seed, position, min_p)
    assert torch.equal(got, want)
    assert got[4] == logits[4].argmax() and got[3] == logits[3].argmax()
    many = sample_rows(logits[2:3].repeat(2000, 1), torch.full((2000,), 2.0), torch.full((2000,), 80),
                       torch.full((2000,), TOP_P_DISABLED), torch.arange(2000), torch.zeros(2000, dtype=torch.long),
                       torch.full((2000,), 0.5))
    assert not dropped[2, many].any() and len(set(many.tolist())) > 1  # only kept tokens, more than one of them


def test_sampling_params_check_the_new_settings_in_one_line():
    from redline.sampling import SamplingParams

    params = SamplingParams(logit_bias={"7": 2, 3: -1.5})
    assert params.logit_bias == ((3, -1.5), (7, 2.0)) and params.penalized
    assert not SamplingParams(temperature=0.5, top_k=3).penalized
    for settings, words in ((dict(presence_penalty=float("nan")), "presence_penalty"),
                            (dict(frequency_penalty=True), "frequency_penalty"),
                            (dict(repetition_penalty=-1.0), "repetition_penalty must be a number > 0"),
                            (dict(min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
                            (dict(logit_bias=[(1, 2, 3)]), "logit_bias must map"),
                            (dict(logit_bias={-4: 1}), "logit_bias keys")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**settings)


def test_penalty_slots_count_tokens_and_rebuild_a_reused_slot():
    from redline.runner.penalties import PenaltySlots, RowPenalties

    state = PenaltySlots(2, 20, torch.device("cpu"))
    a, b, c = object(), object(), object()
    row = RowPenalties(frequency=1.0, repetition=2.0, min_tokens=2, min_banned=(0,))
    sa = state.assign(a, row, [1, 2], [5, 5])
    sb = state.assign(b, RowPenalties(presence=1.0), [3], [])
    assert sa != sb and state.counts[sa, 5] == 2 and state.in_prompt[sa, [1, 2]].all() and state.generated[sa] == 2
    slots = torch.tensor([sa, sb, state.scratch])
    state.count(slots, torch.tensor([6, 6, 6]))
    assert state.counts[sa, 6] == 1 and state.counts[sb, 6] == 1 and state.generated[sb] == 1
    logits, min_p = state.apply(torch.zeros(3, 20), slots)
    assert logits[0, 6] == -1.0 and logits[1, 6] == -1.0 and logits[2].eq(0).all()  # the scratch row is neutral
    sc = state.assign(c, RowPenalties(min_tokens=3, min_banned=(4,)), [9], [8], keep=[a, c])  # b's is taken
    assert sc == sb and state.slot_of(b) is None and state.counts[sc].sum() == 1 and state.counts[sc, 8] == 1
    early, _ = state.apply(torch.zeros(1, 20), torch.tensor([sc]))
    assert early[0, 4] == float("-inf")  # one token of three so far: its banned id cannot come yet
    state.release(a)
    assert state.slot_of(a) is None and state.assign(b, RowPenalties(), [1], []) == sa
