"""Exact merging of attention states ``(o, lse)`` across a process group (Tree Attention,
arXiv:2408.04093): each rank holds the state of its own disjoint key set; every rank gets the
state of the union. Natural-log LSE; an empty state (``lse = -inf``, ``o = 0``) is the identity.

Strategies (one level):

- ``"allgather"``: one all-gather of the packed bytes ``[lse | o]`` (o in its own dtype), then a
  local merge of the P states in rank order (``kernels.merge``). One collective; every rank computes
  the same bits.
- ``"allreduce"``: ``m = all_reduce(lse, MAX)``; ``w = exp(lse - m)`` (0 where ``lse = -inf``);
  one ``all_reduce(SUM)`` of the packed fp32 buffer ``[o*w | w]``; ``o = sum(o*w) / sum(w)``,
  ``lse = m + log(sum(w))``. Two collectives, but the big one is a reduction whose bytes do not
  grow with P.
- ``"auto"``: all-gather while the per-rank message (``o`` bytes + ``lse`` bytes) is at most
  :data:`ALLGATHER_MAX_BYTES` (256 KiB; env ``PAGED_BACKEND_ALLGATHER_MAX_BYTES``), else all-reduce.
  Below a few hundred KB both collectives are latency-bound (ANCHORS.md: a 4 KB and a 256 KB
  all-reduce cost the same), so one collective beats two; above it, the all-gather's P-fold volume
  and the local merge's P-fold read lose to the reduction.

Hierarchical: ``hierarchy=(intra, inter)`` (see :func:`make_hierarchy`) merges inside the node
group first, then across nodes; the intermediate state stays fp32. Results are deterministic for a
given group layout and strategy.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, debug_enabled
from kernels.dispatch import use_triton
from kernels.merge import merge_torch, merge_triton

STRATEGIES = ("auto", "allreduce", "allgather")
ALLGATHER_MAX_BYTES = int(os.environ.get("PAGED_BACKEND_ALLGATHER_MAX_BYTES", 256 * 1024))
_NEG_INF = float("-inf")
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13 renamed it


class CollectiveError(RuntimeError):
    """A collective of :func:`tree_merge` (or of the ring baseline) failed: typically a peer died or
    did not join within the process group's timeout (``init_process_group(timeout=...)``)."""


class Hierarchy(NamedTuple):
    """Two-level group spec for this rank: ``intra`` = ranks of its node, ``inter`` = the ranks with
    the same position in every node."""
    intra: object
    inter: object


