from types import SimpleNamespace

import numpy as np
import pytest
import torch

from paged_backend.integration.requests import Request
from paged_backend.integration.sampler import Sampler
from paged_backend.integration.sample_book import SampleBook
from paged_backend.scheduler import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens == 16 and p.top_k == -1 and p.stop == () and not p.greedy
    p = SamplingParams(n=4, temperature=0, top_k=0, stop="###", stop_token_ids=[2, 7], seed=3)
    assert p.greedy and p.top_k == -1 and p.stop == ("###",) and p.stop_token_ids == (2, 7)
    assert p._stop_ids == {2, 7} and isinstance(p.temperature, float)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), "n must be >= 1"),
    (dict(n=1.5), "n must be an integer"),
    (dict(n=True), "n must be an integer"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be >= -1"),
    (dict(stop_token_ids=[1, -3]), r"stop_token_ids\[i\] must be >= 0"),
    (dict(stop_token_ids=5), "stop_token_ids must be a sequence"),
    (dict(stop_token_ids="ab"), "stop_token_ids must be a sequence"),
    (dict(stop=[""]), "stop strings must be non-empty"),
    (dict(stop=[3]), "stop strings must be non-empty str"),
    (dict(stop=3), "stop must be a str or a sequence"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_p=None), "min_p must be a finite number"),
    (dict(logprobs=-1), "logprobs must be >= 0"),
    (dict(logprobs=2.0), "logprobs must be an integer"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
])
def test_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [2 ** 64, -2 ** 63 - 1, 1.5, "3", True])
def test_seed_outside_int64_uint64_or_not_an_int_is_refused(seed):
    with pytest.raises(ValueError, match=r"seed must be None or an int in \[-2\*\*63, 2\*\*64\)"):
        SamplingParams(seed=seed)


def _step_rows(book, params_by_id, positions=(0, 3)):
    """SampleBook rows for one decode row per request and position (no model: a stand-in batch)."""
    seqs = [SimpleNamespace(group=SimpleNamespace(request_id=rid), seq_id=k, token_ids=[1] * (2 + pos),
                            num_prompt_tokens=2, num_output_tokens=pos)
            for k, (rid, pos) in enumerate((rid, pos) for rid in params_by_id for pos in positions)]
    return book.rows(SimpleNamespace(num_samples=np.ones(len(seqs), np.int32), seqs=seqs))[0]


@pytest.mark.parametrize("seed, kept", [(2 ** 64 - 1, 2 ** 64 - 1), (2 ** 63, 2 ** 63), (-1, 2 ** 64 - 1),
                                        (-2 ** 63, 2 ** 63), (0, 0), (np.int64(-2), 2 ** 64 - 2),
                                        (np.uint64(2 ** 64 - 1), 2 ** 64 - 1)])
def test_seeds_of_int64_and_uint64_are_accepted_and_draw_tokens(seed, kept):
    p = SamplingParams(seed=seed, temperature=1.0)
    assert p.seed == kept and type(p.seed) is int
    book = SampleBook()
    book.add(Request("r", None, [1, 2], p, p.seed))
    rows = _step_rows(book, {"r": p})
    tokens = Sampler(50, "cpu")(torch.zeros(2, 50), rows).tokens  # uniform logits: the key alone picks
    assert tokens.shape == (2,) and ((0 <= tokens) & (tokens < 50)).all()
    if seed == -1:  # a negative seed is its two's complement
        book.add(Request("u", None, [1, 2], p, 2 ** 64 - 1))
        assert np.array_equal(_step_rows(book, {"u": p}).key, rows.key)


def test_seeds_below_2_63_keep_their_noise_keys():
    """The keys of seeds valid before uint64 seeds (0..2**63-1) are unchanged: the same samples."""
    book = SampleBook()
    want = {0: [1389948411, 760251403], 1234: [2265689839, 3372204209], 2 ** 63 - 1: [1689424708, 4103107614]}
    for seed in want:
        book.add(Request(str(seed), None, [1, 2], SamplingParams(seed=seed), seed))
    seqs = [SimpleNamespace(group=SimpleNamespace(request_id=str(seed)), seq_id=k, token_ids=[1] * (2 + pos),
                            num_prompt_tokens=2, num_output_tokens=pos)
            for k, (seed, pos) in enumerate((seed, pos) for seed in want for pos in (0, 7))]
    book.index.update({k: 2 for k in range(1, len(seqs), 2)})  # the second row of each: sample index 2
    rows = book.rows(SimpleNamespace(num_samples=np.ones(len(seqs), np.int32), seqs=seqs))[0]
    assert rows.key.tolist() == [k for keys in want.values() for k in keys]
