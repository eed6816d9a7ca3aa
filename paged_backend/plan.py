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

import numpy as np
import torch

from kernels.checks import HEAD_DIMS, check_heads
from kernels.dispatch import num_sms

# Programs per SM for the decode kernel (4 warps, 3 pipeline stages, 64-token tiles); G = SMs x this.
# Swept on an H200 (2026-11-21) with 1-6 programs per SM and 32/64/128-token tiles: 2 x 64 was best
# or within 2% of best on every workload-of-record case.
PROGRAMS_PER_SM = 2
# Stream-K keeps whole segments (no split) when that is at most this much slower than an even cut.
NO_SPLIT_SLACK = 1.15
WORK_FIELDS = 5  # (request, kv_head, token_start, token_end, partial slot or -1 = write output)


def block_n_for(head_dim: int) -> int:
    """Tokens per KV tile (a work unit): 64 for D <= 128 (see PROGRAMS_PER_SM), halved for D = 256
    so three pipeline stages of K and V still fit in shared memory."""
    return 32 if head_dim > 128 else 64


def _as_host_lens(seq_lens_cpu) -> np.ndarray:
    if isinstance(seq_lens_cpu, torch.Tensor):
        if seq_lens_cpu.device.type != "cpu":
            raise ValueError("seq_lens_cpu must be a host (CPU) tensor, list or numpy array; "
                             f"got a tensor on {seq_lens_cpu.device} (copy it once per step, not per layer)")
        seq_lens_cpu = seq_lens_cpu.numpy()
    arr = np.asarray(seq_lens_cpu)
    if arr.ndim != 1:
        raise ValueError(f"seq_lens_cpu must be 1-D [B], got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"seq_lens_cpu must hold integers, got {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"seq_lens_cpu must be >= 0, got min {arr.min()}")
    return arr.astype(np.int64)


def _dedupe_sorted(a: np.ndarray) -> np.ndarray:
    """np.unique for an already sorted array, without its sort or hashing."""
    keep = np.ones(a.size, dtype=bool)
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def _program_bounds(seg_units: np.ndarray, seg_bounds: np.ndarray, mode: str, grid: int) -> np.ndarray:
    """Cut points (in units, including 0 and U) of the program runs; ``len - 1`` programs.
    ``seg_bounds [S + 1]``: the segments' cumulative units, from 0."""
    total = int(seg_bounds[-1])
    if mode == "split":
        live = max(1, int((seg_units > 0).sum()))
        chunks = max(1, -(-grid // live))
        per = np.maximum(1, -(-seg_units // chunks))  # units per chunk, per segment
        n_chunks = np.where(seg_units > 0, -(-seg_units // per), 0)
        starts = np.repeat(seg_bounds[:-1], n_chunks)
        first = np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
        offs = (np.arange(int(n_chunks.sum())) - first) * np.repeat(per, n_chunks)
        return _dedupe_sorted(np.concatenate([starts + offs, [total]]))  # chunk starts are ascending
    # stream_k: keep whole segments when they already balance the GPU.
    n_seg = seg_units.size
    longest = int(seg_units.max()) if n_seg else 0
    if n_seg >= grid and -(-n_seg // grid) * longest <= NO_SPLIT_SLACK * total / grid:
        idx = (np.arange(grid + 1) * n_seg) // grid
        return seg_bounds[idx]
    return (np.arange(grid + 1, dtype=np.int64) * total) // grid


def cut_pieces(seg_units: np.ndarray, grid: int, mode: str = "stream_k"):
    """Cuts segments of ``seg_units [S]`` units (each >= 1) into program runs (see the module doc).

    -> ``(seg [P], unit_start [P], unit_end [P], seg_ptr [S + 1], prog_ptr [R + 1])``: the pieces
    in order (units counted within their segment), each segment's pieces ``seg_ptr[s]..
    seg_ptr[s+1]``, and each of the R program runs' first piece (R = ``grid`` for stream-K).
    Shared by the decode plan and the cascade plan's node and tail work.
    """
    n_seg = seg_units.size
    seg_bounds = np.zeros(n_seg + 1, dtype=np.int64)
    np.cumsum(seg_units, out=seg_bounds[1:])
    prog_bounds = _program_bounds(seg_units, seg_bounds, mode, grid)
    total = int(seg_bounds[-1])
    # Pieces = segments cut again at the program bounds that fall strictly inside them. Only the
    # program bounds are searched, never the (longer) list of segment bounds.
    cut = _dedupe_sorted(prog_bounds)
    at = np.searchsorted(seg_bounds, cut)
    inner = at <= n_seg
    inner[inner] = seg_bounds[at[inner]] != cut[inner]
    inner &= (cut > 0) & (cut < total)
    cut, cut_seg = cut[inner], at[inner] - 1  # sorted, so grouped by segment
    per_seg = 1 + np.bincount(cut_seg, minlength=n_seg)
    seg_ptr = np.zeros(n_seg + 1, dtype=np.int64)
    np.cumsum(per_seg, out=seg_ptr[1:])
    n = int(seg_ptr[-1])
    seg = np.repeat(np.arange(n_seg), per_seg)  # [P]
    starts = np.empty(n, dtype=np.int64)
    first = np.zeros(n, dtype=bool)
    first[seg_ptr[:-1]] = True
    starts[first] = seg_bounds[:-1]
    starts[~first] = cut
    ends = np.empty(n, dtype=np.int64)
    ends[:-1] = starts[1:]
    ends[-1:] = total
    seg_start = seg_bounds[seg]
    prog_ptr = np.searchsorted(starts, prog_bounds, side="left")
    return seg, starts - seg_start, ends - seg_start, seg_ptr, prog_ptr


@dataclass
class DecodePlan:
    """What the decode kernel needs, computed on the host once per step.

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
    num_pieces: int = 0
    buffers: torch.Tensor = field(default=None, repr=False)
    partial_o: torch.Tensor = field(default=None, repr=False)
    partial_lse: torch.Tensor = field(default=None, repr=False)
    _host: np.ndarray = field(default=None, repr=False)  # the partition, as last written
    _units: np.ndarray = field(default=None, repr=False)  # tiles per request of that partition
    _last_ends: np.ndarray = field(default=None, repr=False)  # where each segment's last token_end is
    _staging: list = field(default=None, repr=False)
    _copied: list = field(default=None, repr=False)
    _flip: int = 0

    @property
    def num_programs(self) -> int:
        """The fixed launch grid. Split-KV cuts each of the S live segments into
        ceil(G / S) chunks, so at most G + S programs."""
        if self.mode == "split":
            return self.target_programs + self.batch_size * self.num_kv_heads
        return self.target_programs

    @property
    def max_pieces(self) -> int:
        return self.target_programs + self.batch_size * self.num_kv_heads

    @property
    def work(self) -> torch.Tensor:  # [max_pieces, 5]
        return self.buffers[: self.max_pieces * WORK_FIELDS].view(self.max_pieces, WORK_FIELDS)

    @property
    def prog_ptr(self) -> torch.Tensor:  # [G + 1]
        start = self.max_pieces * WORK_FIELDS
        return self.buffers[start: start + self.num_programs + 1]

    @property
    def seg_ptr(self) -> torch.Tensor:  # [B * Hkv + 1]
        start = self.max_pieces * WORK_FIELDS + self.num_programs + 1
        return self.buffers[start:]

    def update(self, seq_lens_cpu) -> "DecodePlan":
        """Re-partition for new lengths (same batch size) into the same device buffers."""
        lens = _as_host_lens(seq_lens_cpu)
        if lens.size != self.batch_size:
            raise ValueError(f"seq_lens_cpu must have {self.batch_size} entries (the plan's batch size), "
                             f"got {lens.size}")
        self.seq_lens_host = lens
        size = self.max_pieces * WORK_FIELDS + self.num_programs + 1 + self.batch_size * self.num_kv_heads + 1
        if self.buffers is None:
            self._allocate(size)
        self._partition(lens, self._host)
        if self.device.type != "cuda":
            return self  # _host is the buffer itself
        # Two pinned staging buffers, alternated: the CPU may run a step ahead of the GPU, so a
        # buffer is rewritten only after its previous copy has been done (its event).
        i = self._flip = 1 - self._flip
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        np.copyto(self._staging[i].numpy(), self._host)
        self.buffers.copy_(self._staging[i], non_blocking=True)
        self._copied[i] = torch.cuda.Event()
        self._copied[i].record()
        return self

    def _allocate(self, size: int) -> None:
        dev = self.device
        self.buffers = torch.zeros(size, dtype=torch.int32, device=dev)
        group = self.num_q_heads // self.num_kv_heads
        self.partial_o = torch.empty(self.max_pieces, group, self.head_dim, dtype=torch.float32, device=dev)
        self.partial_lse = torch.empty(self.max_pieces, group, dtype=torch.float32, device=dev)
        if dev.type == "cuda":
            self._host = np.zeros(size, dtype=np.int32)
            self._staging = [torch.zeros(size, dtype=torch.int32).pin_memory() for _ in range(2)]
            self._copied, self._flip = [None, None], 0
        else:
            self._host = self.buffers.numpy()

    def _partition(self, lens: np.ndarray, out: np.ndarray) -> None:
        """Writes ``work | prog_ptr | seg_ptr`` into the int32 host array ``out``."""
        hkv, bn, g = self.num_kv_heads, self.block_n, self.num_programs
        # An empty segment still gets one (empty) piece, which writes o = 0, lse = -inf.
        req_units = np.maximum((lens + (bn - 1)) // bn, 1)
        if self._units is not None and np.array_equal(req_units, self._units):
            # The same tiles as last step (a decode step adds one token; a request crosses a tile
            # boundary once per block_n tokens): only the last piece of each segment ends elsewhere.
            out[self._last_ends] = np.repeat(lens, hkv)
            return
        seg_units = np.repeat(req_units, hkv)  # [S], S = B * Hkv
        seg, u0, u1, seg_ptr, prog_ptr_cut = cut_pieces(seg_units, self.target_programs, self.mode)
        n = seg.size
        req = seg // hkv
        work = out[: self.max_pieces * WORK_FIELDS].reshape(-1, WORK_FIELDS)
        work[:n, 0] = req
        work[:n, 1] = seg - req * hkv
        work[:n, 2] = u0 * bn
        work[:n, 3] = np.minimum(u1 * bn, lens[req])
        work[:n, 4] = np.where(np.diff(seg_ptr)[seg] > 1, np.arange(n), -1)
        at = self.max_pieces * WORK_FIELDS
        prog_ptr = out[at: at + g + 1]
        prog_ptr[: prog_ptr_cut.size] = prog_ptr_cut
        prog_ptr[prog_ptr_cut.size:] = n  # programs past the last cut get empty runs
        out[at + g + 1:] = seg_ptr
        self.num_pieces = n
        self._units, self._last_ends = req_units, (seg_ptr[1:] - 1) * WORK_FIELDS + 3  # column 3


def plan_decode(seq_lens_cpu, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                device=None, mode: str = "stream_k", num_programs: int | None = None,
                block_n: int | None = None) -> DecodePlan:
    """Partition one decode step. ``seq_lens_cpu [B]`` host lengths (tokens in cache, current one
    included). ``num_programs`` overrides ``G`` (default: SMs x programs per SM) and ``block_n`` the
    tokens per work unit (a power of two >= 16; default by head dim). Reuse the plan for
    every layer of the step; call ``plan.update(new_lens)`` next step to keep the same buffers."""
    lens = _as_host_lens(seq_lens_cpu)
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
    if num_programs is None:
        num_programs = num_sms(device) * PROGRAMS_PER_SM
    elif isinstance(num_programs, bool) or not isinstance(num_programs, (int, np.integer)) or num_programs < 1:
        raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")
    plan = DecodePlan(batch_size=lens.size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size, block_n=int(block_n),
                      target_programs=int(num_programs), mode=mode, device=device, seq_lens_host=lens)
    return plan.update(lens)
