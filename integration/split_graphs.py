"""CUDA graphs of the engine's cascade decode steps, cut at every attention call.

A cascade step's attention cannot replay from a graph: its plan (the forest, the pieces, the
launch grids) is made for the step. The rest of the model can. For a batch padded to a captured
size (as :func:`graphs.padded_size`), the model's forward is captured once as a chain of graphs
cut at each attention call: the first runs the embeddings and layer 0 up to its attention's
inputs, the next from that attention's output through layer 1's q, k and v, ..., the last the
final norm and the logits. A step replays them in order and runs each layer's attention eagerly in
between (the new K/V written and the cascade decode, as in an eager step) on the q, k and v the
previous graph left at fixed addresses, its output copied into the buffer the next graph reads.
So a cascade step launches a graph and an attention a layer instead of every kernel of the model.

The graphs of one size share a memory pool and always replay in the order they were captured (what
sharing a pool requires). Padding rows compute on token 0 at position 0 and get no attention (their
rows of the attention output keep what an earlier step left; rows never mix); their logits are
dropped. Measured on an H100 (docs/benchmarks.md): a Llama-3-8B-shaped step of 64 samples 7.6-8.5 ms
this way against 16.2-16.3 ms all eager and 10.1 ms (4K prompt) / 31.9 ms (32K) flat in a graph.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .graphs import padded_size

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One attention call of the captured forward: the layer's arguments at their fixed addresses."""
    layer: int
    q: torch.Tensor       # [size, Hq, D], written by the graph before the call
    key: torch.Tensor     # [size, Hkv, D]
    value: torch.Tensor
    scale: float | None
    softcap: float | None
    sinks: torch.Tensor | None
    window: int | None
    out: torch.Tensor     # [size, Hq, D], read by the graph after the call


class _Cuts:
    """The attention callback (``paged_step``) of a forward that is captured: each call ends the
    running graph, notes its arguments and starts the next graph. Not capturing (the warm-up), a
    call only returns zeros."""

    def __init__(self, pool, capturing: bool):
        self.pool, self.capturing = pool, capturing
        self.graphs = [torch.cuda.CUDAGraph()] if capturing else []
        self.calls: list[_Call] = []

    def attend(self, layer: int, q, key, value, scale, softcap=None, sinks=None, window=None):
        if self.capturing:
            self.graphs[-1].capture_end()
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # (outside the graphs: the step writes it)
        self.calls.append(_Call(layer, q, key, value, scale, softcap, sinks, window, out))
        if self.capturing:
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=self.pool)
        return out


class _SplitGraph:
    """The cut forward of one padded size: its graphs, attention calls and static inputs."""

    def __init__(self, model, size: int, device: torch.device):
        self.size = size
        self.ids = torch.zeros((1, size), dtype=torch.int64, device=device)
        self.pos = torch.zeros((1, size), dtype=torch.int64, device=device)
        self.rows = torch.arange(size, device=device)  # (every input of the graphs is kept by the object)
        run = lambda cuts: model(input_ids=self.ids, position_ids=self.pos, use_cache=False,  # noqa: E731
                                 logits_to_keep=self.rows, paged_step=cuts).logits[0]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # kernels compiled, libraries' workspaces made before the capture
                run(_Cuts(None, capturing=False))
            cuts = _Cuts(torch.cuda.graph_pool_handle(), capturing=True)
            cuts.graphs[0].capture_begin(pool=cuts.pool)
            try:
                self.logits = run(cuts)  # [size, V], rewritten by every replay
            finally:
                cuts.graphs[-1].capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graphs, self.calls = cuts.graphs, cuts.calls

    def run(self, step, batch, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the cut forward for ``batch`` (at most ``size`` rows), each attention through
        ``step`` (the step's plans, cache and metadata) -> logits [B, V]. ``ids`` [B] on the
        device: input ids that replace ``batch.input_ids`` (a step run ahead), or None."""
        b = len(batch.seqs)
        # A fresh pinned buffer a step: the host may write the next step's while this copy waits
        # in the stream (async scheduling); torch's pinned cache gives it out again once copied.
        src = torch.zeros((2, self.size), dtype=torch.int64, pin_memory=self.ids.is_cuda)  # ids, positions
        host = src.numpy()
        host[0, :b], host[1, :b] = batch.input_ids, batch.positions
        self.ids.copy_(src[0:1], non_blocking=True)
        self.pos.copy_(src[1:2], non_blocking=True)
        if ids is not None:
            self.ids[0, :b].copy_(ids)
        with torch.inference_mode():
            for graph, call in zip(self.graphs, [*self.calls, None]):
                graph.replay()
                if call is not None:
                    out = step.attend(call.layer, call.q[:b], call.key[:b], call.value[:b], call.scale,
                                      softcap=call.softcap, sinks=call.sinks, window=call.window)
                    call.out[:b].copy_(out)
        return self.logits[:b]


class SplitGraphs:
    """The cut forwards of one engine's cascade steps, captured on first use of each padded size."""

    def __init__(self, model, *, max_num_seqs: int, device: torch.device):
        self.model, self.device = model, device
        self.max_size = padded_size(max_num_seqs)
        self.graphs: dict[int, _SplitGraph] = {}
        self.failed: dict[int, str] = {}  # sizes whose capture raised (their steps run eagerly), and why

    def run(self, step, batch, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, V] of a decode-only step whose attention runs through ``step``, or None when
        the batch is larger than any size captured here (the caller runs the step eagerly).
        ``ids``: as in ``_SplitGraph.run``."""
        b = len(batch.seqs)
        if b > self.max_size:
            return None
        g = self.graph(padded_size(b))
        return None if g is None else g.run(step, batch, ids)

    def graph(self, size: int) -> _SplitGraph | None:
        """The cut forward of ``size`` rows (a padded size), captured now if it was not yet; None
        if capturing it failed."""
        if size in self.failed:
            return None
        g = self.graphs.get(size)
        if g is None:
            try:
                g = self.graphs[size] = _SplitGraph(self.model, size, self.device)
            except RuntimeError as e:  # a model whose forward cannot be captured (host syncs, dynamic shapes)
                self.failed[size] = str(e).splitlines()[0]
                log.warning("cascade steps of %d rows run eagerly: capturing the model failed (%s)", size,
                            self.failed[size])
        return g

