import pytest

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
    (dict(seed=-1), "seed must be >= 0"),
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
