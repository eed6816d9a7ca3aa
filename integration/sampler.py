"""Batched token sampling on the device: one call per step for every sample row, no Python loop
over sequences.

Per row: greedy (temperature 0: argmax of the raw logits) or, for temperature > 0, vLLM v1's
definitions in vLLM's order: logits / T; min-p (drop tokens with p < min_p * p_max); top-k (keep
every token whose logit is >= the k-th largest: tokens tied with the k-th all stay); top-p over
what is left, renormalised (keep a token while the mass of the tokens strictly more likely than it
is < top_p: tied tokens stay or go together, and the most likely token always stays); one draw. Draws use the Gumbel-max trick with noise from a counter-based hash of (request seed,
sample index, output position, token id) instead of a stateful generator: a sample depends only
on its own seed, logits and position - not on the batch it runs in, nor on preemption - and a
seeded request is reproducible without a generator object per request.

The log-probability of the sampled token (for ``cumulative_logprob``) and the optional top-k
log-probabilities come from the raw logits (log_softmax before temperature and filtering), as
vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_backend.gumbel import M32, gumbel_argmax, gumbel_sample, mix32, vocab_hash

from .step import to_device

def row_keys(seeds: np.ndarray, sample_index: np.ndarray, position: np.ndarray) -> np.ndarray:
    """[S] uint32 noise key of each sample row from its request seed (< 2^64), its index among the
    request's samples and its output position (the index of the token being drawn)."""
    return keys_at(sample_keys(seeds, sample_index), position)


def sample_keys(seeds: np.ndarray, sample_index: np.ndarray) -> np.ndarray:
    """[S] uint32: the part of :func:`row_keys` fixed for a sample (its seed and index)."""
    seeds = np.asarray(seeds, np.uint64)
    k = mix32((seeds & np.uint64(M32)).astype(np.uint32) ^ mix32((seeds >> np.uint64(32)).astype(np.uint32)))
    return mix32(k ^ mix32(np.asarray(sample_index, np.uint32) + np.uint32(0x632BE5AB)))


def keys_at(sample_key: np.ndarray, position: np.ndarray) -> np.ndarray:
    """[S] uint32 row keys of samples (:func:`sample_keys`) drawing their token at ``position``."""
    return mix32(sample_key ^ mix32(np.asarray(position, np.uint32) + np.uint32(0x2545F491)))


@dataclass
class SampleRows:
    """Host arrays, one entry per sample row ([S]): what each draw needs."""
    temperature: np.ndarray  # float32, 0 = greedy
    top_k: np.ndarray        # int64, -1 = off
    top_p: np.ndarray        # float32, 1 = off
    min_p: np.ndarray        # float32, 0 = off
    key: np.ndarray          # uint32 noise keys (row_keys)
    num_logprobs: int = 0    # top log-probs to return for every row (the largest asked for)


