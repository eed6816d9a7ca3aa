"""Per-step attention metadata for vLLM: built once per step by vLLM's runner, read by every layer.

vLLM orders a batch decodes first (``reorder_batch_threshold = 1``). The decode rows run
``pb.paged_decode`` with a ``DecodePlan``, or ``pb.cascade_decode`` with a ``CascadePlan`` when
rows share leading blocks (vLLM 0.33 finds no shared prefixes itself: ``common_prefix_len`` is
always 0); the other rows run ``pb.paged_prefill``. ``build`` makes the step's plan on the host,
once, for all the layers it serves, from ``seq_lens_cpu_upper_bound`` (the kernels clamp each
request by its device length, so an upper bound is exact).

A decode plan is refilled in place (``plan.update``) while the batch size stays; the plans of
batches a full CUDA graph may replay are kept per batch size (vLLM pads those to its captured
sizes), so their buffers stay where the graph reads them (``UNIFORM_SINGLE_TOKEN_DECODE``). Eager
steps keep one plan: their batch sizes change step by step, and a plan per size would hold a
workspace per size. Decode-only batches a full CUDA graph may replay (full decode graphs on, the
batch within the captured sizes) are planned into a fixed cascade arena (``CascadeArena.for_graphs``,
one per window for every size): every plan of a batch size launches the same kernels with the same
arguments whatever its forest, so vLLM's one graph per size replays cascade steps, and steps that
share nothing (and vLLM's capture runs) as tails only on the same kernels. That needs the rows'
request slots (Model Runner V2; its padding rows, last, have none and get length 0); with Model
Runner V1, or ``PAGED_BACKEND_GRAPH_CASCADE=0``, such batches take the flat decode plan of their size.
A cascade plan needs the block table on the host, which vLLM's metadata does not carry. Where the
metadata names each row's request slot (``req_idx``: Model Runner V2, vLLM 0.33's default on GPUs) and
which rows are still prefilling (``is_prefilling`` on the host) the plan takes the rows as the last
step that ran each request left them, copied back without a sync (:mod:`.host_tables`; every build
queues its table's copy; not with micro-batching, where each micro-batch has a builder of its own,
nor with a KV connector, which may prefill a request elsewhere); elsewhere eager steps with two or more
decode rows copy the table's first column from the device (a sync), and the whole table only when
some rows share a first block (costs measured in docs/vllm.md). The plan starts from the last step's
forest (``CascadePlanner``, rows known by their slots, else by their place in the batch) where that
forest still holds in the table - a reused node is checked on the table (each member still holds its
last block: a block held at one place by two rows has one prefix, vLLM's prefix cache chains them)
and the step is planned anew where one does not.
``PAGED_BACKEND_CASCADE=0`` turns cascade off. Layers with a sliding window get plans of their
window (one per distinct window among the builder's layers: vLLM gives sliding-window layers KV
cache groups, and builders, of their own).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

import paged_backend as pb
from paged_backend.cascade import CascadeArena, CascadeCost
from paged_backend.cascade.planner import CascadePlanner
from paged_backend.kernels.checks import debug_enabled

from .host_tables import HostTables


@dataclass
class PagedAttentionMetadata:
    """One step. Rows ``[0, num_decodes)`` are decodes (one token each), the rest prefill rows.

    Device: ``seq_lens [B]``, ``block_table [B, M]``, ``prefill_query_start_loc [num_prefills + 1]``
    (0 at the first prefill token). Host: ``prefill_query_start_loc_host`` (the same).
    ``plans``: the decode rows' ``DecodePlan`` or ``CascadePlan`` per sliding window of the layers
    (None: full attention); empty without decode rows.
    """
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    prefill_query_start_loc: torch.Tensor | None
    prefill_query_start_loc_host: np.ndarray | None
    plans: dict


def _layer_shape(vllm_config, layer_names: list[str]) -> tuple[int, tuple]:
    """The query heads of the builder's layers (per rank: plans are made per head count) and their
    sliding windows (None: full attention), one plan per window."""
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    heads = {layer.num_heads for layer in layers.values()}
    if len(heads) != 1:
        raise ValueError(f"layer_names {layer_names} must name registered Attention layers with one query-head "
                         f"count, found {sorted(heads) or 'none'}")
    windows = {layer.impl.window for layer in layers.values()}
    return heads.pop(), tuple(sorted(windows, key=lambda w: -1 if w is None else w))


class PagedMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        num_q_heads, self.windows = _layer_shape(vllm_config, layer_names)
        self.shape = dict(num_q_heads=num_q_heads, num_kv_heads=kv_cache_spec.num_kv_heads,
                          head_dim=kv_cache_spec.head_size, block_size=kv_cache_spec.block_size, device=device)
        # the cascade cost model counts the cache's bytes (fp8: 1 a value, and no Hopper kernel lists)
        self.cascade_cost = CascadeCost(kv_elem_bytes=kv_cache_spec.dtype.itemsize)
        self.kv_dtype = kv_cache_spec.dtype  # (fp8 plans take more programs on Hopper: pb.plan_decode)
        # A cascade plan attends the lengths it was made for (a DecodePlan's kernels clamp by the
        # device lengths): under speculative decoding vLLM's host lengths are only upper bounds.
        self.cascade = os.environ.get("PAGED_BACKEND_CASCADE", "1") != "0" and vllm_config.speculative_config is None
        comp = vllm_config.compilation_config
        full_decode = (comp.cudagraph_mode or CUDAGraphMode.NONE).decode_mode() == CUDAGraphMode.FULL
        # decode-only batches of up to this many rows may replay a full graph: flat plans only
        self.graph_rows = (comp.max_cudagraph_capture_size or 0) if full_decode else 0
        self._graph_plans: dict[tuple, pb.DecodePlan] = {}  # per (captured batch size, window)
        # cascade inside full decode graphs: Model Runner V2 names the rows' request slots (see the module doc)
        self.graph_cascade = (self.cascade and self.graph_rows > 0 and vllm_config.use_v2_model_runner
                              and os.environ.get("PAGED_BACKEND_GRAPH_CASCADE", "1") != "0")
        self._graph_arenas: dict = {}  # per window: the fixed CascadeArena of every captured size
        self._graph_tails = False  # whether the planner's last plans are a graph step's tails only
        self._eager_plans: dict = {}  # per window
        self.planner = CascadePlanner(self.windows, **self.shape)
        # the rows of the steps before, by request slot (req_idx); not with vLLM's micro-batches, whose
        # builders each see some of the requests (a slot's new request may prefill in the other's), nor
        # with a KV connector (a request's prompt may be prefilled elsewhere: it never runs a step here
        # still prefilling)
        self.host_tables = (None if vllm_config.parallel_config.use_ubatching or vllm_config.kv_transfer_config
                            is not None else HostTables())
        self.plans_made = 0  # steps planned (tests: one per step, whatever the number of layers)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedAttentionMetadata:
        cm = common_attn_metadata
        nd, npf, ndt, _ = split_decodes_and_prefills(cm, decode_threshold=1)
        b = cm.num_reqs
        lens = cm.seq_lens_cpu_upper_bound
        if lens is None:  # a runner that gives no host bound: one device-to-host copy
            lens = cm.seq_lens[:b].cpu()
        lens = np.asarray(lens[:b], dtype=np.int64)
        pqsl = pqsl_host = None
        if npf:
            pqsl = cm.query_start_loc[nd:b + 1] - ndt
            pqsl_host = cm.query_start_loc_cpu[nd:b + 1].numpy() - ndt
        block_table = cm.block_table_tensor[:b]
        slots = self._slots(cm.req_idx, b, block_table)
        graphable = npf == 0 and nd <= self.graph_rows
        # the decode rows with a request slot: all of them, or in a full graph's padded batch those
        # before its padding rows
        real = nd if slots is None or not graphable else min(slots.size, nd)
        fresh = None  # [real] decode rows still prefilling (a cached prompt's last token): their first step
        pre = cm.is_prefilling
        if slots is not None and slots.size >= real and pre is not None and not pre.is_cuda and pre.numel() >= real:
            fresh = pre[:real].numpy().astype(bool)
        row_slots = None if fresh is None else slots[:real]
        if not nd:
            plans = {}
        elif graphable and self.graph_cascade:
            plans = self._graph_cascade_plans(block_table[:nd], lens[:nd], row_slots, fresh)
        else:
            plans = self._plans(block_table[:nd], lens[:nd], graphable=graphable, slots=row_slots, fresh=fresh)
        if slots is not None:  # (after the plan: it takes the steps before this one's)
            n = slots.size
            self.host_tables.send(block_table[:n], slots, -(-lens[:n] // self.shape["block_size"]))
        return PagedAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, num_decodes=nd, num_decode_tokens=ndt, num_prefills=npf,
            seq_lens=cm.seq_lens[:b], block_table=block_table, prefill_query_start_loc=pqsl,
            prefill_query_start_loc_host=pqsl_host, plans=plans)

    def _slots(self, req_idx, b: int, block_table: torch.Tensor) -> np.ndarray | None:
        """The request slots of the rows that have one (vLLM's padding rows of a full CUDA graph,
        last, have none) where the metadata gives them and cascade may run (not inside a CUDA graph
        capture: a copy queued there would be captured), else None."""
        if not self.cascade or req_idx is None or self.host_tables is None:
            return None
        if block_table.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return np.asarray(req_idx[:b], dtype=np.int64)

    def _plans(self, block_table: torch.Tensor, lens: np.ndarray, graphable: bool, slots=None, fresh=None) -> dict:
        """Per window: a CascadePlan when decode rows share leading full blocks (and no graph may
        replay the step), else a DecodePlan of this batch size refilled for ``lens``. ``slots [B]``:
        the rows' request slots (the host table from the steps before), or None; ``fresh [B]``: rows
        whose request may be new in its slot (still prefilling), which then share nothing."""
        self.plans_made += 1
        self._graph_tails = False
        nd = lens.size
        table = held = None
        if self.cascade and nd >= 2 and not graphable:
            if slots is not None:  # the rows as the steps before left them: no sync (see the module doc)
                table, blocks = self._slot_rows(slots, fresh, block_table, lens)
                held = blocks * self.shape["block_size"]
            else:
                table = _table_from_device(block_table)
        if table is None:
            self.planner.reset()
        else:
            ids = np.arange(nd) if slots is None else slots
            cplans = self.planner.plans(table, lens, ids, block_table, self.cascade_cost, checked=True, host_lens=held)
        plans = {}
        for w in self.windows:
            if table is not None and not cplans[w].is_flat:
                plans[w] = cplans[w]
                continue
            plan = self._graph_plans.get((nd, w)) if graphable else self._eager_plans.get(w)
            if plan is not None and plan.batch_size == nd:
                plans[w] = plan.update(lens)
                continue
            plan = plans[w] = pb.plan_decode(lens, window=w, kv_dtype=self.kv_dtype, **self.shape)
            if graphable:
                self._graph_plans[nd, w] = plan
            else:
                self._eager_plans[w] = plan
        return plans

    def _graph_cascade_plans(self, block_table: torch.Tensor, lens: np.ndarray, slots, fresh) -> dict:
        """Per window: a plan of the batch in the window's fixed arena (a step a full CUDA graph may
        replay, see the module doc). ``slots [R]``: the request slots of the first ``R`` rows, the rest
        vLLM's padding rows (length 0); ``fresh [R]``: as in :meth:`_plans`; None for both where the
        metadata names no slots: every row as its host length says, tails only. (vLLM's capture runs
        name slots 0.. for rows of one token: nothing held on the host, tails only too.)
        Steps that share nothing plan as tails only with the last such step carried over (its pieces
        copied while only the tails' ends move), as a forest is."""
        self.plans_made += 1
        nd, bs = lens.size, self.shape["block_size"]
        n = nd if slots is None else slots.size  # rows with a request
        if slots is None:  # (a length past the table would read past it: clamped)
            lens = np.minimum(lens, block_table.shape[1] * bs)
            ids = np.arange(nd)
        else:  # padding rows: length 0, ids of their own
            lens = np.where(np.arange(nd) < n, lens, 0)
            ids = np.concatenate([slots, -1 - np.arange(nd - n)])
        table = None
        if slots is not None and n >= 2:
            table, blocks = self._slot_rows(slots, fresh, block_table[:n], lens)
        tails = table is None
        if tails != self._graph_tails:  # (a tails-only step's empty forest is not carried into one sharing)
            self.planner.reset()
            self._graph_tails = tails
        if tails:  # no block known on the host: nothing shared, no table read
            table = np.broadcast_to(np.zeros(1, np.int32), (nd, max(1, -(-int(lens.max(initial=0)) // bs))))
            held = np.zeros(nd, np.int64)
        else:
            held = blocks * bs
            if nd > n:  # (padding rows: no blocks held)
                table = np.concatenate([table, np.zeros((nd - n, table.shape[1]), table.dtype)])
                held = np.concatenate([held, np.zeros(nd - n, held.dtype)])
        arenas = {w: self._graph_arena(w) for w in self.windows}
        return self.planner.plans(table, lens, ids, block_table, self.cascade_cost, arenas=arenas, checked=True,
                                  host_lens=held)

    def _slot_rows(self, slots: np.ndarray, fresh, block_table: torch.Tensor, lens: np.ndarray):
        """The host table of the rows of request ``slots [R]`` as the steps before left them -> (table
        [R, cols], or None where the rows share no first block; blocks [R] each row holds there, 0 for
        ``fresh`` rows). ``block_table``: the rows' device table (checked under PAGED_BACKEND_DEBUG=1)."""
        table, blocks = self.host_tables.take(slots, -(-int(lens.max()) // self.shape["block_size"]))
        blocks[fresh] = 0  # (its slot's row may be the last request's)
        if debug_enabled():
            _check_held(table, blocks, block_table, slots)
        return (None if _distinct(table[blocks > 0, 0]) else table), blocks

    def _graph_arena(self, window) -> CascadeArena:
        arena = self._graph_arenas.get(window)
        if arena is None:
            sh = self.shape
            arena = self._graph_arenas[window] = CascadeArena.for_graphs(
                self.graph_rows, num_q_heads=sh["num_q_heads"], num_kv_heads=sh["num_kv_heads"],
                head_dim=sh["head_dim"], device=sh["device"])
        return arena


def _distinct(first_blocks: np.ndarray) -> bool:
    """Whether the rows' first blocks all differ: rows that share no first block share nothing."""
    return np.unique(first_blocks).size == first_blocks.size


def _table_from_device(block_table: torch.Tensor) -> np.ndarray | None:
    """The decode rows' table copied from the device - a sync each copy: first the first column (None
    where the rows share no first block), then the table."""
    if _distinct(block_table[:, 0].cpu().numpy()):
        return None
    return block_table.cpu().numpy()


def _check_held(table: np.ndarray, blocks: np.ndarray, block_table: torch.Tensor, slots: np.ndarray) -> None:
    """``PAGED_BACKEND_DEBUG=1``: the blocks the host rows hold are the device table's (a sync), else
    ``RuntimeError`` naming the first row's slot that differs (vLLM rewrote a running request's blocks).
    Null blocks on the device are no request's (a dummy batch's rows): not compared."""
    dev = block_table[:, :table.shape[1]].cpu().numpy()
    held = np.arange(table.shape[1])[None, :] < blocks[:, None]
    bad = ((dev != table) & held & (dev != 0)).any(axis=1).nonzero()[0]
    if bad.size:
        i = int(bad[0])
        raise RuntimeError(f"the host copy of request slot {int(slots[i])}'s blocks differs from vLLM's block table "
                           f"(row {i}): its blocks changed without a prefill step between (docs/vllm.md)")