def collective(what: str, fn, *args, group=None, **kwargs):
    """Runs ``fn(*args, group=group, **kwargs)``, turning backend failures into a clear
    :class:`CollectiveError` (gloo raises on a dead peer or at the group's timeout)."""
    try:
        return fn(*args, group=group, **kwargs)
    except Exception as e:  # RuntimeError / DistBackendError / DistNetworkError from the backend
        try:
            size = dist.get_world_size(group)
        except Exception:
            size = "?"
        raise CollectiveError(
            f"{what} over a group of {size} ranks failed: a peer died or did not join within the process "
            f"group's timeout ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


def _group_ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None or group is dist.group.WORLD \
        else dist.get_process_group_ranks(group)


def grid_groups(inner: int, group=None, name: str = "inner"):
    """Cuts ``group`` (ranks in order) into rows of ``inner`` consecutive ranks. Returns this rank's
    ``(row_group, column_group, index_in_row, row_index)``. Every rank of ``group`` must call it
    (groups are built with ``use_local_synchronization``, so other ranks need not)."""
    ranks = _group_ranks(group)
    if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1 or len(ranks) % inner:
        raise ValueError(f"{name} must be a positive int dividing the group size {len(ranks)}, got {inner!r}")
    me = ranks.index(dist.get_rank())
    row, col = me // inner, me % inner
    row_ranks = ranks[row * inner:(row + 1) * inner]
    col_ranks = ranks[col::inner]
    for rs in (tuple(row_ranks), tuple(col_ranks)):  # rows first on every rank: no cross wait
        if rs not in _GROUPS:  # torch names these groups by their ranks: create each once
            _GROUPS[rs] = dist.new_group(list(rs), use_local_synchronization=True)
    return _GROUPS[tuple(row_ranks)], _GROUPS[tuple(col_ranks)], col, row


_GROUPS: dict = {}
_HIERARCHIES: dict = {}


def make_hierarchy(ranks_per_node: int, group=None) -> Hierarchy:
    """The two-level spec for ``group`` (default: world) with nodes of ``ranks_per_node`` consecutive
    ranks. Collective over ``group``: every member calls it once (cached after)."""
    key = (ranks_per_node, id(group))
    if key not in _HIERARCHIES:
        intra, inter, _, _ = grid_groups(ranks_per_node, group, name="ranks_per_node")
        _HIERARCHIES[key] = Hierarchy(intra, inter)
    return _HIERARCHIES[key]


def _check_args(o, lse, strategy):
    check_tensor("o", o, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=o.device)
    check_shape("lse", lse, tuple(o.shape[:2]))
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def _check_group(group, hierarchy):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if hierarchy is None:
        return None
    if isinstance(hierarchy, int) and not isinstance(hierarchy, bool):
        return make_hierarchy(hierarchy, group)
    if not (isinstance(hierarchy, tuple) and len(hierarchy) == 2
            and all(isinstance(g, dist.ProcessGroup) for g in hierarchy)):
        raise TypeError("hierarchy must be (intra_group, inter_group) ProcessGroups (see make_hierarchy) "
                        f"or an int ranks_per_node, got {type(hierarchy).__name__}")
    want = dist.get_world_size(group)
    got = dist.get_world_size(hierarchy[0]) * dist.get_world_size(hierarchy[1])
    if got != want:
        raise ValueError(f"hierarchy groups have {dist.get_world_size(hierarchy[0])} x "
                         f"{dist.get_world_size(hierarchy[1])} = {got} ranks but group has {want}")
    return Hierarchy(*hierarchy)


def _check_same_everywhere(o, group):
    # Debug only (one extra collective): a shape/dtype mismatch would otherwise hang or garble.
    code = FLOAT_DTYPES.index(o.dtype)
    meta = torch.tensor([*o.shape, code], dtype=torch.int64, device=o.device)
    every = torch.empty(dist.get_world_size(group) * 4, dtype=torch.int64, device=o.device)
    collective("tree_merge shape check", _all_gather_flat, every, meta, group=group)
    if not bool((every.view(-1, 4) == meta).all()):
        raise ValueError(f"o: shapes/dtypes differ across ranks ([T, Hq, D, dtype] per rank: "
                         f"{every.view(-1, 4).tolist()})")


def pick_strategy(o, lse, strategy: str = "auto") -> str:
    if strategy != "auto":
        return strategy
    nbytes = o.numel() * o.element_size() + lse.numel() * 4
    return "allgather" if nbytes <= ALLGATHER_MAX_BYTES else "allreduce"


def _merge_allgather(o, lse, group, size, out_dtype):
    # One rank's bytes: [lse fp32 | o | pad to 16 B], so every dtype view below is aligned.
    lb = lse.contiguous().view(-1).view(torch.uint8)
    ob = o.contiguous().view(-1).view(torch.uint8)
    n = lb.numel() + ob.numel()
    row = -(-n // 16) * 16
    pad = [torch.zeros(row - n, dtype=torch.uint8, device=o.device)] if row > n else []
    send = torch.cat([lb, ob] + pad)
    recv = torch.empty(size * row, dtype=torch.uint8, device=o.device)
    collective("tree_merge all_gather of [lse | o]", _all_gather_flat, recv, send, group=group)
    recv = recv.view(size, row)
    lse_all = recv[:, :lb.numel()].view(torch.float32).view(size, *lse.shape)
    o_all = recv[:, lb.numel():n].view(o.dtype).view(size, *o.shape)
    out = torch.empty(o.shape, dtype=out_dtype, device=o.device)
    out_lse = torch.empty(lse.shape, dtype=torch.float32, device=o.device)
    (merge_triton if use_triton(o) else merge_torch)(o_all, lse_all, out, out_lse)
    return out, out_lse


def _merge_allreduce(o, lse, group, out_dtype):
    t, h, d = o.shape
    m = lse.clone()
    collective("tree_merge all_reduce(MAX) of lse", dist.all_reduce, m, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(m == _NEG_INF, 0.0, m)  # rows empty on every rank: shift by 0, exp(-inf) = 0
    w = torch.exp(lse - m)
    buf = torch.empty(t, h, d + 1, dtype=torch.float32, device=o.device)
    torch.mul(o, w[..., None], out=buf[..., :d])
    buf[..., d] = w
    collective("tree_merge all_reduce(SUM) of [o*w | w]", dist.all_reduce, buf, op=dist.ReduceOp.SUM,
               group=group)
    w_sum = buf[..., d]
    empty = w_sum == 0.0
    w_sum = torch.where(empty, 1.0, w_sum)
    out = (buf[..., :d] / w_sum[..., None]).to(out_dtype)
    return out, torch.where(empty, _NEG_INF, m + torch.log(w_sum))


def _merge_level(o, lse, group, strategy, out_dtype):
    size = dist.get_world_size(group)
    if size == 1:
        return o.to(out_dtype), lse
    if pick_strategy(o, lse, strategy) == "allgather":
        return _merge_allgather(o, lse, group, size, out_dtype)
    return _merge_allreduce(o, lse, group, out_dtype)


def tree_merge(o: torch.Tensor, lse: torch.Tensor, group=None, *, strategy: str = "auto", hierarchy=None):
    """Merge the attention states of all ranks of ``group`` (default: world); every rank gets the result.

    o [T, Hq, D] (fp16/bf16/fp32), lse [T, Hq] float32 natural log, the same shapes and dtype on every
    rank (checked with ``PAGED_BACKEND_DEBUG=1``). Returns ``(o [T, Hq, D] in o's dtype, lse [T, Hq]
    float32)``; rows empty on every rank give o = 0, lse = -inf. ``strategy``: "auto", "allreduce" or
    "allgather" (module docstring); ``hierarchy``: ``(intra_group, inter_group)`` from
    :func:`make_hierarchy`, or an int ranks-per-node (groups built on first use, collectively).
    A dead or late peer raises :class:`CollectiveError` once the group's timeout expires (gloo; with
    NCCL the watchdog aborts at its timeout).
    """
    _check_args(o, lse, strategy)
    hierarchy = _check_group(group, hierarchy)
    if debug_enabled():
        _check_same_everywhere(o, group)
    if o.numel() == 0:
        return o.clone(), lse.clone()
    if hierarchy is None:
        return _merge_level(o, lse, group, strategy, o.dtype)
    mid_dtype = o.dtype if dist.get_world_size(hierarchy.inter) == 1 else torch.float32
    o1, lse1 = _merge_level(o, lse, hierarchy.intra, strategy, mid_dtype)
    return _merge_level(o1, lse1, hierarchy.inter, strategy, o.dtype)
