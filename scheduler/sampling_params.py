"""Per-request sampling parameters, validated on construction.

The scheduler reads only ``n``, ``max_tokens``, ``stop_token_ids`` and ``stop`` (stop strings,
checked when the scheduler was given a ``detokenize`` callable); the rest is carried for the
engine's sampler (``paged_backend.integration.sampler``) and its outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real


def _int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return int(value)


SEED_MIN, SEED_END = -2 ** 63, 2 ** 64  # seeds in [SEED_MIN, SEED_END): int64 or uint64 values


def _seed(value) -> int:
    """A seed as the engine uses it: an int in [0, 2**64) (negative ones -> their uint64)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not SEED_MIN <= int(value) < SEED_END:
        raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {value!r}")
    return int(value) % SEED_END


@dataclass
class SamplingParams:
    """How to sample one request.

    n:              number of samples that share the prompt (>= 1); the prompt is prefilled
                    once and forked into n sequences (copy-on-write KV blocks).
    temperature:    >= 0; 0 means greedy.
    top_p:          in (0, 1]: keep the smallest set of most likely tokens whose probability
                    reaches top_p (after top_k).
    top_k:          -1 or 0 disables; otherwise >= 1: keep the k most likely tokens.
    min_p:          in [0, 1]: drop tokens less likely than min_p times the most likely one.
    max_tokens:     >= 1 generated tokens per sample.
    seed:           None or an int in [-2**63, 2**64), kept as its uint64 (a negative seed becomes
                    seed + 2**64, its two's complement): the request's samples are a function of
                    the seed, the model and the prompt alone (not of the batch they run in).
    stop_token_ids: token ids that end a sample; the engine adds the model's EOS unless
                    ignore_eos. The stop token is kept in the token ids.
    stop:           stop strings (a str or a sequence of non-empty str); need a detokenizer.
                    The text ends before the first stop string.
    logprobs:       None, or k >= 0: also return the k most likely tokens' log-probabilities at
                    each step (the sampled token's is always returned).
    ignore_eos:     keep sampling past the model's EOS (benchmarks: a fixed output length).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    min_p: float = 0.0
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, 1)
        self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            setattr(self, name, float(v))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self.top_k = _int("top_k", self.top_k, -1)
        if self.top_k == 0:
            self.top_k = -1
        if self.seed is not None:
            self.seed = _seed(self.seed)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(_int("stop_token_ids[i]", t, 0) for t in self.stop_token_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not hasattr(stop, "__iter__"):
            raise ValueError(f"stop must be a str or a sequence of str, got {self.stop!r}")
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self.stop = stop
        self._stop_ids = frozenset(self.stop_token_ids)
        self._stop_window = 4 * max(map(len, stop), default=0) + 4  # output tokens a stop check decodes

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
