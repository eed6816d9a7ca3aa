"""A step in flight: its forward and draw queued on the device, its tokens on their way back.

The engine keeps the host and the device busy at once: while step t runs, the host schedules and
launches step t + 1 (its decode rows' input ids are step t's tokens, read on the device), then
waits for step t's tokens and does their bookkeeping while step t + 1 runs. So every copy between
them is asynchronous: the draw's settings go up from pinned memory (``step.to_device``) and the
tokens come back into pinned memory behind an event, which :meth:`Launched.wait` waits for.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sampler import Sampled


@dataclass
class Launched:
    """One step queued on the device (``batch``: the scheduler's ``ScheduledBatch``)."""
    batch: object
    kind: str             # how its attention ran (engine: GRAPH, CASCADE, DECODE, PREFILL)
    tokens: torch.Tensor  # [S] int64 on the device: the sampled ids (a chained step's input ids)
    host: torch.Tensor    # [S, 2] float64 on the host: tokens and their log-probabilities, once copied
    top: tuple | None     # host (ids [S, K], log-probabilities [S, K]) of the top log-probabilities, or None
    copied: torch.cuda.Event | None  # recorded after the copies (None on the CPU: nothing to wait for)
    t0: float             # host clock when the step began
    t_issued: float       # when its last kernel was queued
    captured: bool        # it captured a CUDA graph (its time is not a step's)
    events: tuple | None  # profiling: CUDA events around the step's device work
    attend_events: list | None = None  # profiling: (start, end) CUDA events of each attention call

    @classmethod
    def start(cls, batch, kind: str, sampled: Sampled, t0: float, t_issued: float, captured: bool,
              events) -> "Launched":
        """Queues the copies of ``sampled`` to the host behind the step's kernels (none where its graph
        wrote them into pinned memory: an event behind it)."""
        packed = sampled.packed  # [S, 2] (a graph's draw packs them itself, into pinned memory on a GPU)
        if packed is None:
            packed = torch.stack([sampled.tokens.double(), sampled.logprobs.double()], dim=1)
        top = None if sampled.top_ids is None else (sampled.top_ids, sampled.top_logprobs)
        copied = None
        if sampled.tokens.is_cuda:  # (a graph's draw wrote packed into pinned memory: nothing to copy)
            host = packed
            if packed.is_cuda:
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                host.copy_(packed, non_blocking=True)
            if top is not None:
                top = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                            for t in top)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = packed if sampled.packed is None else packed.clone()  # (a graph's is rewritten by its next run)
        return cls(batch, kind, sampled.tokens, host, top, copied, t0, t_issued, captured, events)

    def wait(self) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        """Blocks until the tokens are on the host -> (tokens [S] int64, log-probabilities [S],
        top (ids, log-probabilities) numpy arrays or None)."""
        if self.copied is not None:
            self.copied.synchronize()
        host = self.host.numpy()
        top = None if self.top is None else tuple(t.numpy() for t in self.top)
        return host[:, 0].astype(np.int64), host[:, 1].copy(), top  # (copies: a graph writes its half again)
