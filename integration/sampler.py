"""Batched token sampling on the device: one call per step for every sample row, no Python loop
over sequences.

Per row: greedy (temperature 0: argmax of the raw logits) or, for temperature > 0, vLLM v1's
definitions in vLLM's order: logits / T; min-p (drop tokens with p < min_p * p_max); top-k (keep
every token whose logit is >= the k-th largest: tokens tied with the k-th all stay); top-p over
what is left, renormalised (keep a token while the mass of the tokens strictly more likely than it
is < top_p: tied tokens stay or go together, and the most likely token always stays; the masses
summed in fp64, paged_backend/top_p.py); one draw. Each filter raises a per-row floor, and one mask
drops the tokens below it: no row is sorted on the GPU. Draws use the Gumbel-max trick with noise
from a counter-based hash of (request seed, sample index, output position, token id) instead of a
stateful generator: a sample depends only on its own seed, logits and position - not on the batch
it runs in, nor on preemption - and a seeded request is reproducible without a generator object
per request.

The log-probability of the sampled token (for ``cumulative_logprob``) and the optional top-k
log-probabilities come from the raw logits (log_softmax before temperature and filtering), as
vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_backend.gumbel import M32, gumbel_argmax, gumbel_sample, mix32, vocab_hash
from paged_backend.top_p import top_p_floor

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
    log-probability of each sampled token), ``top_ids``/``top_logprobs [S, K]`` or None, and
    ``packed [S, 2]`` float64 (tokens and log-probabilities side by side, what goes to the host in
    one copy) where the draw wrote it, or None."""
    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    packed: torch.Tensor | None = None


class Sampler:
    """Samples S rows of logits ``[S, V]`` on their device; vocabulary hashes are made once.

    A draw is :meth:`sample` on the device (no host work, no sync: the engine's decode graphs hold
    it) from the rows' :class:`SampleSettings` (:meth:`settings`, made on the host) and noise keys;
    ``__call__`` makes both and calls it."""

    def __init__(self, vocab_size: int, device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._vocab_hash = vocab_hash(vocab_size, self.device)  # [V]
        self._settings = None  # the last rows' settings arrays and what was made of them (see settings)
        self._uploaded = None  # (the last settings uploaded, their device tensors)

    def __call__(self, logits: torch.Tensor, rows: SampleRows) -> Sampled:
        """logits [S, V] (any float dtype) -> :class:`Sampled`."""
        s, v = logits.shape
        if v != self.vocab_size:
            raise ValueError(f"logits must have {self.vocab_size} columns (the vocabulary), got {v}")
        dev = logits.device
        if s == 0:  # a step of prefill chunks only: nothing to draw
            return Sampled(torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, device=dev))
        st = self.settings(rows)
        last = self._uploaded
        if last is None or last[0] is not st or last[1][0].device != dev:  # (asynchronous copies from pinned memory)
            self._uploaded = last = (st, to_device([st.k, st.temp, st.min_p, st.top_p, st.greedy], dev))
        key = None if st.mode.all_greedy else to_device([rows.key.astype(np.int64)], dev)[0]
        return self.sample(logits, st.mode, *last[1], key)

    def settings(self, rows: SampleRows) -> SampleSettings:
        """The rows' settings as the draw reads them, made once for the settings arrays of a batch:
        the engine passes the same arrays while a decode batch keeps its samples (SampleBook.rows)."""
        v = self.vocab_size
        arrays = (rows.temperature, rows.top_k, rows.top_p, rows.min_p)
        last = self._settings
        if last is not None and last[1] == rows.num_logprobs and all(a is b for a, b in zip(arrays, last[0])):
            return last[2]
        greedy = rows.temperature == 0
        use_k = (rows.top_k > 0) & (rows.top_k < v)
        use_p = rows.top_p < 1.0
        k_max = int(rows.top_k[use_k].max()) if use_k.any() else 0
        width = 1 << (k_max - 1).bit_length() if k_max else 0  # (a few widths: a few graphs)
        mode = SampleMode(bool(greedy.any()), bool(greedy.size) and bool(greedy.all()), bool((rows.min_p > 0).any()),
                          bool(use_k.any()), bool(use_p.any()), min(int(rows.num_logprobs), v), width)
        st = SampleSettings(mode, np.where(use_k, rows.top_k, v).astype(np.int64),
                            np.where(greedy, 1.0, rows.temperature).astype(np.float32), rows.min_p.astype(np.float32),
                            np.where(use_p, rows.top_p, np.inf).astype(np.float32), greedy)
        self._settings = (arrays, rows.num_logprobs, st)
        return st

    def sample(self, logits: torch.Tensor, mode: SampleMode, k: torch.Tensor, temp: torch.Tensor,
               min_p: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor, key: torch.Tensor | None) -> Sampled:
        """The draw on the device, no host work: logits [S, V]; ``mode`` (which steps run) and the
        per-row settings [S] of :class:`SampleSettings` on the device; ``key`` [S] int64 noise keys
        (``SampleRows.key``; unused, may be None, when every row is greedy) -> :class:`Sampled`."""
        if mode.plain:  # temperature only (the common case): the draw and its log-probability in one pass
            return Sampled(*gumbel_sample(logits, temp, key, self._vocab_hash))
        logits = logits.float()
        raw_lse = torch.logsumexp(logits, dim=-1)  # [S]
        tokens = torch.argmax(logits, dim=-1) if mode.any_greedy else None
        if not mode.all_greedy:
            x = logits / temp[:, None]
            if mode.any_min_p or mode.any_k or mode.any_p:  # each filter raises the rows' floors [S]
                x = x.masked_fill(x < _floors(x, mode, k, min_p, top_p)[:, None], float("-inf"))
            # Gumbel-max: argmax(x + g) with g = -log(-log(u)), u uniform in (0, 1) from the hash
            drawn = gumbel_argmax(x, key, self._vocab_hash)
            tokens = drawn if tokens is None else torch.where(greedy, tokens, drawn)
        logprobs = logits.gather(1, tokens[:, None])[:, 0] - raw_lse
        out = Sampled(tokens, logprobs)
        if mode.num_logprobs > 0:
            top, ids = torch.topk(logits, mode.num_logprobs, dim=-1)
            out.top_ids, out.top_logprobs = ids, top - raw_lse[:, None]
        return out


