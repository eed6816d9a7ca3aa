"""One engine step's device metadata and its attention plan, made once on the host and read by
every layer.

``StepBuilder.build(batch)`` turns the scheduler's ``ScheduledBatch`` (host numpy arrays) into a
:class:`Step`: the arrays on the device in one host-to-device copy, and the attention the step
runs - ``pb.paged_decode`` with a ``DecodePlan`` (decode-only steps), ``pb.cascade_decode`` with a
``CascadePlan`` (decode-only steps whose rows share prompt blocks), or ``pb.paged_prefill`` (steps
with prefill chunks; its decode rows are queries of length 1). Plans carry over between
consecutive decode steps: ``DecodePlan.update`` while the batch size stays, and the cascade forest
through ``forest=`` / ``forest_rows=`` while samples only finish. A model whose layers use sliding
windows gets one plan per distinct window (None: the full-attention layers'), each layer reading
its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import paged_backend as pb
from paged_backend.cascade import CascadeCost
from paged_backend.cascade.planner import CascadePlanner

from .kv_cache import PagedKVCache

DECODE, CASCADE, PREFILL = "decode", "cascade", "prefill"


@dataclass
class Step:
    """Device tensors of one step (T tokens, B rows) and how its attention runs.

    input_ids, positions [1, T] int64; slot_mapping [T] int64; block_table [B, M] int32;
    seq_lens [B] int32; query_start_loc [B+1] int32; logits_indices [R] int64 (the last token of
    each row that samples). ``kind``: DECODE, CASCADE or PREFILL; ``max_seq_len``: the longest
    row; ``plans``: the step's DecodePlans or CascadePlans by sliding window (None: full attention;
    empty for PREFILL); a layer whose window is not a key never cuts a row and reads ``plans[None]``.
    Host copies for validation without a sync: seq_lens_cpu, query_start_loc_cpu.
    """
    cache: PagedKVCache
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    kind: str
    max_seq_len: int
    plans: dict = field(default_factory=dict)
    seq_lens_cpu: np.ndarray = field(default=None, repr=False)
    query_start_loc_cpu: np.ndarray = field(default=None, repr=False)
    attend_events: list | None = field(default=None, repr=False)  # profiling: (start, end) CUDA events per layer

    @property
    def is_cascade(self) -> bool:
        """A decode step some of whose layers share prefixes (a cascade plan that kept a node)."""
        return self.kind == CASCADE and any(not p.is_flat for p in self.plans.values())

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
               softcap: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None):
        """Writes this step's new K/V of ``layer`` and returns the attention of ``q``: q [T, Hq, D],
        key/value [T, Hkv, D] (any strides) -> out [T, Hq, D]. ``softcap``, ``sinks [Hq]`` fp32,
        ``window``: logit soft-capping, attention sinks and the layer's sliding window (None: none)."""
        if self.attend_events is not None:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
            self.attend_events.append(ev)
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        scales = self.cache.scales  # (an fp8 cache's k_scale, v_scale)
        pb.write_kv(key, value, k_cache, v_cache, self.slot_mapping, **scales)
        if self.kind == DECODE:
            window = window if window in self.plans else None  # (a window no row outgrows: the full plan)
            out = pb.paged_decode(q, k_cache, v_cache, self.block_table, self.seq_lens, scale=scale,
                                  plan=self.plans[window], return_lse=False, softcap=softcap, sinks=sinks, window=window,
                                  **scales)
        elif self.kind == CASCADE:
            window = window if window in self.plans else None
            out = pb.cascade_decode(q, k_cache, v_cache, self.plans[window], return_lse=False, scale=scale,
                                    softcap=softcap, sinks=sinks, window=window, **scales)
        else:
            out = pb.paged_prefill(q, k_cache, v_cache, self.block_table, self.seq_lens, self.query_start_loc,
                                   causal=True, return_lse=False, scale=scale,
                                   query_start_loc_cpu=self.query_start_loc_cpu, seq_lens_cpu=self.seq_lens_cpu,
                                   softcap=softcap, sinks=sinks,
                                   window=window if window is not None and window < self.max_seq_len else None,
                                   **scales)
        if self.attend_events is not None:
            self.attend_events[-1][1].record()
        return out


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays (int64 ones first, then int32 ones) -> device tensors of the same dtypes and
    shapes, through one pinned buffer and one copy on CUDA; views of the arrays on the CPU."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    sizes = [a.nbytes for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    flat, at = host.numpy(), 0
    for a, n in zip(arrays, sizes):
        flat[at:at + n] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        at += n
    dev = host.to(device, non_blocking=True)
    out, at = [], 0
    for a, n in zip(arrays, sizes):  # int64 sections come first, so every view is aligned
        out.append(dev[at:at + n].view(torch.from_numpy(a[:0]).dtype).view(a.shape))
        at += n
    return out


