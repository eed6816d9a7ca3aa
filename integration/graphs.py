"""CUDA graphs of the engine's flat decode steps.

An eager decode step of a transformers model costs the host a few hundred kernel launches (tens of
milliseconds for a 30-layer model), far above the GPU's work. A decode step whose attention is
``pb.paged_decode`` with a ``DecodePlan`` replays instead: the model's forward for a batch padded
to a captured size (1, 2, 4, 8, 16, 32, 64, then multiples of 64) is captured once, reading fixed
device buffers; each step writes its metadata into pinned memory, which the graph's first kernel
reads into them (:mod:`.static_inputs`), refills the plan's buffers with ``plan.update`` and
replays. Padding rows have length 0 (attention gives 0), slot -1 (nothing is written) and token 0;
their logits are dropped.

A graph also draws the step's tokens (``sample``: ``Sampler.sample``, the whole draw on the device)
from sampling settings and noise keys that come in with the inputs: a decode step calls no sampler
from the host and uploads nothing of its own (H200, SmolLM2 shape, temperature-only rows: host
1.0-1.14 -> 0.79 ms a step). The draw's steps depend on the batch's settings (``SampleMode``: greedy
rows, min-p, top-k, top-p, log-probabilities): a size keeps one graph per mode seen, the default
one captured first; a step whose rows fork (a prompt's last step drawing its n samples) replays that
one and draws with the sampler after it. The draw's tokens and log-probabilities go to pinned
memory from the graph's last kernel.

Cascade steps replay graphs of their own, whose plans live in fixed buffers (:mod:`.cascade_graphs`).
So on a GPU a decode step whose samples share a prompt runs either flat (reading the shared KV once
per sample) or as a cascade (reading it once, with a plan made on the host each step):
:class:`.path_choice.PathChoice` picks by the steps' measured times.
"""
from __future__ import annotations

import numpy as np
import torch

import paged_backend as pb

from .sampler import SampleMode, Sampled
from .static_inputs import StaticInputs
from .step import DECODE, Step


