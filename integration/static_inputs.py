"""A decode step's inputs at the fixed device addresses a CUDA graph reads, and where its draw goes.

The host writes each step's values into pinned memory (:meth:`StaticInputs.fill`); the graph's first
kernel reads them from there into the device buffer (:meth:`StaticInputs.copy_in`,
``kernels/stage.py``) and its last one writes the drawn tokens and log-probabilities back into pinned
memory (:meth:`StaticInputs.publish`): the device runs no copies between two steps' graphs (H200,
2026-11-29: a device-to-host and two host-to-device copies there had cost ~34 us of GPU idle a step of
the 8B shape). The pinned values may be rewritten once the last graph's first kernel has read them:
it records ``consumed`` (an event recorded inside the graph), which :meth:`fill` waits for. The draw
alternates between two halves of ``drawn``: the host reads one step's half while the next step
writes the other, and a half is written again only two fills later, after the engine has read it
(``Launched.wait`` of a step comes before the launch of the step after next).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from paged_backend.kernels import stage


class StaticInputs:
    """A decode step's inputs padded to ``size`` rows, in one device buffer: ``ids``, ``pos``
    [1, size] int64, ``slots`` [size] int64, ``table`` [size, width] int32, ``lens`` [size] int32,
    and the draw's ``keys`` [size] int64 (noise) and settings (``SampleSettings``: ``k`` int64,
    ``temp``, ``min_p``, ``top_p`` float32, ``greedy`` bool); ``parity`` [1] int32 picks the half of
    ``drawn`` [2, size, 2] float64 (pinned on a GPU) the draw writes. Padding rows: token 0 (or the
    last draw's) at position 0, slot -1 (nothing is written), length 0 (attention gives 0), key 0 at
    temperature 1 with no filter (a draw whose token is dropped). ``host``: {name: the host array last
    filled in}; the table goes to the device as its used columns only (a model's whole context can
    be 8K blocks a row, a step's few hundred), their count in ``cols``."""

    # the draw's settings of a padding row (and of every row of a step the graph does not draw)
    PAD = dict(keys=0, k=1, temp=1.0, min_p=0.0, top_p=np.inf, greedy=False)

    def __init__(self, size: int, width: int, device: torch.device):
        self.size, self.width = size, width
        p = self.PAD
        # int64 parts first (ids first: copy_in leaves them), then int32, float32 and bool ones
        # (aligned views), the block table last and 16-byte aligned. Padding values from the start.
        self.host = dict(ids=np.zeros((1, size), np.int64), pos=np.zeros((1, size), np.int64),
                         slots=np.full(size, -1, np.int64), keys=np.full(size, p["keys"], np.int64),
                         k=np.full(size, p["k"], np.int64), lens=np.zeros(size, np.int32),
                         cols=np.zeros(1, np.int32), parity=np.zeros(1, np.int32),
                         temp=np.full(size, p["temp"], np.float32), min_p=np.full(size, p["min_p"], np.float32),
                         top_p=np.full(size, p["top_p"], np.float32), greedy=np.full(size, p["greedy"], np.bool_))
        parts = sum(a.nbytes for a in self.host.values())
        head = -(-parts // 16) * 16  # bytes before the table
        self.host["table"] = np.zeros((size, width), np.int32)
        cuda = device.type == "cuda"
        self.pinned = torch.zeros(head + self.host["table"].nbytes, dtype=torch.uint8, pin_memory=cuda)
        self._parts, self._pinned = parts, self.pinned.numpy()
        self._write_parts()
        self.buffer = self.pinned.to(device, copy=True)
        at, self._at = 0, {}
        for name, a in self.host.items():
            at = head if name == "table" else at
            self._at[name] = at
            setattr(self, name, self.buffer[at:at + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape))
            at += a.nbytes
        self._src, self._dst = self.pinned.view(torch.int32), self.buffer.view(torch.int32)
        self._rows = self._cols = 0  # the table's rows and columns that may hold block ids
        self.drawn = torch.zeros(2, size, 2, dtype=torch.float64, pin_memory=cuda)
        self.consumed = torch.cuda.Event(external=True) if cuda else None

    def _write_parts(self) -> None:
        np.concatenate([a.reshape(-1).view(np.uint8) for n, a in self.host.items() if n != "table"],
                       out=self._pinned[:self._parts])

    def fill(self, batch, ids: torch.Tensor | None = None, draw=None) -> None:
        """Writes ``batch`` (decode-only, at most ``size`` rows) for the next graph, the rest padding.
        ``ids`` [B] on the device: input ids that replace ``batch.input_ids`` (a step run ahead; where
        they are these inputs' own ``ids``, written by the last graph's draw, they stay). ``draw``: the
        rows' ``(SampleSettings, noise keys [B])`` for the graph's draw, or None (the padding's
        values: the graph's draw is not used). The device gets them in the graph (:meth:`copy_in`),
        the input ids now where they are not its own. Each fill must be read in before the next
        (the table's columns and rows to clear are counted from the last fill's): where no graph
        runs on it, the caller runs :meth:`copy_in` and :meth:`consumed_here` itself."""
        if self.consumed is not None:
            self.consumed.synchronize()  # (the last graph has read what the last fill wrote)
        b = len(batch.seqs)
        h = self.host
        h["ids"][0, :b], h["ids"][0, b:] = batch.input_ids, 0
        h["pos"][0, :b], h["pos"][0, b:] = batch.positions, 0
        h["slots"][:b], h["slots"][b:] = batch.slot_mapping, -1
        # the table's used columns, and zeros over those the last step used
        cols = batch.block_tables.shape[1]
        t, c = h["table"], max(cols, self._cols)
        t[:b, :cols], t[:b, cols:c], t[b:max(b, self._rows), :c] = batch.block_tables, 0, 0
        self._rows, self._cols = b, cols
        h["lens"][:b], h["lens"][b:] = batch.seq_lens, 0
        st, keys = draw if draw is not None else (None, None)
        for name, pad in self.PAD.items():
            h[name][:b] = pad if st is None else keys if name == "keys" else getattr(st, name)
            h[name][b:] = pad
        h["cols"][0], h["parity"][0] = c, 1 - h["parity"][0]
        self._write_parts()
        at = self._at["table"]
        self._pinned[at:at + 4 * self.size * c].view(np.int32).reshape(self.size, c)[...] = t[:, :c]
        if ids is not None and ids.data_ptr() == self.ids.data_ptr():
            return
        self.ids.copy_(self.pinned[:self.ids.nbytes].view(torch.int64).view(1, -1), non_blocking=True)
        if ids is not None:
            self.ids[0, :b].copy_(ids)

    @property
    def half(self) -> int:
        """The half of ``drawn`` the last fill's graph writes."""
        return int(self.host["parity"][0])

    def copy_in(self) -> None:
        """The last fill's values (the input ids aside) into the device buffer: a graph's first step."""
        head, end, table = self.ids.nbytes // 4, -(-self._parts // 4), self._at["table"] // 4
        if self.buffer.is_cuda:
            stage.copy_in(self._src, self._dst, head, end, table, self.size, self.width, self._at["cols"] // 4)
            return
        self._dst[head:end] = self._src[head:end]
        c = int(self._src[self._at["cols"] // 4])
        self.table[:, :c] = self._src[table:table + self.size * c].view(self.size, c)

    def consumed_here(self) -> None:
        """Marks the point of a graph (or eager run) after which :meth:`fill` may write again."""
        if self.consumed is not None:
            self.consumed.record()

    def publish(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """A graph's draw: ``tokens`` [size] int64 into ``ids`` (the next step's input ids, in place),
        and with ``logprobs`` [size] into ``drawn``'s half ``parity`` (what the host reads)."""
        if self.buffer.is_cuda:
            stage.publish(tokens, logprobs, self.ids[0], self.parity, self.drawn)
            return
        self.ids[0].copy_(tokens)
        half = self.drawn[int(self.parity[0])]
        half[:, 0].copy_(tokens)
        half[:, 1].copy_(logprobs)

    @contextlib.contextmanager
    def ids_kept(self):
        """Leaves ``ids`` as it finds them: a warm-up run's draw writes its tokens there, and the step's
        own run follows it."""
        saved = self.ids.clone()
        yield
        self.ids.copy_(saved)