@dataclass
class Sampled:
    """Device results for S rows: ``tokens [S]`` int64, ``logprobs [S]`` float32 (raw
    log-probability of each sampled token), ``top_ids``/``top_logprobs [S, K]`` or None."""
    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    """Samples S rows of logits ``[S, V]`` on their device; vocabulary hashes are made once."""

    def __init__(self, vocab_size: int, device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._vocab_hash = vocab_hash(vocab_size, self.device)  # [V]
        self._settings = None  # the last rows' settings arrays and what was made of them (see _filters)

    def __call__(self, logits: torch.Tensor, rows: SampleRows) -> Sampled:
        """logits [S, V] (any float dtype) -> :class:`Sampled`."""
        s, v = logits.shape
        if v != self.vocab_size:
            raise ValueError(f"logits must have {self.vocab_size} columns (the vocabulary), got {v}")
        dev = logits.device
        if s == 0:  # a step of prefill chunks only: nothing to draw
            return Sampled(torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, device=dev))
        f = self._filters(rows, v, dev)
        # (an asynchronous copy: a pageable one waits for the forward)
        key = None if f.all_greedy else to_device([rows.key.astype(np.int64)], dev)[0]
        if _plain(f, rows):  # temperature only (the common case): the draw and its log-probability in one pass
            return Sampled(*self.draw(logits, f.temp, key))
        logits = logits.float()
        raw_lse = torch.logsumexp(logits, dim=-1)  # [S]
        tokens = torch.argmax(logits, dim=-1) if f.any_greedy else None
        if not f.all_greedy:
            x = logits / f.temp[:, None]
            if f.any_min_p:
                x = _min_p(x, f.min_p)
            if f.any_k or f.any_p:
                x = _top_k_top_p(x, f.k, f.top_p if f.any_p else None)
            # Gumbel-max: argmax(x + g) with g = -log(-log(u)), u uniform in (0, 1) from the hash
            drawn = gumbel_argmax(x, key, self._vocab_hash)
            tokens = drawn if tokens is None else torch.where(f.greedy, tokens, drawn)
        logprobs = logits.gather(1, tokens[:, None])[:, 0] - raw_lse
        out = Sampled(tokens, logprobs)
        if rows.num_logprobs > 0:
            top, ids = torch.topk(logits, min(rows.num_logprobs, v), dim=-1)
            out.top_ids, out.top_logprobs = ids, top - raw_lse[:, None]
        return out

    def plain(self, rows: SampleRows) -> bool:
        """Whether every row draws with its temperature alone (no greedy row, filter or log-probabilities):
        the draw :meth:`draw` makes, which the engine's decode graphs hold. ``rows`` [S] as ``__call__``'s."""
        if not rows.key.size:  # (a step of prefill chunks only: nothing drawn, no settings to upload)
            return False
        return _plain(self._filters(rows, self.vocab_size, self.device), rows)

    def draw(self, logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor):
        """The draw of rows with a temperature alone: logits [S, V], temperature [S] fp32 (> 0), keys
        [S] int64 (``SampleRows.key``) on the device -> (tokens [S] int64, logprobs [S] fp32), the
        tokens and log-probabilities ``__call__`` gives such rows (the same kernel and inputs)."""
        return gumbel_sample(logits, temperature, keys, self._vocab_hash)

    def _filters(self, rows: SampleRows, v: int, dev) -> _Filters:
        """The rows' settings on the device, made once for the settings arrays of a batch: the engine
        passes the same arrays while a decode batch keeps its samples (SampleBook.rows)."""
        arrays = (rows.temperature, rows.top_k, rows.top_p, rows.min_p)
        last = self._settings
        if last is not None and last[1] == v and all(a is b for a, b in zip(arrays, last[0])):
            return last[2]
        greedy_np = rows.temperature == 0
        use_k = (rows.top_k > 0) & (rows.top_k < v)
        use_p = rows.top_p < 1.0
        # every row's settings in one copy
        k, temp, min_p, top_p, greedy = to_device(
            [np.where(use_k, rows.top_k, v).astype(np.int64), np.where(greedy_np, 1.0, rows.temperature).astype(np.float32),
             rows.min_p.astype(np.float32), np.where(use_p, rows.top_p, np.inf).astype(np.float32), greedy_np], dev)
        f = _Filters(bool(greedy_np.any()), bool(greedy_np.all()), bool(use_k.any()), bool(use_p.any()),
                     bool((rows.min_p > 0).any()), k, temp, min_p, top_p, greedy)
        self._settings = (arrays, v, f)
        return f


@dataclass
class _Filters:
    """A batch's sampling settings: which filters any row uses (host), and per row on the device
    ``k [S]`` (V = off), ``temp [S]`` (1 for greedy rows), ``min_p``, ``top_p [S]`` (inf = off),
    ``greedy [S]`` bool."""
    any_greedy: bool
    all_greedy: bool
    any_k: bool
    any_p: bool
    any_min_p: bool
    k: torch.Tensor
    temp: torch.Tensor
    min_p: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor


def _plain(f: _Filters, rows: SampleRows) -> bool:
    return not (f.any_greedy or f.any_min_p or f.any_k or f.any_p or rows.num_logprobs)


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [S, V] without the tokens under ``min_p [S]`` times the most likely one's probability."""
    # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
    floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return x.masked_fill(x < floor, float("-inf"))


def _top_k_top_p(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """x [S, V] with top-k (``k [S]``, V = off) then top-p (``top_p [S]``, inf = off) as -inf."""
    v = x.shape[1]
    srt, idx = torch.sort(x, dim=-1, descending=True)  # [S, V]
    drop = srt < srt.gather(1, k[:, None] - 1)  # below the k-th largest (ties with it stay)
    if top_p is not None:
        p = torch.softmax(srt.masked_fill(drop, float("-inf")), dim=-1)
        before = torch.cumsum(p, dim=-1) - p  # mass of the tokens sorted ahead
        # a tie group takes the mass ahead of its first member: strictly more likely tokens only
        rank = torch.arange(v, device=x.device).expand_as(srt)
        starts = torch.ones_like(drop)
        starts[:, 1:] = srt[:, 1:] != srt[:, :-1]
        first = torch.cummax(torch.where(starts, rank, 0), dim=-1).values
        drop |= before.gather(1, first) >= top_p[:, None]  # the most likely tokens have 0 ahead
    return x.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