def padded_size(batch: int) -> int:
    """The captured batch size a decode step of ``batch`` rows runs in."""
    if batch <= 64:
        return 1 << max(0, (batch - 1).bit_length())
    return -(-batch // 64) * 64


def padded_sizes(max_num_seqs: int) -> list[int]:
    """Every padded size a step of at most ``max_num_seqs`` rows can run in, largest first (so the
    smaller graphs of a shared memory pool reuse the largest one's blocks)."""
    top = padded_size(max_num_seqs)
    return [s for s in sorted({padded_size(b) for b in range(1, min(top, 64) + 1)} | set(range(128, top + 1, 64)),
                              reverse=True) if s <= top]


def capture(run, pool, device: torch.device, warmups: int = 2):
    """``run()`` (a model's forward, returning a tensor) captured as a CUDA graph in memory ``pool``,
    after ``warmups`` eager runs on a side stream (kernels compiled, plans' launches bound, libraries'
    workspaces made, the allocator settled) -> (graph, the output, rewritten by every replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(warmups):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
        out = run()
    return graph, out


def step_forward(model, inp: StaticInputs, step, sample=None, mode=None, arenas=()):
    """The forward a decode step's graph holds, on ``inp``'s buffers, every row's logits kept
    (``logits_to_keep=0``: the last hidden states as they are, where a tensor of row indices
    gathered them first) -> a callable giving ``(logits [size, V], Sampled [size] or None)``. It
    starts with the step's inputs read in (:meth:`StaticInputs.copy_in`, then each of ``arenas``'
    cascade plans); with ``sample`` (``Sampler.sample``) every row is drawn in the same graph by
    ``mode`` (a ``SampleMode``) at its settings and key in ``inp`` (a step whose rows draw
    otherwise ignores them), its tokens written into ``inp.ids`` and, with their
    log-probabilities, ``inp.drawn`` (:meth:`StaticInputs.publish`)."""
    def run():
        inp.copy_in()
        for arena in arenas:
            arena.copy_in()
        inp.consumed_here()
        logits = model(input_ids=inp.ids, position_ids=inp.pos, use_cache=False, logits_to_keep=0,
                       paged_step=step).logits[0]
        if sample is None:
            return logits, None
        s = sample(logits, mode, inp.k, inp.temp, inp.min_p, inp.top_p, inp.greedy, inp.keys)
        inp.publish(s.tokens, s.logprobs)  # (the embedding read the ids at the start: the next step's, in place)
        return logits, s
    return run


def step_outputs(out: tuple, inp: StaticInputs, b: int, drawn: bool):
    """A graph's outputs (:func:`step_forward`) on ``inp`` for a batch of ``b`` rows -> (logits [b, V],
    the ``Sampled`` of its rows where the graph drew them for the batch (``drawn``), else None). The
    tokens are a view of ``inp.ids`` and ``packed`` of the half of ``inp.drawn`` the step's graph
    wrote, not of the graph's outputs: they outlive the step (the next one's input ids), and a view
    of the graph's memory pool would keep it in use after the graph is dropped (torch then fails the
    next capture into that pool)."""
    logits, s = out
    if not drawn or s is None:
        return logits[:b], None
    top = (None, None) if s.top_ids is None else (s.top_ids[:b], s.top_logprobs[:b])
    return logits[:b], Sampled(inp.ids[0, :b], s.logprobs[:b], *top, packed=inp.drawn[inp.half, :b])


class _Graph:
    """The captured decode steps of ``size`` rows: static inputs, plans, and one graph (and its outputs)
    per ``SampleMode`` drawn so far (``sample``: as in :func:`step_forward`; None: graphs without
    a draw, one per size)."""

    def __init__(self, model, cache, size: int, width: int, num_q_heads: int, max_seq_len: int, pool,
                 capture_it: bool = True, windows=(None,), sample=None):
        spec, dev = cache.spec, cache.spec.device
        self.model, self.pool, self.capture_it, self.sample = model, pool, capture_it, sample
        self.size, self.width = size, width
        self.inputs = StaticInputs(size, width, dev)
        self.plans = {w: pb.plan_decode(np.zeros(size, np.int64), num_q_heads=num_q_heads,
                                        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                        block_size=spec.block_size, device=dev, window=w, kv_dtype=spec.dtype)
                      for w in windows}
        self.rows = torch.arange(size, device=dev)
        self.step = Step(cache, self.inputs.ids, self.inputs.pos, self.inputs.slots, self.inputs.table,
                         self.inputs.lens, None, self.rows, DECODE, max_seq_len, plans=self.plans)
        self.modes: dict = {}  # mode -> (replay, outputs), the default mode's first
        self.mode(SampleMode())

    def mode(self, mode: SampleMode) -> list:
        """[replay, outputs] of the graph drawing by ``mode`` (the default mode's without ``sample``),
        captured now if it was not yet."""
        if self.sample is None:
            mode = SampleMode()
        got = self.modes.get(mode)
        if got is not None:
            return got
        run = step_forward(self.model, self.inputs, self.step, self.sample, mode)
        if self.capture_it:
            with self.inputs.ids_kept():
                graph, out = capture(run, self.pool, self.rows.device)  # (logits [size, V], Sampled or None)
            got = self.modes[mode] = [graph.replay, out]
            return got
        # the same buffers, plan and warm-up, run eagerly (the plumbing on the CPU)
        with torch.inference_mode(), self.inputs.ids_kept():
            got = self.modes[mode] = [None, run()]
        got[0] = lambda: got.__setitem__(1, run())
        return got

    def run(self, batch, ids: torch.Tensor | None = None, mark=None, draw=None):
        """Replays the step for ``batch`` (decode-only, at most ``size`` rows) -> (logits [B, V], the
        drawn ``Sampled`` [B] or None). ``ids`` [B] on the device: input ids that replace
        ``batch.input_ids`` (a step run ahead). ``mark``: called just before the replay (profiling:
        the step's start event), or None. ``draw``: the rows' (SampleSettings, keys) where the graph
        is to draw them (:meth:`StaticInputs.fill`), or None."""
        self.inputs.fill(batch, ids, draw)
        for plan in self.plans.values():
            plan.update(self.inputs.host["lens"])
        # (a new mode's warm-up runs on this step's inputs: its KV writes are the replay's)
        got = self.mode(SampleMode() if draw is None else draw[0].mode)
        if mark is not None:
            mark()
        with torch.inference_mode():
            got[0]()
        return step_outputs(got[1], self.inputs, len(batch.seqs), draw is not None)


class DecodeGraphs:
    """The captured decode steps of one engine, made on first use of each padded size (and sampling
    mode). ``sample``: ``Sampler.sample``, which each graph runs after the model (the step's draw), or
    None."""

    def __init__(self, model, cache, *, num_q_heads: int, max_num_seqs: int, max_model_len: int,
                 capture: bool = True, windows=(None,), sample=None):
        self.model, self.cache, self.num_q_heads, self.capture = model, cache, num_q_heads, capture
        self.windows = windows  # one decode plan per sliding window (None: full attention)
        self.sample = sample
        self.max_size = padded_size(max_num_seqs)
        self.width = -(-max_model_len // cache.spec.block_size)
        self.max_model_len = max_model_len
        self.graphs: dict[int, _Graph] = {}
        self.pool = None

    def reset(self) -> None:
        """Drops every graph (they read the model's weights where they lay when captured); the next
        use of a size captures it again, in a new memory pool."""
        self.graphs.clear()
        self.pool = None

    @property
    def captures(self) -> int:
        """Graphs captured so far (every size's modes)."""
        return sum(len(g.modes) for g in self.graphs.values())

    def run(self, batch, ids: torch.Tensor | None = None, mark=None, draw=None):
        """(logits [B, V], drawn or None) of a decode-only step, or None when it cannot replay (the
        caller runs it eagerly): more rows than captured, or a table wider than ``max_model_len``
        allows. ``ids``, ``mark``, ``draw``: as in ``_Graph.run``."""
        b = len(batch.seqs)
        if b > self.max_size or batch.block_tables.shape[1] > self.width:
            return None
        return self.graph(padded_size(b)).run(batch, ids, mark, draw if self.sample is not None else None)

    def graph(self, size: int) -> _Graph:
        """The step of ``size`` rows (a padded size), its default mode captured now if it was not yet."""
        g = self.graphs.get(size)
        if g is None:
            if self.pool is None and self.capture:
                self.pool = torch.cuda.graph_pool_handle()
            g = self.graphs[size] = _Graph(self.model, self.cache, size, self.width, self.num_q_heads,
                                           self.max_model_len, self.pool, self.capture, self.windows, self.sample)
        return g
