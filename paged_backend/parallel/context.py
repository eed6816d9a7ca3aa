"""Context-parallel (sequence-sharded) paged decode, its 2-D mesh with head-parallel TP, and the
ring-attention decode baseline.

Placement (:class:`Placement`): a request's KV blocks are dealt **round-robin** over the P ranks of
the CP group: global block ``j`` (tokens ``j*BS .. j*BS+BS-1``) lives on rank ``j % P`` as that
rank's local block ``j // P`` of the request. Every rank holds at most one block more than another
(balanced at any length, so decode stays balanced as requests grow), and only the rank of the last
global block can hold a partly filled block - always its *last* local block - so a rank's shard is
an ordinary paged sequence (``block_table_local``, ``seq_lens_local``) for ``pb.paged_decode``.
Decode has no causal mask, so the order of keys does not matter. Blocks shared by several requests
(prefixes) stay shared and leading on every rank, so cascade works per rank.

Who owns new tokens: the token at position ``pos`` (0-based) is written by rank
``(pos // BS) % P`` (:meth:`Placement.owner`), into its local block ``pos // BS // P``, row
``pos % BS``; a rank allocates a new local block every ``P * BS`` tokens of a request. Every CP rank
computes q (the query is replicated); K/V of the new token are written only by its owner
(:meth:`Placement.slot_mapping` gives the others ``-1`` = skip). Then each rank decodes its shard
and :func:`tree_merge` combines the states: one small collective, independent of the context.

2-D mesh (:func:`make_mesh`): ranks ``i = cp_rank * tp + tp_rank`` (TP innermost: a TP group is
consecutive ranks, e.g. one node). TP rank ``t`` holds query heads ``[t*Hq/tp, (t+1)*Hq/tp)`` and KV
heads ``[t*Hkv/tp, ...)`` (:func:`tp_head_slices`) and runs CP over its CP group (the ranks with its
``tp_rank``); the output stays head-sharded for the row-parallel output projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

import paged_backend as pb
from paged_backend.kernels.attend import sink_states
from paged_backend.kernels.checks import FLOAT_DTYPES, check_kv_cache, check_sinks, check_tensor, debug_enabled
from paged_backend.parallel.merge_plans import CollectiveError, all_gather_flat, collective
from paged_backend.parallel.tree import get_merger, grid_groups


def _pos_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class Placement:
    """Round-robin block placement of one CP group (``world`` ranks, this ``rank``)."""
    world: int
    rank: int
    block_size: int

    def __post_init__(self):
        _pos_int("world", self.world)
        _pos_int("block_size", self.block_size)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be an int in [0, {self.world}), got {self.rank!r}")

    @classmethod
    def of(cls, group, block_size: int) -> "Placement":
        return cls(dist.get_world_size(group), dist.get_rank(group), block_size)

    def owner(self, pos):
        """Rank that holds (and writes) token ``pos`` (int, numpy array or tensor)."""
        return (pos // self.block_size) % self.world

    def local_lens(self, seq_lens):
        """Tokens of each request held by this rank (``seq_lens``: int, numpy or torch integers)."""
        bs, p, r = self.block_size, self.world, self.rank
        n_blk = (seq_lens + bs - 1) // bs
        mine = (n_blk - r + p - 1) // p  # blocks j < n_blk with j % p == r
        tail = seq_lens % bs  # the last global block is short by bs - tail
        return mine * bs - ((tail > 0) * ((n_blk - 1) % p == r)) * (bs - tail)

    def local_columns(self, max_blocks: int) -> slice:
        """Columns of a request's global block list that this rank holds, in local order."""
        return slice(self.rank, max_blocks, self.world)

    def slot_mapping(self, positions: torch.Tensor, block_table_local: torch.Tensor) -> torch.Tensor:
        """Local ``slot_mapping [B] int64`` for writing token ``positions[b]`` of request b: its slot on
        the owner, ``-1`` (skip) elsewhere. The owner's local table must already hold the block."""
        check_tensor("positions", positions, ndim=1)
        pos = positions.long()
        blk = pos // self.block_size
        col = (blk // self.world).clamp(max=block_table_local.shape[1] - 1)
        slot = block_table_local.long().gather(1, col[:, None])[:, 0] * self.block_size + pos % self.block_size
        return torch.where(blk % self.world == self.rank, slot, -1)


def shard_paged_kv(k_cache, v_cache, block_table, seq_lens, placement: Placement, num_blocks: int | None = None):
    """Copy this rank's shard out of a global paged KV (tests, benchmark checks). Returns
    ``(k_local, v_local, block_table_local int32, seq_lens_local int32)``; local caches hold
    ``num_blocks`` blocks (default: exactly the blocks used); a block shared by several requests is
    copied once and stays shared (cascade finds the same prefixes on every rank)."""
    lens = seq_lens.long().cpu()
    width = -(-block_table.shape[1] // placement.world)  # the same table width on every rank
    cols = torch.zeros(block_table.shape[0], width, dtype=torch.int64)
    mine = block_table[:, placement.local_columns(block_table.shape[1])].long().cpu()
    cols[:, :mine.shape[1]] = mine
    lens_local = placement.local_lens(lens)
    used = (lens_local + placement.block_size - 1) // placement.block_size
    live = torch.arange(cols.shape[1])[None, :] < used[:, None]
    src, local_ids = torch.unique(cols[live], return_inverse=True)  # shared blocks stay shared
    need = src.numel()
    table = torch.zeros(cols.shape, dtype=torch.int64)
    table[live] = local_ids
    src = src.to(k_cache.device)
    nb = max(need, 1) if num_blocks is None else num_blocks
    if nb < need:
        raise ValueError(f"num_blocks must be >= {need} (blocks this rank holds), got {nb}")
    k_local = k_cache.new_zeros((nb,) + tuple(k_cache.shape[1:]))
    v_local = v_cache.new_zeros((nb,) + tuple(v_cache.shape[1:]))
    k_local[:need] = k_cache[src]
    v_local[:need] = v_cache[src]
    dev = k_cache.device
    return k_local, v_local, table.to(torch.int32).to(dev), lens_local.to(torch.int32).to(dev)


def cp_decode(q, k_cache_local, v_cache_local, block_table_local, seq_lens_local, group=None, plan=None, *,
              scale=None, strategy: str = "auto", hierarchy=None, softcap=None, sinks=None, k_scale=None,
              v_scale=None):
    """Context-parallel decode: local paged (stream-K) decode of this rank's shard, then
    :func:`tree_merge` over ``group``. q [B, Hq, D] is the same on every rank; ``plan`` is a
    ``pb.plan_decode`` of the *local* lengths. Returns ``(o [B, Hq, D], lse [B, Hq])`` on every rank
    (fresh tensors). When the merge is an all-gather, the local decode writes its state straight into
    the merger's send buffer (no pack copy). ``softcap``, ``k_scale``/``v_scale`` (fp8 shards) go to
    each rank's decode; ``sinks`` are added once, to the merged state. Sliding windows are not
    offered here: a rank's shard holds round-robin blocks, not a range of positions."""
    merger = get_merger(group, strategy=strategy, hierarchy=hierarchy)  # validates group/strategy first
    if sinks is not None and isinstance(q, torch.Tensor) and q.dim() == 3:
        sinks = check_sinks(sinks, q.shape[1], q.device)  # (before any collective)
    views = None
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.dtype in FLOAT_DTYPES:  # else paged_decode names q
        views = merger.send_views(q.shape, q.dtype, q.device)
    out, lse_out = views or (None, None)
    o, lse = pb.paged_decode(q, k_cache_local, v_cache_local, block_table_local, seq_lens_local, scale=scale,
                             plan=plan, return_lse=True, out=out, lse_out=lse_out, softcap=softcap, k_scale=k_scale,
                             v_scale=v_scale)
    o, lse = merger.merge(o, lse, check=False)  # a fresh state (or the send views): no checks needed
    sink_states(o, lse, sinks)  # once, on the merged state (each rank's state is of its keys only)
    return o, lse


def cp_cascade_decode(q, k_cache_local, v_cache_local, cplan_local, group=None, *, strategy: str = "auto",
                      hierarchy=None, **kwargs):
    """Cascade on each rank (``pb.cascade_decode`` with a plan of the rank's local block tables), then
    :func:`tree_merge`. Round-robin placement keeps shared leading blocks shared on every rank.
    ``kwargs`` go to ``pb.cascade_decode`` (``scale``, ``softcap``, ``k_scale``, ``v_scale``), except
    ``sinks``, added once to the merged state; no ``window`` (see :func:`cp_decode`)."""
    cascade = getattr(pb, "cascade_decode", None)
    if cascade is None:
        raise NotImplementedError("cp_cascade_decode needs pb.cascade_decode, which this build lacks")
    if kwargs.get("window") is not None:
        raise ValueError("window is not supported by context-parallel decode: a rank's shard holds round-robin "
                         "blocks, not a range of positions")
    sinks = kwargs.pop("sinks", None)
    merger = get_merger(group, strategy=strategy, hierarchy=hierarchy)
    o, lse = cascade(q, k_cache_local, v_cache_local, cplan_local, return_lse=True, **kwargs)
    if sinks is not None:
        sinks = check_sinks(sinks, q.shape[1], q.device)  # (q was checked by cascade_decode)
    o, lse = merger.merge(o, lse)
    sink_states(o, lse, sinks)  # once, on the merged state
    return o, lse


class Mesh(NamedTuple):
    tp_group: object
    cp_group: object
    tp_rank: int
    cp_rank: int
    tp_size: int
    cp_size: int


def make_mesh(tp_size: int, group=None) -> Mesh:
    """2-D (CP x TP) mesh over ``group`` (default world): rank index ``i = cp_rank * tp_size + tp_rank``.
    Every rank of ``group`` calls it (collective)."""
    tp_group, cp_group, tp_rank, cp_rank = grid_groups(tp_size, group, name="tp_size")
    return Mesh(tp_group, cp_group, tp_rank, cp_rank, tp_size, dist.get_world_size(group) // tp_size)


def tp_head_slices(num_q_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[slice, slice]:
    """(query-head slice, KV-head slice) held by TP rank ``tp_rank``; GQA groups stay whole."""
    _pos_int("tp_size", tp_size)
    if num_kv_heads % tp_size or num_q_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must be divisible by tp_size ({tp_size}) and "
                         f"num_q_heads ({num_q_heads}) by num_kv_heads")
    hq, hkv = num_q_heads // tp_size, num_kv_heads // tp_size
    return slice(tp_rank * hq, (tp_rank + 1) * hq), slice(tp_rank * hkv, (tp_rank + 1) * hkv)


def ring_bytes_per_step(k_cache_local, block_table_local) -> int:
    """Bytes one rank sends in one ring step (K + V shard + metadata)."""
    return 2 * k_cache_local.numel() * k_cache_local.element_size() + 4 * (block_table_local.numel() +
                                                                           block_table_local.shape[0])


def ring_decode(q, k_cache_local, v_cache_local, block_table_local, seq_lens_local, group=None, *, scale=None):
    """Ring-attention decode (baseline): the KV shards travel round the ring (P - 1 steps, send to
    rank+1, receive from rank-1, overlapped with the decode of the shard in hand), states merged
    with ``pb.merge_states``. Local caches and tables must have the same shapes on every rank
    (receives are sized from one's own). Holds two receive buffers (one when P = 2)."""
    nb, bs, hkv, d = check_kv_cache(k_cache_local, v_cache_local)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = list(range(size)) if group is None else dist.get_process_group_ranks(group)
    nxt, prv = ranks[(me + 1) % size], ranks[(me - 1) % size]
    batch, cols = block_table_local.shape
    if debug_enabled():  # a mismatch would garble or hang the receives
        shapes = torch.tensor([nb, batch, cols], dtype=torch.int64, device=q.device)
        every = torch.empty(3 * size, dtype=torch.int64, device=q.device)
        collective("ring_decode shape check", all_gather_flat, every, shapes, group=group)
        if not bool((every.view(-1, 3) == shapes).all()):
            raise ValueError("k_cache_local/block_table_local: shapes differ across ranks ([NB, B, max_blocks] "
                             f"per rank: {every.view(-1, 3).tolist()}); ring_decode needs equal shapes")
    meta = torch.cat([block_table_local.reshape(-1), seq_lens_local.reshape(-1)]).to(torch.int32)
    cur = (k_cache_local.contiguous(), v_cache_local.contiguous(), meta)
    bufs = [tuple(torch.empty_like(t) for t in cur) for _ in range(min(size - 1, 2))]
    acc = None
    for step in range(size):
        reqs = []
        if step < size - 1:
            dst = bufs[step % len(bufs)]
            ops = [dist.P2POp(dist.isend, t, nxt, group) for t in cur] + \
                  [dist.P2POp(dist.irecv, t, prv, group) for t in dst]
            reqs = collective("ring_decode batch_isend_irecv", lambda o, group: dist.batch_isend_irecv(o),
                              ops, group=group)
        bt, lens = cur[2][:batch * cols].view(batch, cols), cur[2][batch * cols:]
        o, lse = pb.paged_decode(q, cur[0], cur[1], bt, lens, scale=scale, return_lse=True)
        acc = (o.float(), lse) if acc is None else pb.merge_states(acc[0], acc[1], o.float(), lse)
        for r in reqs:
            collective("ring_decode wait", lambda group: r.wait(), group=group)
        if reqs:
            cur = dst
    return acc[0].to(q.dtype), acc[1]


__all__ = ["Placement", "shard_paged_kv", "cp_decode", "cp_cascade_decode", "Mesh", "make_mesh",
           "tp_head_slices", "ring_decode", "ring_bytes_per_step", "CollectiveError"]
