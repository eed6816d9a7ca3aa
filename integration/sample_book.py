"""Per-request and per-sample bookkeeping of the engine: each request's sampling settings (checked
when it is added), which draw a sample makes next (for its noise key),
its log-probabilities so far, and its final :class:`CompletionOutput`.

A sample is a scheduler ``Sequence``; its index among its request's samples is fixed when the
request forks (its prompt's last step draws ``n`` tokens, one per sample, in order).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from operator import is_

import numpy as np

from .outputs import CompletionOutput, RequestOutput
from .requests import Request
from .sampler import SampleRows, keys_at, sample_keys


@dataclass(frozen=True)
class Draw:
    """What drawing a request's samples needs, checked and converted once when it is added."""
    seed: np.uint64
    temperature: np.float32
    top_k: np.int64
    top_p: np.float32
    min_p: np.float32
    logprobs: int


def draw_of(request: Request) -> Draw:
    """request -> its :class:`Draw`. Raises ValueError for a seed outside [0, 2**64) and
    ValueError/TypeError/OverflowError for a setting numpy cannot convert: values that got past
    ``SamplingParams``' checks (set after it was made)."""
    seed, p = request.seed, request.params
    if isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= int(seed) < 2 ** 64:
        raise ValueError(f"seed must be an int in [0, 2**64) (SamplingParams maps [-2**63, 0) there), got {seed!r}")
    return Draw(np.uint64(int(seed)), np.float32(p.temperature), np.int64(p.top_k), np.float32(p.top_p),
                np.float32(p.min_p), int(p.logprobs or 0))


