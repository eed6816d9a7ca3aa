"""Host-side work partition for paged decode (split-KV and stream-K / Lean Attention).

Work units are ``(request, kv_head, kv_tile)`` with ``kv_tile`` = ``BLOCK_N`` tokens. A *segment*
is the units of one ``(request, kv_head)``, segments laid end to end in ``b * Hkv + h`` order.
The plan cuts that line of units into program runs:

- ``stream_k``: ``G`` persistent programs get equal contiguous runs (sizes differ by at most one
  unit), crossing request and head boundaries; when whole segments already balance the GPU it
  cuts only at segment boundaries (no split, no partial states).
- ``split``: every segment is cut into the same number of chunks, one program per chunk
  (FlashDecoding-style split-KV; the baseline stream-K is measured against).

The intersections of program runs and segments are *pieces*: a program runs its pieces in order
and writes one state per piece; a segment of one piece writes the output directly, a segment of
several is reduced in piece order by a second kernel (deterministic: same inputs, same bits).

All of it is numpy on the host, once per step; the result is one host-to-device copy into
fixed-size buffers, reused by every layer. ``DecodePlan.update`` refills the same buffers with new
lengths, so a CUDA graph captured with the plan replays correctly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from paged_backend.kernels.checks import HEAD_DIMS, check_heads, check_window, debug_enabled
from paged_backend.kernels.dispatch import SM90_DECODE_GROUP, num_sms, sm90_shape, use_sm90

# Programs per SM for the decode kernel (4 warps, 3 pipeline stages, 64-token tiles); G = SMs x this.
# Swept on an H200 (2026-11-21) with 1-6 programs per SM and 32/64/128-token tiles: 2 x 64 was best
# or within 2% of best on every workload-of-record case.
PROGRAMS_PER_SM = 2
# Plans the Hopper decode kernel runs over a 1-byte (fp8) cache: 3. There one consumer warpgroup a
# program is bound by its serial chain of conversions, GEMMs and softmax, not by bytes; a third
# program an SM (fewer registers, half the ring: kernels/decode_sm90.py) overlaps more chains (H200,
# 2026-11-29, graphs: B8x32K 149.6 -> 136-142 us, sweeps/decode_fp8_programs_h200.log). 16-bit caches
# measured no faster with 3 (B1x32K 39.6 / 39.5-39.9 us).
FP8_SM90_PROGRAMS_PER_SM = 3
# Stream-K keeps whole segments (no split) when that is at most this much slower than an even cut.
NO_SPLIT_SLACK = 1.15
WORK_FIELDS = 5  # (request, kv_head, token_start, token_end, partial slot or -1 = write output)
ROW = np.dtype((np.void, 4 * WORK_FIELDS))  # a work row as one item, so a gather moves whole rows


def block_n_for(head_dim: int) -> int:
    """Tokens per KV tile (a work unit): 64 for D <= 128 (see PROGRAMS_PER_SM), halved for D = 256
    so three pipeline stages of K and V still fit in shared memory."""
    return 32 if head_dim > 128 else 64


def programs_per_sm(device: torch.device, kv_elem_bytes: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, window) -> int:
    """Programs an SM of a plan (``G = SMs x this``): ``FP8_SM90_PROGRAMS_PER_SM`` where the Hopper decode
    kernel will run it over a cache of 1-byte values (its plan terms: no window, a group of at most
    ``SM90_DECODE_GROUP``), else ``PROGRAMS_PER_SM``. (A cascade plan's tails too: ``cascade.fused.hopper_tails``.)"""
    group = num_q_heads // num_kv_heads
    if kv_elem_bytes != 1 or window or group > SM90_DECODE_GROUP \
            or not sm90_shape(head_dim, block_size, group) or not use_sm90(device):
        return PROGRAMS_PER_SM
    return FP8_SM90_PROGRAMS_PER_SM


def check_plan_covers(plan: "DecodePlan", seq_lens: torch.Tensor) -> None:
    """The kernels attend ``min(plan length, seq_lens)`` keys per request, the torch path
    ``seq_lens``: a plan made from upper bounds is exact, one made for shorter lengths is not.
    Checked where ``seq_lens`` is on the host, and with ``PAGED_BACKEND_DEBUG=1`` (a device copy)."""
    if seq_lens.device.type != "cpu" and not debug_enabled():
        return
    lens = seq_lens.cpu().numpy()
    short = np.flatnonzero(plan.seq_lens_host < lens)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"plan was made for shorter lengths than seq_lens: request {i} has seq_lens {int(lens[i])} but the plan "
            f"{int(plan.seq_lens_host[i])} ({short.size} requests short); call plan.update(seq_lens) first")


