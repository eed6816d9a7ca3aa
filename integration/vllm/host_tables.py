"""The decode rows' block tables on the host without a device-to-host sync, for cascade plans under
vLLM: the tables of each step are copied back asynchronously and used by the next step.

vLLM 0.33 hands a metadata builder the block table on the device only. A cascade plan needs it on the
host to find the blocks rows share, and copying it back at once is a sync that waits for every step
queued before (1.5-2.0 ms a build behind a busy GPU, stalling vLLM's async scheduling). Instead each
build queues a copy of its table (``send``: pinned host buffer, an event after it) and the next build
takes it (``take``), by vLLM's request slots (``CommonAttentionMetadata.req_idx``, the persistent
batch rows of Model Runner V2): a row's blocks as of the last step that ran its request. Exact:

- a request's blocks only grow while it runs (vLLM appends, never rewrites: no copy-on-write), so the
  blocks it held then are its first blocks now, and the plan reads only those on the host
  (``plan_cascade(host_lens=...)``), the kernels every block from the device table;
- a slot's row is another request's only after that request ran a step, and every request runs a
  step still prefilling (vLLM's ``is_prefilling``: its prompt not all computed - a one-token row too,
  where all of a cached prompt but its last token was found) before any that is not, so the copy of
  that step holds its blocks before it decodes; in that first step the builder lets the row share
  nothing (its slot may still hold the last request's row). A KV connector breaks this (a prompt
  prefilled elsewhere): the builder does not use these tables with one;
- the plan finds shared blocks among blocks held then, which misses none: the blocks a request
  gained since are new, its own (a request crossing into a block) or a prefill's.

- block 0 is vLLM's null block, which no request holds: a row is held only up to its first 0. The
  dummy batches vLLM runs (warm-up, an idle data-parallel rank) name slots ``0 ..`` with tables of
  null blocks; cut there, such a row shares nothing until its request's next step is copied.

The copy of step ``t`` is queued before step ``t``'s forward and read while step ``t + 1`` is built:
done already unless the GPU still runs the step before ``t``, and then waiting for it waits for that
step, not for everything queued (``waits`` counts them).
"""
from __future__ import annotations

import numpy as np
import torch


class HostTables:
    """Rows of the block table by request slot, as of the last step that ran each (see module doc)."""

    def __init__(self):
        self.rows = np.zeros((0, 0), dtype=np.int32)  # [slots, cols] block ids
        self.held = np.zeros(0, dtype=np.int64)  # [slots] leading blocks of each row that ``rows`` holds
        self._pending = None  # (host copy [B, cols], slots [B], blocks [B], event or None)
        self.waits = 0  # takes that waited for their copy (tests, docs)

    def send(self, table: torch.Tensor, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Queues the copy of a step's ``table [B, M]`` (device), whose row ``i`` is request slot
        ``slots[i]`` holding ``blocks[i]`` blocks (its length in blocks, rounded up)."""
        cols = int(blocks.max()) if blocks.size else 0
        cuda = table.is_cuda
        host = torch.empty((table.shape[0], cols), dtype=torch.int32, pin_memory=cuda)
        host.copy_(table[:, :cols], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (host, np.asarray(slots, dtype=np.int64).copy(), np.asarray(blocks, dtype=np.int64).copy(),
                         event)

    def take(self, slots: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows of request ``slots [B]`` -> (table [B, cols] int32, held [B]: leading blocks of
        each row that it holds - 0 for a slot never sent, never past a null block; past them, any ids)."""
        self._merge()
        slots = np.asarray(slots, dtype=np.int64)
        self._grow(int(slots.max()) + 1 if slots.size else 0, cols)
        table = self.rows[slots, :cols]
        null = np.append(table == 0, np.ones((table.shape[0], 1), dtype=bool), axis=1)  # [B, cols + 1]
        return table, np.minimum(self.held[slots], null.argmax(axis=1))

    def _merge(self) -> None:
        if self._pending is None:
            return
        host, slots, blocks, event = self._pending
        self._pending = None
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        self._grow(int(slots.max()) + 1 if slots.size else 0, host.shape[1])
        self.rows[slots, :host.shape[1]] = host.numpy()
        self.held[slots] = blocks

    def _grow(self, n: int, cols: int) -> None:
        if n <= self.rows.shape[0] and cols <= self.rows.shape[1]:
            return
        rows = np.zeros((max(n, self.rows.shape[0]), max(cols, self.rows.shape[1])), dtype=np.int32)
        rows[:self.rows.shape[0], :self.rows.shape[1]] = self.rows
        held = np.zeros(rows.shape[0], dtype=np.int64)
        held[:self.held.size] = self.held
        self.rows, self.held = rows, held
