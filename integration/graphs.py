"""CUDA graphs of the engine's flat decode steps.

An eager decode step of a transformers model costs the host a few hundred kernel launches (tens of
milliseconds for a 30-layer model), far above the GPU's work. A decode step whose attention is
``pb.paged_decode`` with a ``DecodePlan`` replays instead: the model's forward for a batch padded
to a captured size (1, 2, 4, 8, 16, 32, 64, then multiples of 64) is captured once, reading fixed
device buffers; each step copies its metadata into them (one host-to-device copy), refills the
plan's buffers with ``plan.update`` and replays. Padding rows have length 0 (attention gives 0),
slot -1 (nothing is written) and token 0; their logits are dropped.

Cascade steps cannot replay one such graph: a ``CascadePlan``'s buffers and grids are made for its
step (docs/engine.md). They replay the model's graphs cut at attention instead, each layer's attention
run eagerly in between (:mod:`.split_graphs`). So on a GPU a decode step whose samples share a prompt
runs either flat in a graph (reading the shared KV once per sample) or as a cascade (reading it once,
with a graph launch and an eager attention call a layer): :class:`PathChoice` picks by the steps'
measured times.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

import paged_backend as pb

from .step import DECODE, Step


def padded_size(batch: int) -> int:
    """The captured batch size a decode step of ``batch`` rows runs in."""
    if batch <= 64:
        return 1 << max(0, (batch - 1).bit_length())
    return -(-batch // 64) * 64


def padded_sizes(max_num_seqs: int) -> list[int]:
    """Every padded size a step of at most ``max_num_seqs`` rows can run in, largest first (so the
    smaller graphs of a shared memory pool reuse the largest one's blocks)."""
    top = padded_size(max_num_seqs)
    return [s for s in sorted({padded_size(b) for b in range(1, min(top, 64) + 1)} | set(range(128, top + 1, 64)),
                              reverse=True) if s <= top]


class _Graph:
    """One captured decode step of ``size`` rows (static buffers, plan, graph, output logits)."""

    def __init__(self, model, cache, size: int, width: int, num_q_heads: int, max_seq_len: int, pool,
                 capture: bool = True, windows=(None,)):
        spec, dev = cache.spec, cache.spec.device
        self.size, self.width = size, width
        # every input in one device buffer, filled by one copy: int64 parts first (aligned views)
        self.host = [np.zeros((1, size), np.int64), np.zeros((1, size), np.int64), np.full(size, -1, np.int64),
                     np.zeros((size, width), np.int32), np.zeros(size, np.int32)]
        # (holding the padding values from the start: a warm-up must write no KV, slot -1)
        self.buffer = torch.from_numpy(self._packed()).to(dev)
        ids, pos, slots, table, lens = self._views()
        self.ids = ids  # [1, size] int64
        self.plans = {w: pb.plan_decode(np.zeros(size, np.int64), num_q_heads=num_q_heads,
                                        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                        block_size=spec.block_size, device=dev, window=w) for w in windows}
        rows = torch.arange(size, device=dev)
        self.step = Step(cache, ids, pos, slots, table, lens, None, rows, DECODE, max_seq_len, plans=self.plans)
        run = lambda: model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=rows,  # noqa: E731
                            paged_step=self.step).logits[0]
        self.graph = None
        if not capture:  # the same buffers, plan and warm-up, run eagerly (tests the plumbing on the CPU)
            with torch.inference_mode():
                run()
            self.replay = lambda: setattr(self, "logits", run())
            return
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # compile, bind the plan's launches, settle the allocator
                run()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.inference_mode():
            self.logits = run()  # [size, V], rewritten by every replay
        self.replay = self.graph.replay

    def _packed(self) -> np.ndarray:
        return np.concatenate([a.reshape(-1).view(np.uint8) for a in self.host])

    def _views(self) -> list[torch.Tensor]:
        out, at = [], 0
        for a in self.host:
            out.append(self.buffer[at:at + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape))
            at += a.nbytes
        return out

    def run(self, batch, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the step for ``batch`` (decode-only, at most ``size`` rows) -> logits [B, V].
        ``ids`` [B] on the device: input ids that replace ``batch.input_ids`` (a step run ahead)."""
        b = len(batch.seqs)
        host_ids, pos, slots, table, lens = self.host
        host_ids[0, :b], host_ids[0, b:] = batch.input_ids, 0
        pos[0, :b], pos[0, b:] = batch.positions, 0
        slots[:b], slots[b:] = batch.slot_mapping, -1
        cols = batch.block_tables.shape[1]
        table[:b, :cols], table[:b, cols:], table[b:] = batch.block_tables, 0, 0
        lens[:b], lens[b:] = batch.seq_lens, 0
        src = torch.empty(self.buffer.numel(), dtype=torch.uint8, pin_memory=self.buffer.is_cuda)  # reused once copied
        np.concatenate([a.reshape(-1).view(np.uint8) for a in self.host], out=src.numpy())
        self.buffer.copy_(src, non_blocking=True)
        if ids is not None:
            self.ids[0, :b].copy_(ids)
        for plan in self.plans.values():
            plan.update(lens)
        with torch.inference_mode():
            self.replay()
        return self.logits[:b]


class DecodeGraphs:
    """The captured decode steps of one engine, made on first use of each padded size."""

    def __init__(self, model, cache, *, num_q_heads: int, max_num_seqs: int, max_model_len: int,
                 capture: bool = True, windows=(None,)):
        self.model, self.cache, self.num_q_heads, self.capture = model, cache, num_q_heads, capture
        self.windows = windows  # one decode plan per sliding window (None: full attention)
        self.max_size = padded_size(max_num_seqs)
        self.width = -(-max_model_len // cache.spec.block_size)
        self.max_model_len = max_model_len
        self.graphs: dict[int, _Graph] = {}
        self.pool = None

    def run(self, batch, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, V] of a decode-only step, or None when it cannot replay (the caller runs it
        eagerly): more rows than captured, or a table wider than ``max_model_len`` allows. ``ids``:
        as in ``_Graph.run``."""
        b = len(batch.seqs)
        if b > self.max_size or batch.block_tables.shape[1] > self.width:
            return None
        return self.graph(padded_size(b)).run(batch, ids)

    def graph(self, size: int) -> _Graph:
        """The step of ``size`` rows (a padded size), captured now if it was not yet."""
        g = self.graphs.get(size)
        if g is None:
            if self.pool is None and self.capture:
                self.pool = torch.cuda.graph_pool_handle()
            g = self.graphs[size] = _Graph(self.model, self.cache, size, self.width, self.num_q_heads,
                                           self.max_model_len, self.pool, self.capture, self.windows)
        return g


class PathChoice:
    """Cascade or flat, for each decode step whose rows share blocks.

    The cascade's time is the median of the last :data:`WINDOW` cascade steps; the flat step's, its
    bytes (the weights and every row's KV at the copy bandwidth) times the median ratio of the flat
    graph steps' times to their bytes (1 until one ran). The first :data:`PROBES` shared steps take
    the cascade (to time it). The choice changes path only for a gain over :data:`MARGIN`, and the
    step after a change is not timed (a cascade step after flat ones builds its forest anew); nor
    are steps that captured a graph."""

    WINDOW = 7
    PROBES = 2
    MARGIN = 1.1

    def __init__(self, model, kv_bytes_per_token: int, device: torch.device):
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.kv_bytes_per_token = kv_bytes_per_token
        self.device = device
        self.bandwidth = None  # bytes/s of a device copy, measured on first use
        self.cascade_s = deque(maxlen=self.WINDOW)     # recent cascade steps, seconds
        self.flat_ratio = deque(maxlen=self.WINDOW)    # recent flat graph steps, time / bytes floor
        self.last = None  # the path of the last shared step ("cascade" or "flat")
        self.changed = False  # the last shared step changed path: its time is not noted

    def cascade(self, batch) -> bool:
        """Whether ``batch`` (decode-only, rows sharing blocks) should take the cascade."""
        if len(self.cascade_s) < self.PROBES:
            choice = True
        else:
            casc = float(np.median(self.cascade_s))
            flat = self._flat_floor(batch) * (float(np.median(self.flat_ratio)) if self.flat_ratio else 1.0)
            choice = casc * self.MARGIN < flat if self.last == "flat" else casc < flat * self.MARGIN
        path = "cascade" if choice else "flat"
        self.changed, self.last = self.last is not None and path != self.last, path
        return choice

    def note_cascade(self, seconds: float) -> None:
        if not self._skip():
            self.cascade_s.append(seconds)

    def note_flat(self, seconds: float, batch) -> None:
        if not self._skip():
            self.flat_ratio.append(seconds / self._flat_floor(batch))

    def _skip(self) -> bool:
        skip, self.changed = self.changed, False
        return skip

    def _flat_floor(self, batch) -> float:
        """Seconds a flat step of ``batch`` takes to read its weights and KV at the copy bandwidth."""
        if self.bandwidth is None:
            self.bandwidth = _copy_bandwidth(self.device)
        return (self.weight_bytes + int(batch.seq_lens.sum()) * self.kv_bytes_per_token) / self.bandwidth


def _copy_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s moved by a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 5 * nbytes / (start.elapsed_time(end) / 1e3)
