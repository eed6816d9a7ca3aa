"""One scheduler step as host arrays for the paged backend."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step. B rows (sequences), T new tokens. Rows [0, num_decodes) are decodes (one token
    each); the rest are prefill chunks. All arrays are host numpy arrays.

    seq_ids [B] int64; block_tables [B, max_blocks] int32 (entries past a row's
    ceil(seq_len / BS) are 0); seq_lens [B] int32 = tokens in cache after this step's writes;
    query_start_loc [B+1] int32 delimits each row's new tokens; slot_mapping [T] int64 (the
    slots of the new tokens only, never -1 here); input_ids [T] int64; positions [T] int64;
    num_samples [B] int32 = tokens to sample from the row's last position (0 mid-prompt, n when
    a request's prompt ends and it forks, else 1); block_copies [K, 2] int64 (src, dst) block
    copies to run before this step's writes; share_groups: lists (size >= 2, ascending) of row
    indices whose first block id is the same (fork samples, prefix-cache hits), for
    ``pb.plan_cascade``; share_blocks (lazy): per group, how many leading block ids all its rows
    have in common.
    """

    seq_ids: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    slot_mapping: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    num_samples: np.ndarray
    block_copies: np.ndarray
    share_groups: list[list[int]]
    num_decodes: int
    num_prefill_tokens: int
    preempted: list = field(default_factory=list)  # request ids preempted while building it
    seqs: list[Sequence] = field(default_factory=list, repr=False)
    block_size: int = 0
    _share_blocks: list[int] | None = field(default=None, repr=False)

    @property
    def share_blocks(self) -> list[int]:
        """Per share group, the number of leading block ids all its rows have in common
        (computed on first access: a few numpy passes, kept off the step's critical path)."""
        if self._share_blocks is None:
            nblk = (self.seq_lens + (self.block_size - 1)) // self.block_size
            self._share_blocks = _common_blocks(self.block_tables, nblk, self.share_groups)
        return self._share_blocks

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def _common_blocks(bt: np.ndarray, nblk: np.ndarray, groups: list[list[int]]) -> list[int]:
    """Per group of rows (all sharing block 0), how many leading block ids they all share. The
    block manager only ever shares a leading run of blocks (fork, prefix-cache chain, resumed
    samples), so "shares c blocks" is monotone in c: binary search over single columns."""
    if not groups:
        return []
    size = np.array([len(g) for g in groups])
    rows = np.array([i for g in groups for i in g], np.intp)
    seg = np.r_[0, np.cumsum(size)[:-1]]
    gid = np.repeat(np.arange(len(groups)), size)
    lead = rows[seg][gid]
    lo = np.ones(len(groups), np.int64)  # all share >= lo blocks (block 0)
    hi = np.minimum.reduceat(nblk[rows], seg).astype(np.int64)
    while True:
        act = lo < hi
        if not act.any():
            return lo.tolist()
        mid = (lo + hi + 1) // 2  # does every row share column mid - 1?
        c = np.minimum(mid, hi)[gid] - 1
        ok = np.logical_and.reduceat(bt[rows, c] == bt[lead, c], seg) & act
        lo = np.where(ok, mid, lo)
        hi = np.where(act & ~ok, mid - 1, hi)
