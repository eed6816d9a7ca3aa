"""Per-sample bookkeeping of the engine: which draw a sample makes next (for its noise key),
its log-probabilities so far, and its final :class:`CompletionOutput`.

A sample is a scheduler ``Sequence``; its index among its request's samples is fixed when the
request forks (its prompt's last step draws ``n`` tokens, one per sample, in order).
"""
from __future__ import annotations

import numpy as np

from .outputs import CompletionOutput, RequestOutput
from .requests import Request
from .sampler import SampleRows, row_keys


class SampleBook:
    def __init__(self):
        self.index: dict[int, int] = {}        # seq id -> sample index (absent: 0)
        self.cumulative: dict[int, float] = {}  # seq id -> sum of its tokens' log-probabilities
        self.logprobs: dict[int, list] = {}     # seq id -> per token {id: log-probability}

    def rows(self, batch, requests: dict[str, Request]) -> tuple[SampleRows, np.ndarray | None]:
        """The step's sample rows: each row with num_samples = c > 0 gives c rows (a prompt that
        forks into n samples draws n tokens from its last position). -> (rows, c per row, or None
        when every c is 1)."""
        sel = np.flatnonzero(batch.num_samples)
        counts = batch.num_samples[sel]
        seqs = [batch.seqs[i] for i in sel]
        per = np.array([(requests[s.group.request_id].seed, self.index.get(s.seq_id, 0),
                         len(s.token_ids) - s.num_prompt_tokens) for s in seqs], np.int64).reshape(-1, 3)
        params = [s.group.params for s in seqs]
        fork = None
        if (counts > 1).any():
            rep = np.repeat(np.arange(len(sel)), counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            per = per[rep]
            per[:, 1] += np.arange(rep.size) - first  # a fork row's samples are 0..n-1
            params = [params[i] for i in rep]
            fork = counts.astype(np.int64)
        rows = SampleRows(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int64),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            key=row_keys(per[:, 0].astype(np.uint64), per[:, 1], per[:, 2]),
            num_logprobs=max((p.logprobs or 0 for p in params), default=0))
        return rows, fork

    def record(self, batch, tokens: np.ndarray, logprobs: np.ndarray, top) -> None:
        """After ``postprocess``: each sampled token's log-probability (and top-k) joins its
        sample's totals; a forked request's samples get their indices."""
        k = 0
        for i in np.flatnonzero(batch.num_samples).tolist():
            s, c = batch.seqs[i], int(batch.num_samples[i])
            fam = s.group.seqs[:c] if c > 1 else (s,)
            for j, t in enumerate(fam):
                if c > 1:
                    self.index[t.seq_id] = j
                self.cumulative[t.seq_id] = self.cumulative.get(t.seq_id, 0.0) + float(logprobs[k])
                n_top = t.group.params.logprobs
                if n_top is not None:
                    entry = {int(tokens[k]): float(logprobs[k])}
                    if n_top:
                        entry.update(zip(top[0][k, :n_top].tolist(), top[1][k, :n_top].tolist()))
                    self.logprobs.setdefault(t.seq_id, []).append(entry)
                k += 1

    def output(self, group, request: Request, detokenize, eos_token_ids) -> RequestOutput:
        """A finished request's output (text ends before its first stop string); forgets it."""
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
        """Forgets a finished or aborted request's samples."""
        for s in group.seqs:
            for d in (self.cumulative, self.logprobs, self.index):
                d.pop(s.seq_id, None)
