"""Cascade plans for decode step after decode step, each made from the last step's forest where it
carries over: what the engine's step builder and the vLLM plug-in's metadata builder both do.

Finding the forest (the blocks rows share) is most of a plan's host time (the vLLM builder's step of
64 rows sharing 8K tokens on a 2-core CPU: ~300 us found anew, ~130 us carried over,
benchmarks/results/sweeps/vllm_build_carried_cpu.txt); between decode steps the forest stays while
the same requests run, their tails one token longer.
Rows are named by ``ids`` (an engine's sequence ids; the vLLM builder's rows, by place): the same ids
in the same order reuse the forest whole (``forest=``), a subset of them - requests finished, none
joined - restricts it (``forest_rows=``), anything else is planned from scratch. A forest is only
reused while every row's leading blocks are those it was found in (``plan_cascade`` checks that each
member still holds its nodes' last shared block, every shared block under ``PAGED_BACKEND_DEBUG=1``,
and raises where one does not: with ``checked=True`` the step is then planned anew).
"""
from __future__ import annotations

import numpy as np
import torch

from paged_backend.cascade.ops import CascadeCost, CascadePlan, plan_cascade


class CascadePlanner:
    """One :class:`CascadePlan` per sliding window (None: full attention) a decode step, carrying the
    forest over from the step before. ``shape``: ``plan_cascade``'s ``num_q_heads``, ``num_kv_heads``,
    ``head_dim``, ``block_size``, ``device``."""

    def __init__(self, windows=(None,), **shape):
        self.windows, self.shape = tuple(windows), shape
        self._last: dict = {}  # window -> the last step's plan
        self._last_ids: np.ndarray | None = None  # and its rows' ids
        self.reused = 0  # steps planned from an earlier forest (tests, benchmarks)

    def reset(self) -> None:
        """Forget the last forest (shared blocks may change: a prefill, a flat step between)."""
        self._last, self._last_ids = {}, None

    def plans(self, table_host: np.ndarray, lens: np.ndarray, ids: np.ndarray, table: torch.Tensor,
              cost: CascadeCost | None = None, arenas: dict | None = None,
              checked: bool = False, host_lens: np.ndarray | None = None) -> dict[int | None, CascadePlan]:
        """The plans of a decode step of rows ``ids [B]`` (distinct), ``table_host [B, cols]``,
        ``lens [B]`` and the kernels' table ``table [B, M]`` on the device, by the cost model
        ``cost`` (None: the default one; keep it between steps). ``arenas``: {window:
        CascadeArena or None} to plan into (CUDA-graph steps). ``checked``: ids may name other
        requests than last step (rows known by place): a carried forest that no longer holds in
        ``table_host`` is dropped and the step planned anew (else that is an error). ``host_lens``:
        as ``plan_cascade``'s (a host table a step late)."""
        kw = dict(self.shape, cost=cost, block_table_device=table, host_lens=host_lens)
        rows = self._carried_rows(ids)
        plans = None
        if rows is not False:
            try:
                plans = {w: plan_cascade(table_host, lens, window=w, arena=(arenas or {}).get(w), forest=self._last[w],
                                         forest_rows=rows, **kw) for w in self.windows}
                self.reused += 1
            except ValueError:
                if not checked:
                    raise
        if plans is None:
            plans = {w: plan_cascade(table_host, lens, window=w, arena=(arenas or {}).get(w), **kw)
                     for w in self.windows}
        self._last, self._last_ids = plans, np.array(ids, copy=True)
        return plans

    def _carried_rows(self, ids: np.ndarray):
        """None (the last step's rows, in order), the last step's row of each of ``ids`` (a subset),
        or False (plan anew)."""
        if not self._last:
            return False
        if np.array_equal(ids, self._last_ids):
            return None
        where = {int(s): i for i, s in enumerate(self._last_ids)}
        rows = np.fromiter((where.get(int(s), -1) for s in ids), np.int64, len(ids))
        return rows if (rows >= 0).all() else False
