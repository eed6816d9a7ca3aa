"""Ref-counted paged-KV block manager: prefix cache, fork with copy-on-write, numpy block tables.

A pool of ``num_blocks`` (NB) blocks of ``block_size`` (BS) token slots; slot = block * BS + row.
Every block has a reference count = number of live sequences whose block table holds it.

Prefix cache. A full block whose KV has been computed is registered under a chain key
``(parent_uid, tuple(its BS token ids))``: ``parent_uid`` is the content id of the previous block
of the same sequence (-1 for the first block). Content ids are unique and never reused, so the key
names the whole prefix exactly. ``hash_to_block`` maps ``hash_fn(key)`` to a block and a hit is
only taken if the block's stored key equals the wanted key, so a hash collision never shares the
wrong KV (it only loses a hit). Freed registered blocks stay in the free pool, reusable by hash,
until they are reallocated (LRU: blocks with no hash are reused first).

Fork and copy-on-write. ``fork(seq, n)`` gives n-1 new sequences the same block table (every
block's ref count rises); a shared partial last block is copied on the first write:
``append_slot`` then returns the ``(src, dst)`` block copy the engine must run before attention.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, watermark: float = 0.01,
                 enable_prefix_caching: bool = True, hash_fn: Callable[[tuple], int] = hash,
                 bytes_per_block: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.bytes_per_block = bytes_per_block
        self.ref = np.zeros(num_blocks, np.int32)  # holders of each block
        self._forget_contents()
        self._next_uid = 0
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_held = 0  # sum of ref counts = (sequence, block) holdings
        self.table = np.zeros((64, 64), np.int32)  # [rows, max_blocks]; a row per live sequence
        self._free_rows = list(range(63, -1, -1))
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---------------------------------------------------------------- pool primitives
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def _alloc_block(self) -> int:
        if not self.free_ids:
            raise RuntimeError("out of KV blocks (the caller must check can_allocate/can_append)")
        b, _ = self.free_ids.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict its prefix-cache entry
            del self.hash_to_block[h]
            self.block_hash[b] = None
        self.block_key[b] = None
        self.block_uid[b] = -1
        self.ref[b] = 1
        self.num_held += 1
        return b

    def _take(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free_ids[b]
        self.ref[b] += 1
        self.num_held += 1

    def _release(self, blocks: np.ndarray) -> None:
        """One holding fewer of each of ``blocks`` (distinct: a sequence's table never repeats a
        block); those no one holds go back to the pool in ``blocks``' order. Counted at once: a
        finishing sample drops every block of its prompt, and 64 samples of a 32K prompt are ~131K
        releases in one step (one at a time in Python 4.6 ms on the dev box, 1.7 ms so)."""
        left = self.ref[blocks] - 1
        self.ref[blocks] = left
        gone = blocks[left == 0]
        if gone.size:
            free, hashes = self.free_ids, self.block_hash
            for b in gone.tolist():
                free[b] = None  # most recently used end: evicted last
                if hashes[b] is None:
                    free.move_to_end(b, last=False)  # nothing cached: reuse first
        self.num_held -= blocks.size

    def _new_row(self, nblocks: int) -> int:
        if not self._free_rows:
            r0 = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free_rows = list(range(2 * r0 - 1, r0 - 1, -1))
        self._ensure_cols(nblocks)
        return self._free_rows.pop()

    def _ensure_cols(self, nblocks: int) -> None:
        cols = self.table.shape[1]
        if nblocks > cols:
            while cols < nblocks:
                cols *= 2
            t = np.zeros((self.table.shape[0], cols), np.int32)
            t[:, :self.table.shape[1]] = self.table
            self.table = t

    def _set_table(self, seq: Sequence) -> None:
        bt = seq.block_table
        self._ensure_cols(len(bt))
        self.table[seq.row, :len(bt)] = bt

    # ---------------------------------------------------------------- prefix cache
    def _match_prefix(self, seq: Sequence, start: int = 0, parent: int = -1) -> list[int]:
        """Cached blocks holding seq's full blocks start, start+1, ... (block start-1 has
        content id ``parent``); leaves >= 1 token to compute."""
        if not self.enable_prefix_caching or (start and parent < 0):
            return []
        bs, hits = self.block_size, []
        for i in range(start, (len(seq) - 1) // bs):
            key = (parent, tuple(seq.tokens(i * bs, (i + 1) * bs)))
            b = self.hash_to_block.get(self.hash_fn(key))
            if b is None or self.block_key[b] != key:
                break
            hits.append(b)
            parent = self.block_uid[b]
        return hits

    def _register(self, seq: Sequence, upto_blocks: int) -> None:
        """Give content ids to seq's full computed blocks [num_hashed_blocks, upto_blocks) and
        put them in the prefix cache (first writer wins a hash)."""
        bs, bt = self.block_size, seq.block_table
        for i in range(seq.num_hashed_blocks, upto_blocks):
            b = bt[i]
            if self.block_uid[b] >= 0:  # shared block another holder registered already
                seq.num_hashed_blocks = i + 1
                continue
            parent = self.block_uid[bt[i - 1]] if i else -1
            if i and parent < 0:  # previous block has no content id: chain broken, stop
                return
            key = (parent, tuple(seq.tokens(i * bs, (i + 1) * bs)))
            self.block_uid[b] = self._next_uid
            self._next_uid += 1
            self.block_key[b] = key
            h = self.hash_fn(key)
            if h not in self.hash_to_block:
                self.hash_to_block[h] = b
                self.block_hash[b] = h
            seq.num_hashed_blocks = i + 1

    # ---------------------------------------------------------------- allocation
    def _share_len(self, leader: Sequence, seq: Sequence) -> int:
        """Leading full blocks a sibling takes from its leader (the common prompt)."""
        return min(seq.num_prompt_tokens, len(seq) - 1, len(leader)) // self.block_size

    def _plan(self, seqs: list[Sequence]) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """Leader's prefix-cache hits; per sibling (blocks shared with the leader, further hits
        continuing from the leader's shared block k-1, known only if that one is a hit)."""
        hits = self._match_prefix(seqs[0])
        sib = []
        for s in seqs[1:]:
            k = self._share_len(seqs[0], s)
            if k == 0:
                more = self._match_prefix(s)
            elif k <= len(hits):
                more = self._match_prefix(s, k, self.block_uid[hits[k - 1]])
            else:
                more = []
            sib.append((k, more))
        return hits, sib

    def blocks_to_allocate(self, seqs: list[Sequence]) -> int:
        """Free blocks that ``allocate(seqs)`` would take (prefix hits on free blocks count)."""
        bs = self.block_size
        hits, sib = self._plan(seqs)
        taken = set(hits)
        need = -(-len(seqs[0]) // bs) - len(hits) + sum(1 for b in taken if self.ref[b] == 0)
        for s, (k, more) in zip(seqs[1:], sib):
            need += -(-len(s) // bs) - k - len(more)
            need += sum(1 for b in more if self.ref[b] == 0 and b not in taken)
            taken.update(more)
        return need

    def can_allocate(self, seqs: Sequence | list[Sequence]) -> bool:
        """Whether allocate(seqs) fits and leaves the watermark free (for decode growth)."""
        if isinstance(seqs, Sequence):
            seqs = [seqs]
        return self.num_free_blocks - self.blocks_to_allocate(seqs) >= self.watermark_blocks

    def allocate(self, seqs: Sequence | list[Sequence]) -> None:
        """Give blocks for all tokens of each sequence (they must hold none).

        The first sequence (the leader) reuses prefix-cache hits and starts with
        num_computed_tokens = hits * BS. Later ones (samples of one request being resumed) share
        the leader's blocks of the common prompt (and may wait until the leader has computed
        them: ``wait_for``/``prefill_after``), then reuse cached blocks of their own.
        """
        if isinstance(seqs, Sequence):
            seqs = [seqs]
        assert self.num_free_blocks >= self.blocks_to_allocate(seqs), "check can_allocate first"
        bs = self.block_size
        leader = seqs[0]
        hits, sib = self._plan(seqs)
        for b in hits:  # take every hit before allocating, so none is evicted meanwhile
            self._take(b)
        for _, more in sib:
            for b in more:
                self._take(b)
        self.prefix_query_tokens += len(leader)
        self.prefix_hit_tokens += len(hits) * bs
        n = -(-len(leader) // bs)
        leader.block_table = hits + [self._alloc_block() for _ in range(n - len(hits))]
        leader.num_computed_tokens = len(hits) * bs
        leader.num_hashed_blocks = len(hits)
        leader.row = self._new_row(n)
        self._set_table(leader)
        for s, (k, more) in zip(seqs[1:], sib):
            shared = leader.block_table[:k]
            for b in shared:
                self._take(b)
            self.prefix_query_tokens += len(s) - k * bs
            self.prefix_hit_tokens += len(more) * bs
            s.block_table = shared + more + [
                self._alloc_block() for _ in range(-(-len(s) // bs) - k - len(more))]
            s.prefill_after = k * bs
            s.num_computed_tokens = (k + len(more)) * bs
            s.num_hashed_blocks = k + len(more)
            s.wait_for = leader if leader.num_computed_tokens < k * bs else None
            s.row = self._new_row(len(s.block_table))
            self._set_table(s)

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Record that seq's first num_tokens tokens have (or will have, this step) KV in cache;
        their full blocks enter the prefix cache. Blocks must already be allocated."""
        assert num_tokens <= len(seq.block_table) * self.block_size
        seq.num_computed_tokens = num_tokens
        if self.enable_prefix_caching:
            self._register(seq, num_tokens // self.block_size)

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slot ids [end - start] int64 of positions [start, end) of seq."""
        pos = np.arange(start, end, dtype=np.int64)
        return self.table[seq.row, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size

    # ---------------------------------------------------------------- decode growth
    def blocks_to_append(self, seqs: Iterable[Sequence]) -> int:
        """Exact free blocks that append_slot on each of seqs (in any order) will take: a new
        block when the token starts one, a copy when its block is shared, except that the last
        holder of a block shared only among seqs writes in place."""
        bs, ref, need, shared = self.block_size, self.ref, 0, None
        for s in seqs:
            pos = s.num_computed_tokens
            if pos % bs == 0 and pos // bs == len(s.block_table):
                need += 1
            else:
                b = s.block_table[pos // bs]
                if ref[b] > 1:
                    need += 1
                    if shared is None:
                        shared = {}
                    shared[b] = shared.get(b, 0) + 1
        if shared:
            need -= sum(1 for b, c in shared.items() if c == ref[b])
        return need

    def can_append(self, seqs: Sequence | Iterable[Sequence]) -> bool:
        if isinstance(seqs, Sequence):
            seqs = (seqs,)
        return self.blocks_to_append(seqs) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> bool:
        """Whether append_slot(seq) needs a free block (new block or copy-on-write)."""
        return self.blocks_to_append((seq,)) > 0

    def append_slot(self, seq: Sequence) -> tuple[int, tuple[int, int] | None]:
        """Slot for the token at position num_computed_tokens (decode: the newest token), making
        its block private first. Returns (slot, (src, dst) block copy or None). Blocks filled by
        decode enter the prefix cache when the sequence is freed (keeps the step cost flat)."""
        slots, copies = [], []
        self.append_slots([seq], slots, copies)
        return slots[0], (copies[0] if copies else None)

    def append_slots(self, seqs: list[Sequence], slots: list[int], copies: list) -> None:
        """append_slot for each of seqs (a step's decodes, in order): appends their slots to
        ``slots`` and (src, dst) copy-on-write pairs to ``copies``. Check can_append first."""
        bs, ref, grow = self.block_size, self.ref, []
        for s in seqs:
            pos = s.num_computed_tokens
            bi = pos // bs
            bt = s.block_table
            s.num_computed_tokens = pos + 1
            if bi == len(bt):  # starts a new block: allocated in bulk below
                grow.append((s, len(slots), bi))
                slots.append(pos - bi * bs)
                continue
            b = bt[bi]
            if ref[b] > 1:  # copy on write
                nb = self._alloc_block()
                self._release(np.array((b,)))
                bt[bi] = nb
                self.table[s.row, bi] = nb
                copies.append((b, nb))
                b = nb
            slots.append(b * bs + pos - bi * bs)
        if grow:
            if len(grow) > len(self.free_ids):
                raise RuntimeError("out of KV blocks (check can_append first)")
            new = [self._alloc_block() for _ in grow]
            rows, cols = [], []
            for (s, i, bi), b in zip(grow, new):
                s.block_table.append(b)
                slots[i] += b * bs
                rows.append(s.row)
                cols.append(bi)
            self._ensure_cols(max(cols) + 1)
            self.table[rows, cols] = new

    # ---------------------------------------------------------------- fork / free
    def fork(self, seq: Sequence, n: int) -> list[Sequence]:
        """n samples sharing seq's blocks: [seq, n-1 new sequences]. No copy now; a shared
        partial last block is copied by append_slot on first write."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        out = [seq]
        for _ in range(n - 1):
            c = seq.clone()
            c.block_table = list(seq.block_table)
            c.row = self._new_row(len(seq.block_table))
            self.table[c.row, :len(seq.block_table)] = self.table[seq.row, :len(seq.block_table)]
            out.append(c)
        self.ref[self.table[seq.row, :len(seq.block_table)]] += n - 1  # (distinct blocks)
        self.num_held += (n - 1) * len(seq.block_table)
        return out

    def free(self, seq: Sequence) -> None:
        """Drop seq's blocks (tail first, so a prompt's leading blocks stay cached longest).
        Its computed full blocks not yet in the prefix cache (filled by decode) enter it first,
        so a preempted sequence or a follow-up prompt can reuse them. Call it only between steps
        or for a sequence not in the step being built (its KV must be written)."""
        if self.enable_prefix_caching and seq.block_table:
            self._register(seq, seq.num_computed_tokens // self.block_size)
        if seq.row >= 0:  # (every sequence holding blocks has a row, which mirrors its table)
            row = self.table[seq.row, :len(seq.block_table)]
            self._release(row[::-1].copy())
            row[:] = 0
            self._free_rows.append(seq.row)
        seq.row = -1
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.prefill_after = 0
        seq.wait_for = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block's content (the KV of new weights differs from the cached one).
        Only while no sequence holds a block (between engine calls; as vLLM's): -> whether it did."""
        if self.num_held:
            return False
        self._forget_contents()
        return True

    def _forget_contents(self) -> None:
        """No block's content known: the prefix cache's index empty."""
        n = self.num_blocks
        self.block_hash: list[int | None] = [None] * n  # set while in hash_to_block
        self.block_key: list[tuple | None] = [None] * n  # (parent_uid, tokens)
        self.block_uid = [-1] * n                        # content id, -1 = none
        self.hash_to_block: dict[int, int] = {}

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        """free/used blocks, holdings (sum of refs), blocks and bytes saved by sharing,
        shared fraction = saved / holdings, prefix-cache hit rate over allocated prompts."""
        used = self.num_blocks - self.num_free_blocks
        saved = self.num_held - used
        return {
            "num_blocks": self.num_blocks,
            "free_blocks": self.num_free_blocks,
            "used_blocks": used,
            "holdings": self.num_held,
            "blocks_saved": saved,
            "shared_fraction": saved / self.num_held if self.num_held else 0.0,
            "bytes_saved": saved * self.bytes_per_block,
            "cached_blocks": len(self.hash_to_block),
            "prefix_hit_rate": (self.prefix_hit_tokens / self.prefix_query_tokens
                                if self.prefix_query_tokens else 0.0),
        }
