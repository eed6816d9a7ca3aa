"""Python's cyclic garbage collector paused while the engine's step loop runs.

Why: a collection is host time on the step loop's critical path, and a full one walks every object
Python tracks - the model's, torch's, and each sample's token list (64 samples of a 32K prompt: two
million list entries). H200, Llama-3-8B shape (16 layers), bench_e2e's timed call, 2026-11-29: at
32K x 64 x 64 the run's last step took 15.8-22.4 ms with the collector on against 6.8 ms with it
off (decode 14,467-14,710 -> 15,319 tok/s); at 4K x 64 x 256 a collection mid-run left the GPU idle
for 1.4 ms (`benchmarks/results/sweeps/e2e_gc_pause_h200.log`).

Cyclic garbage made meanwhile (a finished request's sequences and its group refer to each other)
is collected afterwards, as the collector's thresholds decide. The caller's own code between two
outputs (``generate_iter``'s yields) runs with the collector as the caller had it.
"""
from __future__ import annotations

import contextlib
import gc


class PausedCollector:
    """Made: the collector off (as it was: ``restore``); ``with paused.resumed(): yield x`` gives it
    back to the caller around a yield."""

    def __init__(self):
        self.was = gc.isenabled()
        gc.disable()

    def restore(self) -> None:
        if self.was:
            gc.enable()

    @contextlib.contextmanager
    def resumed(self):
        self.restore()
        try:
            yield
        finally:
            self.was = gc.isenabled()  # (the caller may have switched it meanwhile)
            gc.disable()
