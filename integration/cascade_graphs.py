"""CUDA graphs of the engine's cascade decode steps: a whole step, attention included, one replay.

A cascade step's plan is made on the host each step (the forest carried over, the tails' pieces
and merge lists anew), but its kernels read all of it from device buffers. Planned into a
:class:`~paged_backend.cascade.CascadeArena` (buffers at fixed addresses) with the block table at a
fixed address, two steps' plans whose ``launch_key()`` agree launch identical kernels with identical
arguments: one graph of the model's forward, captured with the first, replays the second, whose plan
its first kernels read in from pinned memory with the inputs (:mod:`.static_inputs`). So a cascade
step is planned, sent and replayed like a flat one (:mod:`.graphs`), with no Python between layers.

For each padded batch size (as :func:`graphs.padded_size`) there are static inputs, one arena per
sliding window and the graphs of the launch keys seen so far (with the draw's ``SampleMode``): a
key holds grids, tiles and which launches run, not the piece counts nor the merge lists' lengths
(the fold's tile is the arena's), so it changes when a forest gains or loses its nodes altogether or
its node tile changes, rarely; the graphs outlive a ``generate`` call. A new key captures its graph
then (an eager warm-up on the step's own inputs, whose KV writes the replay repeats with the same
values, then the capture and the replay); a plan that outgrows its arena grows it, dropping that
size's graphs. Padding rows have length 0 (no node, no
tail: attention gives 0), slot -1 and token 0; their logits are dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_backend.cascade import CascadeArena

from .graphs import StaticInputs, capture, padded_size, step_forward, step_outputs
from .sampler import SampleMode
from .step import CASCADE, Step

# graphs kept per padded size (each holds its launch key's kernels; the oldest is dropped first)
MAX_GRAPHS_PER_SIZE = 8


class CascadeGraphs:
    """The captured cascade decode steps of one engine, made on first use of each (size, launch key).

    ``builder``: the engine's StepBuilder (it plans, carrying forests over between steps). ``sample``:
    as ``DecodeGraphs``' (``Sampler.sample``, run in each graph after the model), or None."""

    def __init__(self, model, cache, builder, *, max_num_seqs: int, max_model_len: int, capture: bool = True,
                 sample=None):
        self.model, self.cache, self.builder, self.capture, self.sample = model, cache, builder, capture, sample
        self.max_size = padded_size(max_num_seqs)
        self.width = -(-max_model_len // cache.spec.block_size)
        self.max_model_len = max_model_len
        self.inputs: dict[int, StaticInputs] = {}
        self.arenas: dict[tuple, CascadeArena] = {}      # (size, window) -> arena
        self.graphs: dict[int, dict[tuple, _CascadeGraph]] = {}  # size -> launch keys -> graph
        self.captures = 0  # graphs captured so far
        self.pool = None

    def reset(self) -> None:
        """Drops every graph (as ``DecodeGraphs.reset``), its static inputs and arenas."""
        self.graphs.clear()
        self.inputs.clear()
        self.arenas.clear()
        self.pool = None

    def run(self, batch, ids: torch.Tensor | None = None, mark=None, draw=None):
        """(logits [B, V], the drawn ``Sampled`` [B] or None) of a decode-only ``batch`` whose
        rows share blocks, run as a cascade in a graph; None where it cannot (the caller runs the step
        otherwise): more rows than captured, a table wider than ``max_model_len`` allows, or a plan of
        some window kept no node (the flat graph runs it). ``ids`` [B] int64 on the device: the input
        ids of a step run ahead. ``mark``: called once the step is planned, just before its graph
        runs (profiling), or None. ``draw``: the rows' (SampleSettings, keys) for the graph's draw
        (``StaticInputs.fill``), or None."""
        b = len(batch.seqs)
        if b > self.max_size or batch.block_tables.shape[1] > self.width:
            return None
        size = padded_size(b)
        inp = self.inputs.get(size)
        if inp is None:
            inp = self.inputs[size] = StaticInputs(size, self.width, self.cache.spec.device)
        draw = draw if self.sample is not None else None
        inp.fill(batch, ids, draw)
        plans = self._plan(batch, inp)
        if any(p.is_flat for p in plans.values()):
            inp.copy_in()  # (no graph reads these inputs in: the device keeps what the host last wrote)
            inp.consumed_here()
            return None
        mode = SampleMode() if draw is None else draw[0].mode  # (fixed by the graph too)
        key = (mode, *((w, p.launch_key()) for w, p in plans.items()))
        if mark is not None:
            mark()
        graphs = self.graphs.setdefault(size, {})
        g = graphs.get(key)
        if g is None:
            if len(graphs) >= MAX_GRAPHS_PER_SIZE:
                graphs.pop(next(iter(graphs)))
            if self.pool is None and self.capture:
                self.pool = torch.cuda.graph_pool_handle()
            g = graphs[key] = _CascadeGraph(self.model, self.cache, inp, plans, self.max_model_len, self.pool,
                                            self.capture, self.sample, mode)
            self.captures += 1
        else:
            with torch.inference_mode():
                g.replay()
        return step_outputs(g.out, inp, b, draw is not None)

    def _plan(self, batch, inp: StaticInputs) -> dict:
        """The step's cascade plans on the padded rows, in the size's arenas (grown where a plan does
        not fit: the size's graphs are dropped, they read the old arena)."""
        b, size = len(batch.seqs), inp.size
        table = inp.host["table"][:, :batch.block_tables.shape[1]].copy()  # [size, cols] (the plan may keep it)
        lens = inp.host["lens"].astype(np.int64)
        ids = np.concatenate([batch.seq_ids, -1 - np.arange(size - b)])  # (padding rows: ids of their own)
        arenas = {w: self.arenas.get((size, w)) for w in self.builder.windows}
        plans = self.builder.cascade_plans(table, lens, ids, inp.table, arenas)
        grow = [w for w, p in plans.items() if p.arena is None and not p.is_flat]
        if not grow:
            return plans
        for w in grow:
            arena = self.arenas[size, w] = CascadeArena.grown_for(plans[w], arenas[w])
            arena.read_in_graph(inp.consumed)  # (the graphs read their plans in: static_inputs.py)
        self.graphs.pop(size, None)
        return self.builder.cascade_plans(table, lens, ids, inp.table,
                                          {w: self.arenas.get((size, w)) for w in self.builder.windows})


class _CascadeGraph:
    """The forward of one padded size and launch key (and ``sample``, ``mode``: as in ``graphs.step_forward``),
    captured with the step that first had them (and run for it: ``out``). Without ``capture_it`` each
    replay runs the forward eagerly with the capture-time plans, whose buffers (the arenas) hold the
    step's plans as in a replay: under the Triton interpreter this tests the plumbing on the CPU."""

    def __init__(self, model, cache, inp: StaticInputs, plans: dict, max_seq_len: int, pool, capture_it: bool,
                 sample=None, mode=None):
        rows = torch.arange(inp.size, device=inp.ids.device)
        # (kept: the graph reads every tensor the step holds - rows, the plans' buffers - at their addresses)
        self.step = step = Step(cache, inp.ids, inp.pos, inp.slots, inp.table, inp.lens, None, rows, CASCADE,
                                max_seq_len, plans=plans)
        run = step_forward(model, inp, step, sample, mode, arenas=[p.arena for p in plans.values()])
        if not capture_it:
            self.replay = lambda: setattr(self, "out", run())
            with torch.inference_mode():
                self.replay()
            return
        # one warm-up: the step's own inputs (its KV writes are the replay's), kernels compiled
        with inp.ids_kept():
            graph, self.out = capture(run, pool, inp.ids.device, warmups=1)  # (logits [size, V], Sampled or None)
        self.replay = graph.replay
        graph.replay()
