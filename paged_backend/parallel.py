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

Per call, :class:`TreeMerger` (what :func:`tree_merge` uses, cached per group/strategy/hierarchy)
reuses per-shape buffers and launches: all-gather = 1 pack copy + the collective + 1 merge kernel
reading the gathered buffer in place; all-reduce = 1 copy + 2 collectives + 2 fused kernels
(``kernels.merge``). No host syncs, so a warmed-up call can be captured in a CUDA graph.

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
from kernels.merge import (merge_gathered_triton, merge_torch, rows_config, weigh_finish_torch, weigh_finish_triton,
                           weigh_pack_torch, weigh_pack_triton)

STRATEGIES = ("auto", "allreduce", "allgather")
ALLGATHER_MAX_BYTES = int(os.environ.get("PAGED_BACKEND_ALLGATHER_MAX_BYTES", 256 * 1024))
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


class _GatherPlan:
    """Buffers and launch config of the all-gather merge for one (shape, dtype, out dtype, device).

    One rank's bytes: ``[lse fp32 | o | pad to 16 B]`` (every dtype view aligned). ``send_o`` /
    ``send_lse`` are typed views of the send buffer; ``o_all`` / ``lse_all`` per-rank strided views
    of the receive buffer, read in place by the merge kernel (no unpacking)."""
    kind = "allgather"

    def __init__(self, shape, dtype, out_dtype, device, size):
        t, h, d = shape
        esize = torch.empty((), dtype=dtype).element_size()
        lb, self.n = t * h * 4, t * h * (4 + d * esize)
        row = -(-self.n // 16) * 16
        self.send = torch.zeros(row, dtype=torch.uint8, device=device)  # pad bytes stay 0
        self.recv = torch.zeros(size * row, dtype=torch.uint8, device=device)
        self.send_bytes = self.send[:self.n]
        self.send_lse = self.send[:lb].view(torch.float32).view(t, h)
        self.send_o = self.send[lb:self.n].view(dtype).view(t, h, d)
        rv = self.recv.view(size, row)
        self.lse_all = rv[:, :lb].view(torch.float32).view(size, t, h)
        self.o_all = rv[:, lb:self.n].view(dtype).view(size, t, h, d)
        self.out_dtype = out_dtype
        self.triton = use_triton(self.send)
        self.cfg = rows_config(t * h, d)

    def buffers(self) -> dict:
        return {"send": self.send, "recv": self.recv}

    def run(self, o, lse, group, out, out_lse):
        if o is not self.send_o or lse is not self.send_lse:  # else: the producer wrote into send_views
            if o.is_contiguous() and lse.is_contiguous():  # one copy kernel: [lse bytes | o bytes]
                torch.cat([lse.view(torch.uint8).view(-1), o.view(torch.uint8).view(-1)], out=self.send_bytes)
            else:
                self.send_lse.copy_(lse)
                self.send_o.copy_(o)
        collective("tree_merge all_gather of [lse | o]", _all_gather_flat, self.recv, self.send, group=group)
        if self.triton:
            merge_gathered_triton(self.lse_all, self.o_all, out, out_lse, self.cfg)
        else:
            merge_torch(self.o_all, self.lse_all, out, out_lse)


class _ReducePlan:
    """Buffers and launch config of the all-reduce merge for one (shape, dtype, out dtype, device):
    ``m`` [T, H] (copy of lse, reduced with MAX in place) and ``buf`` [T, H, D + 1] fp32 ``[o*w | w]``
    (reduced with SUM in place). One fused kernel on each side of the SUM."""
    kind = "allreduce"

    def __init__(self, shape, dtype, out_dtype, device, size):
        t, h, d = shape
        self.m = torch.zeros(t, h, dtype=torch.float32, device=device)
        self.buf = torch.zeros(t, h, d + 1, dtype=torch.float32, device=device)
        self.out_dtype = out_dtype
        self.triton = use_triton(self.buf)
        self.cfg = rows_config(t * h, d)

    def buffers(self) -> dict:
        return {"max": self.m, "sum": self.buf}

    def run(self, o, lse, group, out, out_lse):
        m, buf = self.m, self.buf
        m.copy_(lse)
        collective("tree_merge all_reduce(MAX) of lse", dist.all_reduce, m, op=dist.ReduceOp.MAX, group=group)
        if self.triton:
            weigh_pack_triton(o if o.is_contiguous() else o.contiguous(),
                              lse if lse.is_contiguous() else lse.contiguous(), m, buf, self.cfg)
        else:
            weigh_pack_torch(o, lse, m, buf)
        collective("tree_merge all_reduce(SUM) of [o*w | w]", dist.all_reduce, buf, op=dist.ReduceOp.SUM,
                   group=group)
        if self.triton:
            weigh_finish_triton(buf, m, out, out_lse, self.cfg)
        else:
            weigh_finish_torch(buf, m, out, out_lse)


class _Level:
    """One level of the merge (one group): plans cached by (shape, dtype, out dtype, device)."""

    def __init__(self, group, strategy, max_plans):
        self.group, self.strategy, self.max_plans = group, strategy, max_plans
        self.size = dist.get_world_size(group)
        self.plans: dict = {}

    def plan(self, shape, dtype, out_dtype, device):
        key = (shape, dtype, out_dtype, device)
        p = self.plans.get(key)
        if p is None:
            t, h, d = shape
            nbytes = t * h * (d * torch.empty((), dtype=dtype).element_size() + 4)
            kind = self.strategy if self.strategy != "auto" else \
                ("allgather" if nbytes <= ALLGATHER_MAX_BYTES else "allreduce")
            if self.max_plans is not None and len(self.plans) >= self.max_plans:
                self.plans.pop(next(iter(self.plans)))  # oldest first
            p = self.plans[key] = (_GatherPlan if kind == "allgather" else _ReducePlan)(
                tuple(shape), dtype, out_dtype, device, self.size)
        return p

    def merge(self, o, lse, out_dtype, plan=None):
        if self.size == 1:
            return o.to(out_dtype), lse
        p = plan or self.plan(o.shape, o.dtype, out_dtype, o.device)
        out = torch.empty(o.shape, dtype=out_dtype, device=o.device)
        out_lse = torch.empty(lse.shape, dtype=torch.float32, device=o.device)
        p.run(o, lse, self.group, out, out_lse)
        return out, out_lse

    def merge_into(self, o, lse, out, out_lse):
        """Merge writing into given contiguous outputs (the next level's send views)."""
        self.plan(o.shape, o.dtype, out.dtype, o.device).run(o, lse, self.group, out, out_lse)


class TreeMerger:
    """Reusable :func:`tree_merge` for one group (keep one per group in an engine).

    Construction validates the group/hierarchy once and resolves per-level world sizes; each call
    then looks its buffers up by (shape, dtype, device): send/receive buffers, their typed views and
    the kernels' launch config are made on the first call of a shape and reused after (no
    allocation but the two outputs, no host sync, so a call can be captured in a CUDA graph once
    warmed up). Per call and level: ``allgather`` = 1 pack copy + 1 all-gather + 1 merge kernel;
    ``allreduce`` = 1 copy + all_reduce(MAX) + 1 pack kernel + all_reduce(SUM) + 1 finish kernel.
    A hierarchical merge writes the intra-node result straight into the inter-node all-gather's send
    buffer. ``max_plans`` bounds the shapes cached per level (oldest dropped; ``None``: unbounded -
    use that, or a bound above the number of captured shapes, when calls are captured in CUDA graphs,
    since a graph keeps using the buffers it captured). Not thread-safe; one stream at a time.
    """

    def __init__(self, group=None, *, strategy: str = "auto", hierarchy=None, max_plans: int | None = 64):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if max_plans is not None and (isinstance(max_plans, bool) or not isinstance(max_plans, int)
                                      or max_plans < 1):
            raise ValueError(f"max_plans must be a positive int or None, got {max_plans!r}")
        self.hierarchy = _check_group(group, hierarchy)
        self.group, self.strategy = group, strategy
        if self.hierarchy is None:
            self.levels = (_Level(group, strategy, max_plans),)
        else:
            self.levels = (_Level(self.hierarchy.intra, strategy, max_plans),
                           _Level(self.hierarchy.inter, strategy, max_plans))

    def merge(self, o: torch.Tensor, lse: torch.Tensor, *, check: bool = True):
        """:func:`tree_merge` of ``(o, lse)`` over this merger's group. ``check=False`` skips the
        argument checks (for callers whose tensors are known to be well formed)."""
        if check:
            _check_args(o, lse, self.strategy)
        if debug_enabled():
            _check_same_everywhere(o, self.group)
        if o.numel() == 0:
            return o.clone(), lse.clone()
        if len(self.levels) == 1:
            return self.levels[0].merge(o, lse, o.dtype)
        intra, inter = self.levels
        if inter.size == 1:
            return intra.merge(o, lse, o.dtype)
        if intra.size == 1:  # same bits as converting to fp32 first: the kernels compute in fp32
            return inter.merge(o, lse, o.dtype)
        mid = torch.float32  # the intermediate state stays fp32: a bf16 input is rounded once
        p2 = inter.plan(o.shape, mid, o.dtype, o.device)
        if intra.size > 1 and p2.kind == "allgather":  # write the node's state into the next send buffer
            intra.merge_into(o, lse, p2.send_o, p2.send_lse)
            return inter.merge(p2.send_o, p2.send_lse, o.dtype, p2)
        o1, lse1 = intra.merge(o, lse, mid)
        return inter.merge(o1, lse1, o.dtype, p2)

    __call__ = merge

    def send_views(self, shape, dtype, device):
        """``(o [T, Hq, D], lse [T, Hq])`` views of the all-gather send buffer for inputs of this
        shape/dtype, or ``None`` when that shape uses the all-reduce (or is hierarchical/size 1). A
        producer that writes its state into them and passes these very tensors to :meth:`merge`
        saves the pack copy."""
        lvl = self.levels[0]
        if len(self.levels) != 1 or lvl.size == 1 or any(s == 0 for s in shape):
            return None
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        p = lvl.plan(torch.Size(shape), dtype, dtype, device)
        return (p.send_o, p.send_lse) if p.kind == "allgather" else None

    def buffers(self) -> list:
        """``[(level, kind, shape, {name: tensor})]`` of the cached buffers (tests, diagnostics)."""
        return [(i, p.kind, key[0], p.buffers()) for i, lvl in enumerate(self.levels)
                for key, p in lvl.plans.items()]


_MERGERS: dict = {}
_MAX_MERGERS = 32


def get_merger(group=None, *, strategy: str = "auto", hierarchy=None) -> TreeMerger:
    """The cached :class:`TreeMerger` that :func:`tree_merge` uses for these arguments."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
    try:  # None means the current default group: a re-initialised world gets a new merger
        key = (dist.group.WORLD if group is None else group, strategy, hierarchy)
        m = _MERGERS.get(key)
    except TypeError:  # unhashable hierarchy: let the constructor name the problem
        return TreeMerger(group, strategy=strategy, hierarchy=hierarchy)
    if m is None:
        m = TreeMerger(group, strategy=strategy, hierarchy=hierarchy)
        if len(_MERGERS) >= _MAX_MERGERS:
            _MERGERS.pop(next(iter(_MERGERS)))
        _MERGERS[key] = m
    return m


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
    return get_merger(group, strategy=strategy, hierarchy=hierarchy).merge(o, lse, check=False)