class StepBuilder:
    """Makes each step's :class:`Step` for one model shape and cache; keeps the plans of the last
    decode step to carry them over."""

    def __init__(self, cache: PagedKVCache, *, num_q_heads: int, cascade: bool = True,
                 cascade_cost: CascadeCost | None = None, windows=(None,)):
        """``windows``: the layers' sliding windows that cut (< max_model_len), None for the layers
        of full attention (or whose window never cuts): one plan per entry."""
        self.cache = cache
        spec = cache.spec
        self.shape = dict(num_q_heads=num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                          block_size=spec.block_size, device=spec.device)
        self.cascade = cascade
        # the cost model counts the cache's bytes (an fp8 cache: 1 a value, and no Hopper kernel lists)
        self.cascade_cost = cascade_cost or CascadeCost(kv_elem_bytes=spec.dtype.itemsize)
        self.windows = tuple(windows)
        self._decode_plans: dict[tuple, pb.DecodePlan] = {}  # (batch size, window) -> plan (kept buffers)
        self.planner = CascadePlanner(self.windows, **self.shape)  # rows named by seq ids

    def reset(self) -> None:
        """Drops the kept plans and the carried forest (their buffers: ``LLM.sleep``)."""
        self._decode_plans.clear()
        self.planner.reset()

    def wants_cascade(self, batch) -> bool:
        """Whether a decode-only ``batch`` would be planned as a cascade (rows share blocks)."""
        return self.cascade and bool(batch.share_groups)

    def build(self, batch) -> Step:
        """``batch``: a ``paged_backend.scheduler.ScheduledBatch`` (not empty)."""
        qsl = batch.query_start_loc
        rows = np.flatnonzero(batch.num_samples)
        logits_indices = (qsl[1:][rows] - 1).astype(np.int64)
        t = int(qsl[-1])
        tensors = to_device([batch.input_ids.reshape(1, t), batch.positions.reshape(1, t), batch.slot_mapping,
                             logits_indices, batch.block_tables, batch.seq_lens, qsl], self.shape["device"])
        ids, pos, slots, logit_rows, table, lens, qsl_d = tensors
        step = Step(self.cache, ids, pos, slots, table, lens, qsl_d, logit_rows, PREFILL, int(batch.seq_lens.max()),
                    seq_lens_cpu=batch.seq_lens, query_start_loc_cpu=qsl)
        if batch.num_prefill_tokens:
            self.planner.reset()  # shared blocks may change: plan anew later
            return step
        if self.wants_cascade(batch):
            step.kind, step.plans = CASCADE, self.cascade_plans(batch.block_tables, batch.seq_lens, batch.seq_ids,
                                                                table)
        else:
            self.planner.reset()
            step.kind, step.plans = DECODE, {w: self._decode_plan(batch.seq_lens, w) for w in self.windows}
        return step

    def _decode_plan(self, lens: np.ndarray, window: int | None) -> pb.DecodePlan:
        plan = self._decode_plans.get((lens.size, window))
        if plan is None:
            if len(self._decode_plans) >= 8 * len(self.windows):  # a few batch sizes recur; keep their buffers
                self._decode_plans.pop(next(iter(self._decode_plans)))
            plan = self._decode_plans[lens.size, window] = pb.plan_decode(lens, window=window,
                                                                          kv_dtype=self.cache.spec.dtype, **self.shape)
            return plan
        return plan.update(lens)

    def cascade_plans(self, table_host: np.ndarray, lens: np.ndarray, ids: np.ndarray, table: torch.Tensor,
                      arenas: dict | None = None) -> dict:
        """One CascadePlan per window for a decode step of rows ``ids [B]`` (distinct; the engine's
        sequence ids), ``table_host [B, cols]``, ``lens [B]``, the table on the device ``table``, each
        from the last step's of that window where it carries over. ``arenas``: {window: CascadeArena
        or None} to plan into (CUDA-graph steps)."""
        return self.planner.plans(table_host, lens, ids, table, self.cascade_cost, arenas)