def _as_host_lens(seq_lens_cpu) -> np.ndarray:
    if isinstance(seq_lens_cpu, torch.Tensor):
        if seq_lens_cpu.device.type != "cpu":
            raise ValueError("seq_lens_cpu must be a host (CPU) tensor, list or numpy array; "
                             f"got a tensor on {seq_lens_cpu.device} (copy it once per step, not per layer)")
        seq_lens_cpu = seq_lens_cpu.numpy()
    arr = np.asarray(seq_lens_cpu)
    if arr.ndim != 1:
        raise ValueError(f"seq_lens_cpu must be 1-D [B], got shape {arr.shape}")
    if arr.size:
        if arr.dtype.kind not in "iu":  # np.issubdtype(dtype, np.integer), a tenth of the cost
            raise TypeError(f"seq_lens_cpu must hold integers, got {arr.dtype}")
        if arr.min() < 0:
            raise ValueError(f"seq_lens_cpu must be >= 0, got min {arr.min()}")
    return arr.astype(np.int64)


def _keeps_whole_segments(n_seg: int, longest: int, total: int, grid: int) -> bool:
    """Stream-K cuts only at segment boundaries when whole segments already balance the GPU."""
    return n_seg >= grid and -(-n_seg // grid) * longest <= NO_SPLIT_SLACK * total / grid


def _split_bounds(seg_units: np.ndarray, seg_bounds: np.ndarray, grid: int) -> np.ndarray:
    """Split-KV's cut points (in units, including 0 and U) of the program runs; ``len - 1``
    programs. ``seg_bounds [S + 1]``: the segments' cumulative units, from 0."""
    total = int(seg_bounds[-1])
    live = max(1, int(np.count_nonzero(seg_units)))
    chunks = max(1, -(-grid // live))
    per = np.maximum(1, -(-seg_units // chunks))  # units per chunk, per segment
    n_chunks = -(-seg_units // per)  # 0 for an empty segment
    first = np.cumsum(n_chunks) - n_chunks  # [S] index of each segment's first chunk
    # The chunk starts (ascending and distinct: an empty segment has no chunk), then U. Chunk
    # k starts k - first[s] chunks into its segment s.
    bounds = np.empty(int(n_chunks.sum()) + 1, dtype=np.int64)
    base = np.repeat(seg_bounds[:-1] - first * per, n_chunks)
    bounds[:-1] = base + np.arange(base.size) * np.repeat(per, n_chunks)
    bounds[-1] = total
    return bounds


def _cuts(seg_bounds: np.ndarray, bounds: np.ndarray):
    """Where the program bounds ``bounds [R + 1]`` (ascending) fall in the segments ``seg_bounds [S + 1]``.

    A bound strictly inside a segment is a *cut* (equal bounds cut once): the piece it starts
    continues that segment. -> ``(prog_ptr [R + 1], edges [C + 2], cut_off [C])``: the pieces
    below each bound; 0, each cut's piece, and the number of pieces; each cut's units into its segment.
    """
    at = seg_bounds.searchsorted(bounds)  # segment starts below each bound
    inner = seg_bounds[at] != bounds
    seg = at - inner  # the segment holding the bound, or the first one starting at it
    cut = inner.copy()
    cut[1:] &= bounds[1:] != bounds[:-1]
    # Pieces below a bound: segments starting below it, plus the cuts below it.
    prog_ptr = seg + cut.cumsum()
    cut_at = prog_ptr[cut]
    edges = np.empty(cut_at.size + 2, dtype=np.int64)
    edges[0], edges[1:-1], edges[-1] = 0, cut_at, seg_bounds.size - 1 + cut_at.size
    return prog_ptr, edges, (bounds - seg_bounds[seg])[cut]


def _even_cuts(units: np.ndarray, hkv: int, grid: int, req_bounds: np.ndarray, total: int):
    """``_cuts`` of stream-K's even program bounds, for the decode segments (request b's ``hkv``
    segments hold ``units[b]`` units each): found among the B requests, not the B x Hkv segments.
    ``req_bounds [B + 1]``: units before each request's first segment; ``total`` > 0."""
    bounds = (np.arange(grid + 1, dtype=np.int64) * total) // grid
    req = req_bounds[1:].searchsorted(bounds, side="right")  # [G + 1] request holding each bound (B: the end)
    # (units.take clips B to B - 1; the end's offset is 0 anyway.)
    head, off = np.divmod(bounds - req_bounds.take(req), units.take(req, mode="clip"))
    cut = off != 0
    if total < grid:  # equal bounds cut once
        cut[1:] &= bounds[1:] != bounds[:-1]
    prog_ptr = req * hkv + head + cut.cumsum()  # as in _cuts
    # The first and last bounds (0 and U) are never cuts; their pieces are 0 and the count.
    cut[0] = cut[-1] = True
    return prog_ptr, prog_ptr[cut], off[cut][1:-1]


def _runs(edges: np.ndarray, ramp: np.ndarray, seg_ptr: np.ndarray) -> np.ndarray:
    """Each piece's segment, and each segment's first piece into ``seg_ptr [S + 1]``, from the cuts'
    ``edges [C + 2]`` (see ``_cuts``). The cuts split the line of pieces into C + 1 runs of
    consecutive segments, run j shifted j pieces from its segments. ``ramp``: arange(>= P + 1), of
    seg_ptr's dtype (int32 for the decode plan: half the bytes, and no cast)."""
    runs = edges[1:] - edges[:-1]  # [C + 1] pieces per run
    run = ramp[: runs.size]
    seg = ramp[: edges[-1]] - run.repeat(runs)  # [P]
    runs[1:] -= 1  # segments starting in each run: a run after a cut starts inside a segment
    np.add(ramp[: seg_ptr.size - 1], run.repeat(runs), out=seg_ptr[:-1])
    seg_ptr[-1] = edges[-1]
    return seg


def cut_pieces(units: np.ndarray, grid: int, reps):
    """Cuts segments of ``units [N]`` units (each >= 1), unit ``i`` repeated ``reps`` times (an int
    or ``[N]``, >= 1), stream-K into ``grid`` program runs (see the module doc).

    -> ``(seg [P], seg_ptr [S + 1], prog_ptr [grid + 1], cut_at [C], cut_off [C])``: each piece's
    segment, each segment's pieces ``seg_ptr[s]..seg_ptr[s+1]``, each program run's first piece,
    and the cuts: piece ``cut_at[i]`` starts ``cut_off[i]`` units into its segment, where the
    piece before it ends; every other piece starts and ends with its segment. For the cascade
    plan's node and tail work; the decode plan writes its buffers from the same steps directly.
    """
    if isinstance(reps, np.ndarray):
        n_seg, total = int(reps.sum()), int(units @ reps)
    else:
        n_seg, total = units.size * reps, int(units.sum()) * reps
    if _keeps_whole_segments(n_seg, int(units.max()), total, grid):
        ramp = np.arange(n_seg + 1)  # one piece per segment: no pass over the segments
        return ramp[:-1], ramp, (np.arange(grid + 1) * n_seg) // grid, ramp[:0], ramp[:0]
    seg_units = units.repeat(reps)
    seg_bounds = np.zeros(n_seg + 1, dtype=np.int64)
    np.cumsum(seg_units, out=seg_bounds[1:])
    prog_ptr, edges, cut_off = _cuts(seg_bounds, (np.arange(grid + 1, dtype=np.int64) * total) // grid)
    seg_ptr = np.empty(n_seg + 1, dtype=np.int64)
    seg = _runs(edges, np.arange(edges[-1] + 1), seg_ptr)
    return seg, seg_ptr, prog_ptr, edges[1:-1], cut_off


@lru_cache(maxsize=16)
def _constants(rows: int, batch: int, hkv: int):
    """Read-only arrays a plan's shape fixes: ``arange(rows + 1)`` (int32), and each segment's row when
    not cut, ``(request, kv_head, 0, 0, -1)`` ``[B * Hkv, 5] int32`` (a plan copies it and fills
    token_end)."""
    ramp = np.arange(rows + 1, dtype=np.int32)
    whole = np.zeros((batch, hkv, WORK_FIELDS), dtype=np.int32)
    whole[:, :, 0] = np.arange(batch)[:, None]
    whole[:, :, 1] = np.arange(hkv)
    whole[:, :, 4] = -1
    for a in (ramp, whole):
        a.flags.writeable = False
    return ramp, whole.reshape(batch * hkv, WORK_FIELDS)


@dataclass
class DecodePlan:
    """What the decode kernel needs, computed on the host once per step.

    With a sliding ``window`` the plan partitions ``[0, min(len, window))`` of each request; the
    kernel shifts those ranges by ``max(0, len - window)`` of the device length, so the work
    follows the window, not the context.

    Device buffers (fixed size ``max_pieces`` so a CUDA graph can replay with new lengths):
    ``work [max_pieces, 5] int32``, ``prog_ptr [G + 1] int32``, ``seg_ptr [B * Hkv + 1] int32``,
    and the fp32 workspace for partial states ``partial_o [max_pieces, group, D]``,
    ``partial_lse [max_pieces, group]``.
    """
    batch_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    block_n: int
    target_programs: int
    mode: str
    device: torch.device
    seq_lens_host: np.ndarray = field(repr=False)
    window: int | None = None  # sliding window: each request's last `window` keys are partitioned
    num_pieces: int = 0
    buffers: torch.Tensor = field(default=None, repr=False)
    partial_o: torch.Tensor = field(default=None, repr=False)
    partial_lse: torch.Tensor = field(default=None, repr=False)
    _host: np.ndarray = field(default=None, repr=False)  # the partition, as last written
    _work: np.ndarray = field(default=None, repr=False)  # [max_pieces, 5] its work
    _rows: np.ndarray = field(default=None, repr=False)  # [max_pieces] the same, one 20-byte item a row
    _prog_ptr: np.ndarray = field(default=None, repr=False)  # [G + 1] its prog_ptr
    _seg_ptr: np.ndarray = field(default=None, repr=False)  # [S + 1] its seg_ptr
    _whole_rows: np.ndarray = field(default=None, repr=False)  # [S] each segment's row when not cut
    _whole_lens: np.ndarray = field(default=None, repr=False)  # [B, Hkv] their token_end
    _ramp: np.ndarray = field(default=None, repr=False)  # arange(max_pieces + 1), int32
    _req_bounds: np.ndarray = field(default=None, repr=False)  # [B + 1] scratch
    _units: np.ndarray = field(default=None, repr=False)  # tiles per request of the partition
    _last: np.ndarray = field(default=None, repr=False)  # [S] each segment's last piece, once asked for
    _views: tuple = field(default=None, repr=False)  # work, prog_ptr, seg_ptr: views of buffers, made once
    # (seq_lens_host, its max) as of the last update; paged_decode uses the max while the array is the same
    host_max: tuple = field(default=(None, 0), repr=False)
    # call signature -> the decode and fold kernels' launches for it (kernels/decode.py: decode_triton)
    launches: dict = field(default_factory=dict, repr=False)

    @property
    def whole(self) -> bool:
        """The partition cut no segment: one piece per segment (every segment has at least one)."""
        return self.num_pieces == self.batch_size * self.num_kv_heads

    @property
    def kernel_tile(self) -> tuple:
        """(tokens per kernel tile, pipeline stages) for the decode kernel; any tile size is exact
        for any plan (pieces are token ranges). Whole segments are long runs: 128-token tiles in 2
        stages stream them faster (H100, B64x4K: 381 -> 366 us); split plans keep ``block_n`` in 3
        stages, faster there (B1x32K 54.4 against 56.2 us, ragged 1x128K + 15x1K 212 against 218 us;
        ``benchmarks/results/sweeps/decode_short_tiles_h100.json``)."""
        if self.whole and self.head_dim <= 128:
            return max(self.block_n, 128), 2
        return self.block_n, 3

    @property
    def num_programs(self) -> int:
        """The fixed launch grid. Split-KV cuts each of the S live segments into
        ceil(G / S) chunks, so at most G + S programs."""
        if self.mode == "split":
            return self.target_programs + self.batch_size * self.num_kv_heads
        return self.target_programs

    @property
    def programs_an_sm(self) -> int:
        """The partition's programs per SM of its device, rounded up: what its launches size their
        registers and rings by (kernels/decode.py, kernels/decode_sm90.py)."""
        return -(-self.target_programs // num_sms(self.device))

    @property
    def max_pieces(self) -> int:
        return self.target_programs + self.batch_size * self.num_kv_heads

    @property
    def work(self) -> torch.Tensor:  # [max_pieces, 5]
        return self._views[0]

    @property
    def prog_ptr(self) -> torch.Tensor:  # [G + 1]
        return self._views[1]

    @property
    def seg_ptr(self) -> torch.Tensor:  # [B * Hkv + 1]
        return self._views[2]

    def update(self, seq_lens_cpu) -> "DecodePlan":
        """Re-partition for new lengths (same batch size) into the same device buffers."""
        lens = _as_host_lens(seq_lens_cpu)
        if lens.size != self.batch_size:
            raise ValueError(f"seq_lens_cpu must have {self.batch_size} entries (the plan's batch size), "
                             f"got {lens.size}")
        return self._update(lens)

    def _update(self, lens: np.ndarray) -> "DecodePlan":
        """``update`` of checked lengths (``_as_host_lens``)."""
        # The plan's own read-only copy: a caller's later writes to its array cannot change what
        # was planned, nor make the maximum that paged_decode checks against stale.
        lens = lens.copy()
        lens.flags.writeable = False
        self.seq_lens_host = lens
        self.host_max = (lens, int(lens.max()) if lens.size else 0)
        if self.buffers is None:
            self._allocate()
        self._partition(lens)
        if self.device.type != "cuda":
            return self  # _host is the buffer itself
        # A fresh pinned staging array per update: the CPU may run steps ahead of the GPU, and
        # torch's pinned-memory cache gives a block out again only once the copies that read it
        # are done (it records an event per asynchronous copy). (Two buffers alternated behind
        # events of our own cost more: a new event's first record took ~45 us on an H100 host.)
        staging = torch.empty(self._host.size, dtype=torch.int32, pin_memory=True)
        # Only the live work rows and the pointers: rows past num_pieces are never read, so the
        # rest of the buffers may hold anything.
        host, dst, live = self._host, staging.numpy(), self.num_pieces * WORK_FIELDS
        dst[:live] = host[:live]
        tail = self._prog_ptr.size + self._seg_ptr.size
        dst[-tail:] = host[-tail:]
        self.buffers.copy_(staging, non_blocking=True)
        return self

    def _allocate(self) -> None:
        dev, b, hkv, rows = self.device, self.batch_size, self.num_kv_heads, self.max_pieces
        size = rows * WORK_FIELDS + self.num_programs + 1 + b * hkv + 1
        group = self.num_q_heads // self.num_kv_heads
        self.partial_o = torch.empty(rows, group, self.head_dim, dtype=torch.float32, device=dev)
        self.partial_lse = torch.empty(rows, group, dtype=torch.float32, device=dev)
        self._host = np.zeros(size, dtype=np.int32)
        if dev.type == "cuda":
            # No fills: every part a kernel reads is written by the first copy.
            self.buffers = torch.empty(size, dtype=torch.int32, device=dev)
        else:
            # The host array is the buffer. (np.zeros, not torch.zeros: torch fills through its
            # thread pool, which took milliseconds for 0.7 MB on a busy 2-core machine.)
            self.buffers = torch.from_numpy(self._host)
        at = rows * WORK_FIELDS
        # (split_with_sizes: Tensor.split with a list goes through a Python wrapper, twice the time)
        work, prog_ptr, seg_ptr = self.buffers.split_with_sizes([at, self.num_programs + 1, b * hkv + 1])
        self._views = (work.view(rows, WORK_FIELDS), prog_ptr, seg_ptr)
        self._work = self._host[:at].reshape(rows, WORK_FIELDS)
        self._rows = self._host[:at].view(ROW)
        self._prog_ptr = self._host[at: at + self.num_programs + 1]
        self._seg_ptr = self._host[at + self.num_programs + 1:]
        self._ramp, whole = _constants(rows, b, hkv)
        whole = whole.copy()
        self._whole_rows = whole.reshape(-1).view(ROW)
        self._whole_lens = whole.reshape(b, hkv, WORK_FIELDS)[:, :, 3]
        self._req_bounds = np.zeros(b + 1, dtype=np.int64)

    def _partition(self, lens: np.ndarray) -> None:
        """Writes ``work | prog_ptr | seg_ptr`` into the int32 host array ``_host``."""
        hkv, bn, g = self.num_kv_heads, self.block_n, self.target_programs
        if self.window is not None:  # the keys attended, counted from the window's start
            lens = np.minimum(lens, self.window)
        # An empty segment still gets one (empty) piece, which writes o = 0, lse = -inf.
        units = np.maximum((lens + (bn - 1)) // bn, 1)  # [B]
        work = self._work
        if self._units is not None and units.tobytes() == self._units.tobytes():  # (faster than array_equal)
            # The same tiles as last step (a decode step adds one token; a request crosses a tile
            # boundary once per block_n tokens): only the last piece of each segment ends elsewhere.
            if self._last is None:
                self._last = self._seg_ptr[1:] - 1
            work[self._last, 3] = lens.repeat(hkv)
            return
        self._units, self._last = units, None
        self._whole_lens[:] = lens[:, None]
        s = self._whole_rows.size
        if self.mode == "stream_k":
            req_bounds = self._req_bounds
            units.cumsum(out=req_bounds[1:])
            req_bounds *= hkv
            total = int(req_bounds[-1])
            if s == 0 or (s >= g and _keeps_whole_segments(s, int(units.max()), total, g)):
                self._write_whole((np.arange(g + 1, dtype=np.int64) * s) // g)
                return
            prog_ptr, edges, cut_off = _even_cuts(units, hkv, g, req_bounds, total)
        elif s >= g:  # split-KV into one chunk per segment
            self._write_whole(self._ramp[: s + 1])
            return
        else:
            seg_units = units.repeat(hkv)
            seg_bounds = np.zeros(s + 1, dtype=np.int64)
            seg_units.cumsum(out=seg_bounds[1:])
            prog_ptr, edges, cut_off = _cuts(seg_bounds, _split_bounds(seg_units, seg_bounds, g))
        if edges.size == 2:  # no cut
            self._write_whole(prog_ptr)
            return
        n = int(edges[-1])
        seg = _runs(edges, self._ramp, self._seg_ptr)
        # Every piece starts as its segment's whole row; the pieces around each cut then get the
        # cut's token, and all pieces of a cut segment their own workspace slot.
        self._whole_rows.take(seg, out=self._rows[:n], mode="clip")
        cut_at = edges[1:-1]
        cut_tok, before = cut_off * bn, cut_at - 1
        work[cut_at, 2] = cut_tok
        work[before, 3] = cut_tok
        work[cut_at, 4] = cut_at
        work[before, 4] = before
        self._write_prog_ptr(prog_ptr, n)

    def _write_whole(self, prog_ptr: np.ndarray) -> None:
        """No segment is cut: one piece per segment."""
        s = self._whole_rows.size
        self._rows[:s] = self._whole_rows
        self._seg_ptr[:] = self._ramp[: s + 1]
        self._write_prog_ptr(prog_ptr, s)

    def _write_prog_ptr(self, prog_ptr: np.ndarray, n: int) -> None:
        self._prog_ptr[: prog_ptr.size] = prog_ptr
        self._prog_ptr[prog_ptr.size:] = n  # programs past the last bound get empty runs
        self.num_pieces = n


def plan_decode(seq_lens_cpu, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                device=None, mode: str = "stream_k", num_programs: int | None = None,
                block_n: int | None = None, window: int | None = None, kv_dtype: torch.dtype | None = None
                ) -> DecodePlan:
    """Partition one decode step. ``seq_lens_cpu [B]`` host lengths (tokens in cache, current one
    included). ``num_programs`` overrides ``G`` (default: SMs x programs per SM) and ``block_n`` the
    tokens per work unit (a power of two >= 16; default by head dim). ``window``: the sliding
    window of the layers the plan serves (see :func:`paged_decode`); only each request's last
    ``window`` keys are partitioned. ``kv_dtype``: the caches' dtype (None: 16-bit); an fp8 cache's plan
    takes more programs where the Hopper kernel runs it (:func:`programs_per_sm`; any plan is exact
    for any cache). Reuse the plan for every layer of the step (one plan per
    distinct window); call ``plan.update(new_lens)`` next step to keep the same buffers."""
    lens = _as_host_lens(seq_lens_cpu)
    window = check_window(window) or None
    for name, val in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim), ("block_size", block_size)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    check_heads(num_q_heads, num_kv_heads)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    if mode not in ("stream_k", "split"):
        raise ValueError(f"mode must be 'stream_k' or 'split', got {mode!r}")
    device = torch.device("cuda" if device is None and torch.cuda.is_available() else (device or "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if block_n is None:
        block_n = block_n_for(head_dim)
    elif isinstance(block_n, bool) or not isinstance(block_n, (int, np.integer)) or block_n < 16 \
            or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    if kv_dtype is not None and not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a torch.dtype or None, got {type(kv_dtype).__name__}")
    if num_programs is None:
        elem = 2 if kv_dtype is None else kv_dtype.itemsize
        num_programs = num_sms(device) * programs_per_sm(device, elem, num_q_heads, num_kv_heads, head_dim,
                                                         block_size, window)
    elif isinstance(num_programs, bool) or not isinstance(num_programs, (int, np.integer)) or num_programs < 1:
        raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")
    plan = DecodePlan(batch_size=lens.size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size, block_n=int(block_n),
                      target_programs=int(num_programs), mode=mode, device=device, seq_lens_host=lens,
                      window=window)
    return plan._update(lens)
