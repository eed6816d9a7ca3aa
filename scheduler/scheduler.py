"""Request scheduler: waiting/running queues, chunked prefill mixed with decode, recompute
preemption, fork at prompt end, and per-step host arrays for the paged backend.

Engine loop::

    batch = sched.schedule()                       # ScheduledBatch of numpy arrays
    pb.copy_blocks(k_caches, v_caches, batch.block_copies)   # before any KV write/attention
    logits = model(batch.input_ids, batch.positions, metadata from batch)
    tokens = sample(logits[batch.query_start_loc[1:][batch.num_samples > 0] - 1], ...)
    finished = sched.postprocess(batch, tokens)    # sum(num_samples) ids, in row order
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Callable

import numpy as np

from .batch import ScheduledBatch
from .block_manager import BlockManager
from .sampling_params import SamplingParams
from .sequence import Sequence, SequenceGroup, SequenceStatus

RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED
PENDING = -1  # the token id of a sample's newest token while the step drawing it is in flight


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError("need 1 <= max_num_seqs <= max_num_batched_tokens, got "
                             f"{max_num_seqs}, {max_num_batched_tokens}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.detokenize = detokenize
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.requests: dict = {}
        self._num_running_seqs = 0
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # ---------------------------------------------------------------- requests
    def max_blocks_needed(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks a request holds at its longest when it runs alone (samples share the prompt's
        full blocks); it must fit in the pool minus the watermark."""
        bs = self.bm.block_size
        total = prompt_len + params.max_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        return params.n * -(-total // bs) - (params.n - 1) * (prompt_len // bs)

    def add_request(self, prompt_token_ids, params: SamplingParams | None = None,
                    request_id=None) -> SequenceGroup:
        params = SamplingParams() if params is None else params
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        if request_id is None:
            request_id = f"req-{len(self.requests)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if self.max_model_len is not None and len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under "
                             f"max_model_len={self.max_model_len}")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        need = self.max_blocks_needed(len(prompt), params)
        room = self.bm.num_blocks - self.bm.watermark_blocks
        if need > room:
            raise ValueError(f"request {request_id!r} needs up to {need} KV blocks but the pool "
                             f"has {room} usable (num_blocks={self.bm.num_blocks}, watermark="
                             f"{self.bm.watermark_blocks}); raise num_blocks or lower max_tokens/n")
        g = SequenceGroup(request_id, prompt, params, next(self._arrivals))
        self.requests[request_id] = g
        self.waiting.append(g)
        return g

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id) -> SequenceGroup:
        """Drops a request wherever it is: its unfinished samples end with finish_reason "abort"
        and its blocks are freed. Call it between steps (a sequence's scheduled KV must have been
        written before its blocks can enter the prefix cache)."""
        g = self.requests.pop(request_id, None)
        if g is None:
            raise ValueError(f"unknown request_id {request_id!r}")
        if g in self.running:
            self.running.remove(g)
            self._num_running_seqs -= g.num_seq_slots
        elif g in self.waiting:
            self.waiting.remove(g)
        for s in g.seqs:
            if s.status is RUNNING:
                self.bm.free(s)
            if s.status is not FINISHED:
                s.status, s.finish_reason = FINISHED, "abort"
        g.num_live = 0
        return g

    def preempt(self, group: SequenceGroup) -> None:
        """Recompute preemption: free the group's blocks and put it at the front of waiting with
        its generated tokens kept (prompt + outputs are prefilled again on resume)."""
        if group not in self.running:
            raise ValueError(f"request {group.request_id!r} is not running")
        self.running.remove(group)
        self._preempt(group)

    def _preempt(self, g: SequenceGroup) -> None:
        for s in g.seqs:
            if s.status is RUNNING:
                self.bm.free(s)
                s.status = WAITING
        self._num_running_seqs -= g.num_seq_slots
        g.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(g)

    # ---------------------------------------------------------------- one step
    def schedule(self) -> ScheduledBatch:
        bm = self.bm
        budget = self.max_num_batched_tokens
        dec, dec_slots, copies, preempted = [], [], [], []
        # 1. decodes of running groups, oldest first; preempt the youngest when blocks run out
        kept, running, prefilling, dec_groups, dec_counts = deque(), self.running, [], [], []
        while running:
            g = running.popleft()
            ds, pf = [], False
            for s in g.seqs:
                if s.status is RUNNING:
                    r = len(s) - s.num_computed_tokens
                    if r == 1:
                        if s.wait_for is None or self._ready(s):
                            ds.append(s)
                    elif r > 1:
                        pf = True
            if ds:
                # each decode takes at most one block: the exact count only matters when short
                need = len(ds) if len(ds) <= bm.num_free_blocks else bm.blocks_to_append(ds)
                while bm.num_free_blocks < need and g is not None:
                    victim = running.pop() if running else g
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is g:
                        g = None
                if g is None:
                    break
                bm.append_slots(ds, dec_slots, copies)
                dec += ds
                dec_groups.append(g)
                dec_counts.append(len(ds))
            kept.append(g)
            if pf:
                prefilling.append(g)
        self.running = kept
        budget -= len(dec)
        # 2. prefill chunks of running groups, then 3. admit waiting groups (FIFO)
        pre = []
        for g in prefilling:
            if budget <= 0:
                break
            budget = self._chunks(g, budget, pre, min_tokens=2)
        while self.waiting and budget > 0:
            g = self.waiting[0]
            if self._num_running_seqs + g.num_seq_slots > self.max_num_seqs:
                break
            live = [s for s in g.seqs if s.status is WAITING]
            if not bm.can_allocate(live):
                break
            self.waiting.popleft()
            bm.allocate(live)
            for s in live:
                s.status = RUNNING
            self.running.append(g)
            self._num_running_seqs += g.num_seq_slots
            budget = self._chunks(g, budget, pre, min_tokens=1)
        dec_ns = np.repeat(np.array([1 if g.forked else g.params.n for g in dec_groups], np.int32),
                           dec_counts)
        return self._build(dec, dec_slots, dec_ns, pre, copies, preempted)

    def _ready(self, s: Sequence) -> bool:
        if s.wait_for.num_computed_tokens >= s.prefill_after or s.wait_for.status is FINISHED:
            s.wait_for = None
            return True
        return False

    def _chunks(self, g: SequenceGroup, budget: int, pre: list, min_tokens: int) -> int:
        for s in g.seqs:
            if budget <= 0:
                break
            if s.status is not RUNNING or (s.wait_for is not None and not self._ready(s)):
                continue
            start = s.num_computed_tokens
            rem = len(s) - start
            if rem < min_tokens:
                continue
            end = start + min(rem, budget)
            self.bm.mark_computed(s, end)
            pre.append((s, start, end))
            budget -= end - start
        return budget

    def _build(self, dec, dec_slots, dec_ns, pre, copies, preempted) -> ScheduledBatch:
        bm, bs = self.bm, self.bm.block_size
        seqs = dec + [p[0] for p in pre]
        B, D = len(seqs), len(dec)
        seq_lens = np.empty(B, np.int32)
        q_lens = np.ones(B, np.int32)
        seq_lens[:D] = [s.num_computed_tokens for s in dec]
        if pre:
            seq_lens[D:] = [p[2] for p in pre]
            q_lens[D:] = [p[2] - p[1] for p in pre]
        qsl = np.zeros(B + 1, np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        slot_mapping = np.concatenate([np.asarray(dec_slots, np.int64)]
                                      + [bm.slots(*p) for p in pre])
        input_ids = np.asarray([s.last_token for s in dec]
                               + [t for s, a, e in pre for t in s.tokens(a, e)], np.int64)
        starts = np.repeat(seq_lens - q_lens - qsl[:-1], q_lens).astype(np.int64)
        positions = np.arange(len(input_ids), dtype=np.int64) + starts
        nsamp = np.empty(B, np.int32)
        nsamp[:D] = dec_ns
        for i, (s, a, e) in enumerate(pre, D):
            nsamp[i] = 0 if e < len(s) else (1 if s.group.forked else s.group.params.n)
        seq_ids = np.fromiter((s.seq_id for s in seqs), np.int64, B)
        if B:
            rows = np.fromiter((s.row for s in seqs), np.intp, B)
            nblk = (seq_lens + (bs - 1)) // bs
            mb = int(nblk.max())
            bt = bm.table[rows, :mb]
            if int(nblk.min()) < mb:
                bt[np.arange(mb) >= nblk[:, None]] = 0
        else:
            bt = np.zeros((0, 0), np.int32)
        groups = self._share_groups(bt)
        return ScheduledBatch(
            seq_ids=seq_ids, block_tables=bt, seq_lens=seq_lens, query_start_loc=qsl,
            slot_mapping=slot_mapping, input_ids=input_ids, positions=positions,
            num_samples=nsamp, block_copies=np.asarray(copies, np.int64).reshape(-1, 2),
            share_groups=groups, num_decodes=D, num_prefill_tokens=int(qsl[-1]) - D,
            preempted=preempted, seqs=seqs, block_size=bs)

    @staticmethod
    def _share_groups(bt: np.ndarray) -> list[list[int]]:
        """Rows grouped by first block id: groups of >= 2 rows, each ascending."""
        rows = bt.shape[0]
        if rows < 2:
            return []
        first = bt[:, 0]
        if (first == first[0]).all():  # (one prompt's samples: one group)
            return [list(range(rows))]
        order = np.argsort(first, kind="stable")
        fs = first[order]
        brk = np.empty(rows, dtype=bool)  # a group starts here (np.r_ costs ~15 us a call)
        brk[0] = True
        np.not_equal(fs[1:], fs[:-1], out=brk[1:])
        start = np.flatnonzero(brk)
        size = np.empty_like(start)
        size[:-1] = start[1:] - start[:-1]
        size[-1] = rows - start[-1]
        multi = size >= 2
        if not multi.any():
            return []
        ol = order.tolist()
        return [ol[a:a + n] for a, n in zip(start[multi].tolist(), size[multi].tolist())]

    # ---------------------------------------------------------------- a step ahead
    def can_run_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether the next step may be scheduled before ``batch``'s tokens are back (the engine
        runs it meanwhile, its input ids taken on the device): ``batch`` decoded every running
        sample, nothing waits, every sample has a free block for its next token (no preemption), and
        some sample goes on after it. A sample that ends by length with ``batch`` is left out of the
        next step (its rows are the others', in order: ``run_ahead``); one that ends on EOS or a stop
        string still runs once more in it, and that row is dropped (``postprocess``)."""
        n = len(batch.seqs)
        if not n or batch.num_prefill_tokens or self.waiting or self.bm.num_free_blocks < n \
                or batch.num_samples.max() != 1:
            return False
        live = going = 0
        cap = self.max_model_len
        for g in self.running:
            for s in g.seqs:
                if s.status is RUNNING:
                    live += 1
                    going += not _ends_by_length(s, cap)
        return live == n and going > 0

    def run_ahead(self, batch: ScheduledBatch) -> None:
        """Gives each sample of ``batch`` (``can_run_ahead``) that goes on its token in flight as
        ``PENDING``, so the next ``schedule`` decodes it; ``postprocess(batch, ...)`` writes the real
        ids. (A sample ending by length gets no place: the next step leaves it out.)"""
        cap = self.max_model_len
        for s in batch.seqs:
            if not _ends_by_length(s, cap):
                s.append(PENDING)

    # ---------------------------------------------------------------- after the model ran
    def postprocess(self, batch: ScheduledBatch, sampled_token_ids) -> list[SequenceGroup]:
        """Append sampled tokens (sum(batch.num_samples) ids, rows in order, n consecutive ids for
        a forking row), or write them over their ``PENDING`` places; fork groups whose prompt
        ended, finish and free stopped samples. A row of a sample that finished since the step was
        scheduled (a step run ahead) is dropped. Returns the groups that finished in this step."""
        toks = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1).tolist()
        counts = batch.num_samples.tolist()
        if len(toks) != sum(counts):
            raise ValueError(f"expected {sum(counts)} sampled tokens, got {len(toks)}")
        done: list[SequenceGroup] = []
        k = 0
        for s, c, at in zip(batch.seqs, counts, batch.seq_lens.tolist()):
            if c == 0:
                continue
            if c == 1:
                if s.status is FINISHED:  # ended with the step before
                    k += 1
                    continue
                if at < len(s):  # the token's place, held since the step ran ahead
                    s.set_token(at, toks[k])
                else:
                    s.append(toks[k])
                self._check_stop(s, done)
            else:
                g = s.group
                fam = self.bm.fork(s, c)
                g.seqs.extend(fam[1:])
                g.forked = True
                g.num_live += c - 1
                for child, t in zip(fam, toks[k:k + c]):
                    child.append(t)
                    self._check_stop(child, done)
            k += c
        if done:
            self.running = deque(g for g in self.running if not g.is_finished)
        return done

    def _check_stop(self, s: Sequence, done: list) -> None:
        p = s.group.params
        t = s.last_token
        reason = None
        if t in p._stop_ids:
            reason = "stop"
        elif s.num_output_tokens >= p.max_tokens:
            reason = "length"
        elif self.max_model_len is not None and len(s) >= self.max_model_len:
            reason = "length"
        elif p.stop and self.detokenize is not None:
            # Only the tail can hold a stop string that this token completed: a character takes at
            # most 4 byte-level tokens, so 4 tokens per character of the longest stop string (and
            # a few more, so the tail's first token, decoded out of context, is not part of it).
            text = self.detokenize(s.out[max(0, len(s.out) - p._stop_window):])
            if any(x in text for x in p.stop):
                reason = "stop"
        if reason is None:
            return
        s.status, s.finish_reason = FINISHED, reason
        self.bm.free(s)
        g = s.group
        g.num_live -= 1
        if g.forked:
            self._num_running_seqs -= 1
        if g.num_live == 0:
            if not g.forked:
                self._num_running_seqs -= g.params.n
            done.append(g)


def _ends_by_length(s: Sequence, max_model_len: int | None) -> bool:
    """Whether sample ``s`` ends by length with its token in flight (a function: called per sample and
    step, twice, in the engine's loop)."""
    return s.num_output_tokens + 1 >= s.group.params.max_tokens or \
        (max_model_len is not None and len(s) + 1 >= max_model_len)
