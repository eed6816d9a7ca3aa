"""Cascade or flat for a decode step whose samples share blocks, by the steps' measured times: the
engine's choice between its cascade graphs (:mod:`.cascade_graphs`) and its flat ones (:mod:`.graphs`)."""
from __future__ import annotations

from collections import deque

import numpy as np
import torch


class PathChoice:
    """Cascade or flat, for each decode step whose rows share blocks.

    The cascade's time is the median of the last :data:`WINDOW` cascade steps; the flat step's, its
    bytes (the weights and every row's KV at the copy bandwidth) times the median ratio of the flat
    graph steps' times to their bytes (1 until one ran). The first :data:`PROBES` shared steps take
    the cascade (to time it), as they do again after :data:`REPROBE_FIRST` shared steps in a row went
    flat - twice as many after each probe that kept the flat path, up to :data:`REPROBE` (a few host-
    bound cascade steps can send a run flat: on an H200, the 8B shape's rollouts of 16 prompts timed
    cascade steps at 8 ms where they take 3.8, and ran the rest of the call flat at 5.7-6 ms) - and at
    the start of each engine call (:meth:`new_run`: a cascade's time depends on the
    batch's forest, and a time of an earlier call's batch must not hold a run on the flat path; the
    call's first :data:`SETTLE` shared steps are not timed: on an H200, SmolLM2's shape, a call whose
    probes included them went flat for 128 steps at 4.8 ms, against the cascade's 3.7 ms steady). The
    choice changes path only for a gain over :data:`MARGIN`, and the step after a change is not
    timed (a cascade step after flat ones builds its forest anew); nor are steps that captured a
    graph or ran while one was captured."""

    WINDOW = 7
    PROBES = 2
    MARGIN = 1.1
    REPROBE_FIRST = 16
    REPROBE = 128
    SETTLE = 3

    def __init__(self, model, kv_bytes_per_token: int, device: torch.device):
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.kv_bytes_per_token = kv_bytes_per_token
        self.device = device
        self.bandwidth = None  # bytes/s of a device copy, measured on first use
        self.cascade_s = deque(maxlen=self.WINDOW)     # recent cascade steps, seconds
        self.flat_ratio = deque(maxlen=self.WINDOW)    # recent flat graph steps, time / bytes floor
        self.last = None  # the path of the last shared step ("cascade" or "flat")
        self.changed = False  # the last shared step changed path: its time is not noted
        self.flat_run = 0  # shared steps in a row that went flat
        self.reprobe = self.REPROBE_FIRST  # flat steps in a row after which the cascade is timed again
        self.settle = 0  # shared steps left whose time is not noted

    def new_run(self) -> None:
        """Forgets the cascade's times (an engine call starts: other prompts, another forest); the
        first :data:`SETTLE` shared steps of the call are not timed (the samples' first blocks are
        copied, the forest found, graphs of new plan shapes captured)."""
        self.cascade_s.clear()
        self.settle = self.SETTLE
        self.reprobe = self.REPROBE_FIRST

    def cascade(self, batch) -> bool:
        """Whether ``batch`` (decode-only, rows sharing blocks) should take the cascade."""
        if self.flat_run >= self.reprobe:  # time the cascade again (and wait longer for the next time)
            self.cascade_s.clear()
            self.reprobe = min(2 * self.reprobe, self.REPROBE)
        if len(self.cascade_s) < self.PROBES:
            choice = True
        else:
            casc = float(np.median(self.cascade_s))
            flat = self._flat_floor(batch) * (float(np.median(self.flat_ratio)) if self.flat_ratio else 1.0)
            choice = casc * self.MARGIN < flat if self.last == "flat" else casc < flat * self.MARGIN
            if choice:  # the cascade won on its times: a later flat spell is probed early again
                self.reprobe = self.REPROBE_FIRST
        path = "cascade" if choice else "flat"
        self.changed, self.last = self.last is not None and path != self.last, path
        self.flat_run = 0 if choice else self.flat_run + 1
        return choice

    def note_cascade(self, seconds: float) -> None:
        if not self._skip():
            self.cascade_s.append(seconds)

    def note_flat(self, seconds: float, batch) -> None:
        if not self._skip():
            self.flat_ratio.append(seconds / self._flat_floor(batch))

    def _skip(self) -> bool:
        skip, self.changed = self.changed or self.settle > 0, False
        self.settle = max(0, self.settle - 1)
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
