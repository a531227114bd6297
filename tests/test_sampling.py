"""SamplingParams validation, Sampler filters and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from mmserve.engine.sampler import Sampler, greedy_tokens, make_generator
from mmserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_invalid_params_raise_value_error_naming_param(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_params_normalisation_and_greedy() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[5])
    assert p.stop == ("###",)
    assert p.stop_token_ids == (5,)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=-1).greedy
    assert not SamplingParams().greedy


def _logits(batch: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_equals_argmax_first_index_on_ties() -> None:
    logits = _logits()
    logits[0, 7] = logits[0, 11] = logits[0].max() + 1
    params = [SamplingParams(temperature=0)] * 4
    out = Sampler()(logits, params, [None] * 4)
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.argmax(logits, dim=-1))
    assert out[0].item() == 7


def test_greedy_bf16_logits() -> None:
    logits = _logits().to(torch.bfloat16)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert torch.equal(out, torch.argmax(logits.float(), dim=-1))


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(batch=8)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    assert torch.equal(Sampler()(logits, params, [None] * 8), torch.argmax(logits, dim=-1))


def test_tiny_top_p_keeps_only_max() -> None:
    logits = _logits(batch=8)
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 8
    for _ in range(5):
        assert torch.equal(Sampler()(logits, params, [None] * 8), torch.argmax(logits, dim=-1))


def test_top_k_restricts_to_k_largest() -> None:
    logits = _logits(batch=1, vocab=100)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=5.0, top_k=3)]
    seen = {Sampler()(logits, params, [gen]).item() for _ in range(200)}
    assert seen <= allowed
    assert len(seen) == 3


def test_top_p_keeps_smallest_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps exactly the first two (0.5 + 0.3 >= 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(top_p=0.8)]
    seen = {Sampler()(logits, params, [gen]).item() for _ in range(300)}
    assert seen == {0, 1}


def test_min_p_filters_low_probability_tokens() -> None:
    # probs 0.4, 0.3, 0.2, 0.1: min_p=0.6 keeps tokens with prob >= 0.24, i.e. 0 and 1.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(min_p=0.6)]
    seen = {Sampler()(logits, params, [gen]).item() for _ in range(300)}
    assert seen == {0, 1}


def _run(seed: int, steps: int = 20) -> list[int]:
    params = SamplingParams(temperature=1.0, seed=seed)
    gen = make_generator(params)
    logits_gen = torch.Generator().manual_seed(123)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(1, 1000, generator=logits_gen)
        tokens.append(Sampler()(logits, [params], [gen]).item())
    return tokens


def test_same_seed_same_sequence_different_seed_differs() -> None:
    assert make_generator(SamplingParams()) is None
    assert _run(7) == _run(7)
    assert _run(7) != _run(8)


def test_seeded_row_independent_of_batch_neighbours() -> None:
    logits = _logits(batch=3, vocab=200)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler()(logits[1:2], [seeded], [make_generator(seeded)])
    others = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0)]
    mixed = Sampler()(logits, [others[0], seeded, others[1]], [None, make_generator(seeded), None])
    assert mixed[1] == alone[0]
    assert mixed[2] == torch.argmax(logits[2])


def test_temperature_sampling_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(2000, 3).contiguous()
    torch.manual_seed(0)
    out = Sampler()(logits, [SamplingParams(temperature=1.0)] * 2000, [None] * 2000)
    freq = torch.bincount(out, minlength=3).float() / 2000
    assert torch.allclose(freq, probs, atol=0.05)
    # A low temperature sharpens the distribution towards the argmax.
    cold = Sampler()(logits, [SamplingParams(temperature=0.2)] * 2000, [None] * 2000)
    assert (cold == 0).float().mean() > 0.95


def test_tiny_temperature_is_finite() -> None:
    logits = _logits(batch=2)
    out = Sampler()(logits, [SamplingParams(temperature=1e-30)] * 2, [None] * 2)
    assert torch.equal(out, torch.argmax(logits, dim=-1))


def test_sampler_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError, match="params"):
        Sampler()(_logits(batch=2), [SamplingParams()], [None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 512, 151_936, 151_937])
def test_greedy_tokens_is_argmax_with_its_ties_and_nans(dtype, vocab):
    """The two-level argmax picks exactly what `argmax` picks: the first maximum, NaN as the maximum, in the
    last partial block too, in the logits' own dtype."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen).to(dtype)
    last = vocab - 1
    logits[1, :] = 0.0  # all tied: id 0
    logits[2, [3, last]] = 50.0  # tie between the first block and the end: the first
    logits[3, last] = 60.0  # the maximum past the last whole block
    logits[4, [min(300, last), last]] = float("nan")  # the first NaN
    logits[5, last] = float("nan")
    logits[6, :] = float("-inf")
    logits[7, [min(256, last), min(257, last)]] = 70.0  # a tie inside one block
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