class SampleBook:
    def __init__(self):
        self.draws: dict[str, Draw] = {}        # request id -> its sampling settings
        self.index: dict[int, int] = {}        # seq id -> sample index (absent: 0)
        self.cumulative: dict[int, float] = {}  # seq id -> sum of its tokens' log-probabilities
        self.logprobs: dict[int, list] = {}     # seq id -> per token {id: log-probability}
        self._same = None  # the last step's (sequences, their sample keys, fixed settings), see rows
        self._sample_keys = None
        self._sums = None  # the steady step's (sequences, their cumulative sums [B] float64), see record

    def add(self, request: Request) -> None:
        """Keeps a request's :class:`Draw` before it is scheduled: a bad value raises here (see
        :func:`draw_of`), so it fails that request alone, never a step."""
        self.draws[request.request_id] = draw_of(request)

    def rows(self, batch) -> tuple[SampleRows, np.ndarray | None]:
        """The step's sample rows: each row with num_samples = c > 0 gives c rows (a prompt that
        forks into n samples draws n tokens from its last position). -> (rows, c per row, or None
        when every c is 1). A step of the same sequences as the last one, each drawing one token
        (the usual decode step), reuses their settings arrays and noise-key parts: only the
        positions are read anew."""
        seqs, same = batch.seqs, self._same
        if same is not None and _same_samples(seqs, same[0]) and (batch.num_samples == 1).all():
            position = np.fromiter((s.num_output_tokens for s in seqs), np.int64, len(seqs))
            return SampleRows(**same[2], key=keys_at(same[1], position)), None
        rows, fork = self._rows(batch)
        self._same = None
        if fork is None and len(rows.temperature) == len(seqs):  # (every row draws one token)
            fixed = dict(temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p, min_p=rows.min_p,
                         num_logprobs=rows.num_logprobs)
            self._same = (list(seqs), self._sample_keys, fixed)
        return rows, fork

    def _rows(self, batch) -> tuple[SampleRows, np.ndarray | None]:
        sel = np.flatnonzero(batch.num_samples)
        counts = batch.num_samples[sel]
        seqs = [batch.seqs[i] for i in sel]
        draws = [self.draws[s.group.request_id] for s in seqs]
        index = np.array([self.index.get(s.seq_id, 0) for s in seqs], np.int64)
        position = np.array([s.num_output_tokens for s in seqs], np.int64)
        fork = None
        if (counts > 1).any():
            rep = np.repeat(np.arange(len(sel)), counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            index = index[rep] + (np.arange(rep.size) - first)  # a fork row's samples are 0..n-1
            position = position[rep]
            draws = [draws[i] for i in rep]
            fork = counts.astype(np.int64)
        rows = SampleRows(
            temperature=np.array([d.temperature for d in draws], np.float32),
            top_k=np.array([d.top_k for d in draws], np.int64),
            top_p=np.array([d.top_p for d in draws], np.float32),
            min_p=np.array([d.min_p for d in draws], np.float32),
            key=keys_at(sampled := sample_keys(np.array([d.seed for d in draws], np.uint64), index), position),
            num_logprobs=max((d.logprobs for d in draws), default=0))
        self._sample_keys = sampled
        return rows, fork

    def record(self, batch, tokens: np.ndarray, logprobs: np.ndarray, top, stale: np.ndarray | None = None) -> None:
        """After ``postprocess``: each sampled token's log-probability (and top-k) joins its
        sample's totals; a forked request's samples get their indices. ``stale [B]``: rows of
        samples that had finished before the step (a step run ahead), whose tokens are dropped.
        A step of the same samples as the last one, one token each, none asking for per-token
        log-probabilities (the usual decode step), adds to their sums in one array (the same sums,
        in the same order: 64 rows took ~55 us of a step's host time one by one on a 2-core CPU)."""
        steady = (batch.num_samples == 1).all() and (stale is None or not stale.any())
        sums = self._sums
        if steady and sums is not None and _same_samples(batch.seqs, sums[0]):
            np.add(sums[1], logprobs, out=sums[1])
            return
        self._settle()
        k = 0
        for i in np.flatnonzero(batch.num_samples).tolist():
            s, c = batch.seqs[i], int(batch.num_samples[i])
            if stale is not None and stale[i]:
                k += c
                continue
            fam = s.group.seqs[:c] if c > 1 else (s,)
            for j, t in enumerate(fam):
                if c > 1:
                    self.index[t.seq_id] = j
                self.cumulative[t.seq_id] = self.cumulative.get(t.seq_id, 0.0) + float(logprobs[k])
                n_top = t.group.params.logprobs
                if n_top is not None:
                    steady = False
                    entry = {int(tokens[k]): float(logprobs[k])}
                    if n_top:
                        entry.update(zip(top[0][k, :n_top].tolist(), top[1][k, :n_top].tolist()))
                    self.logprobs.setdefault(t.seq_id, []).append(entry)
                k += 1
        if steady:  # (the next step of these samples adds to their sums at once)
            self._sums = list(batch.seqs), np.array([self.cumulative[s.seq_id] for s in batch.seqs], np.float64)

    def _settle(self) -> None:
        """The array of sums (``record``) back into ``cumulative``."""
        if self._sums is not None:
            seqs, sums = self._sums
            self._sums = None
            self.cumulative.update(zip((s.seq_id for s in seqs), sums.tolist()))

    def output(self, group, request: Request, detokenize, eos_token_ids) -> RequestOutput:
        """A finished request's output (text ends before its first stop string); forgets it."""
        self._settle()
        outs = []
        for j, s in enumerate(group.seqs):
            ids = s.output_token_ids
            text = detokenize(ids) if detokenize is not None else ""
            reason = None
            if s.finish_reason == "stop":
                if ids and ids[-1] in request.params.stop_token_ids:
                    reason = None if ids[-1] in eos_token_ids else ids[-1]
                else:
                    at, reason = min((text.find(x), x) for x in request.params.stop if x in text)
                    text = text[:at]
            outs.append(CompletionOutput(j, text, ids, self.cumulative.get(s.seq_id, 0.0),
                                         self.logprobs.get(s.seq_id, []) if request.params.logprobs is not None
                                         else None, s.finish_reason, reason))
        self.drop(group)
        return RequestOutput(request.request_id, request.prompt, request.token_ids, outs,
                             num_preemptions=group.num_preemptions)

    def drop(self, group) -> None:
        """Forgets a finished or aborted request and its samples."""
        self._settle()
        self.draws.pop(group.request_id, None)
        for s in group.seqs:
            for d in (self.cumulative, self.logprobs, self.index):
                d.pop(s.seq_id, None)


def _same_samples(seqs, kept) -> bool:
    """Whether a step's ``seqs`` are the sequences ``kept`` from the last one, in order."""
    return len(seqs) == len(kept) and all(map(is_, seqs, kept))