@dataclass(frozen=True)
class SampleMode:
    """Which steps a batch's draw runs (what a CUDA graph of it fixes): any greedy row, every row
    greedy, any min-p, top-k or top-p row, the top log-probabilities returned per row, and the width
    of the ``torch.topk`` that finds each row's k-th largest value (a power of two >= every row's k;
    0 without top-k)."""
    any_greedy: bool = False
    all_greedy: bool = False
    any_min_p: bool = False
    any_k: bool = False
    any_p: bool = False
    num_logprobs: int = 0
    top_k_width: int = 0

    @property
    def plain(self) -> bool:
        """Every row draws with its temperature alone (the default settings): one pass."""
        return not (self.any_greedy or self.any_min_p or self.any_k or self.any_p or self.num_logprobs)


@dataclass
class SampleSettings:
    """A batch's sampling settings as the draw reads them: its ``mode`` and per row [S] ``k`` int64
    (V = off), ``temp`` float32 (1 for greedy rows), ``min_p`` float32, ``top_p`` float32 (inf =
    off), ``greedy`` bool (host arrays)."""
    mode: SampleMode
    k: np.ndarray
    temp: np.ndarray
    min_p: np.ndarray
    top_p: np.ndarray
    greedy: np.ndarray


def _floors(x: torch.Tensor, mode: SampleMode, k: torch.Tensor, min_p: torch.Tensor,
            top_p: torch.Tensor) -> torch.Tensor:
    """[S] fp32: the least value each row of ``x [S, V]`` keeps, after min-p (p >= min_p * p_max,
    i.e. x >= x_max + log(min_p)), top-k (x >= the k-th largest: ties with it stay; the k-th of
    the min-p survivors is the k-th of the row where it survives min-p) and top-p over what is left."""
    if mode.any_min_p:
        floor = x.max(dim=-1).values + torch.log(min_p)
    else:
        floor = torch.full((x.shape[0],), float("-inf"), device=x.device)
    if mode.any_k:  # the k-th largest from a torch.topk of a power-of-two width >= every k, not a sort
        top = torch.topk(x, min(mode.top_k_width, x.shape[1]), dim=-1).values  # [S, W] descending
        kth = top.gather(1, (k.clamp(max=top.shape[1]) - 1)[:, None])[:, 0]
        floor = torch.maximum(floor, torch.where(k < x.shape[1], kth, float("-inf")))
    if mode.any_p:
        floor = top_p_floor(x, floor, top_p)
    return floor
