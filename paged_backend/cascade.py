"""Public cascade (shared-prefix) decode: ``plan_cascade`` once per step, ``cascade_decode`` per layer.

A prefix shared by n requests (found from identical leading block ids, or given by the scheduler
as groups) is read once and attended by all n requests as one tensor-core GEMM, spread stream-K
over the GPU; each request's private tail runs as decode; the states merge exactly. See
docs/cascade.md and :mod:`paged_backend.cascade_plan` (the plan itself; its arguments are checked here).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.cascade import cascade_torch, cascade_triton
from kernels.checks import HEAD_DIMS, check_attention_inputs, check_heads, check_plan_matches, debug_enabled
from kernels.decode import decode_triton
from kernels.dispatch import use_triton
from paged_backend.cascade_forest import group_depths
from paged_backend.cascade_plan import CascadeCost, CascadePlan, build_plan

__all__ = ["CascadePlan", "CascadeCost", "plan_cascade", "cascade_decode"]


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cplan: CascadePlan,
                   return_lse: bool = True, scale: float | None = None):
    """Decode attention of one query token per request, sharing the plan's prefixes.

    q [B, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D] (any strides); ``cplan`` from
    :func:`plan_cascade` for this step (it holds the block table and lengths). Returns
    ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32 natural log)``, or ``out`` alone when
    ``return_lse=False``. A request of length 0 gives out = 0, lse = -inf. Exact (equal to flat
    decode up to rounding) and deterministic.
    """
    if not isinstance(cplan, CascadePlan):
        raise TypeError(f"cplan must be a CascadePlan from pb.plan_cascade, got {type(cplan).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    nb, bs, hkv, d, hq, scale = check_attention_inputs(q, k_cache, v_cache, scale)
    batch = q.shape[0]
    check_plan_matches("cplan", cplan, q.device, batch_size=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=bs)
    if cplan.max_block_id >= nb:
        raise ValueError(f"cplan's block table uses block id {cplan.max_block_id} but k_cache holds {nb} blocks")
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    if use_triton(q):
        if cplan.is_flat:
            decode_triton(q, k_cache, v_cache, cplan.views["block_table"], cplan.views["seq_lens"],
                          cplan.flat_plan, scale, out, lse)
        else:
            cascade_triton(q, k_cache, v_cache, cplan, scale, out, lse)
    else:
        cascade_torch(q, k_cache, v_cache, cplan, scale, out, lse)
    return (out, lse) if return_lse else out


def _positive_int(name, val):
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return int(val)


def _host_array(name, x, ndim):
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a host (CPU) tensor or numpy array; got a tensor on {x.device} "
                             "(keep a host copy of the metadata; the plan copies it to the device once)")
        x = x.numpy()
    arr = np.asarray(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    return arr


def plan_cascade(block_table_cpu, seq_lens_cpu, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, device=None, groups=None, cost: CascadeCost | None = None,
                 node_programs: int | None = None, leaf_programs: int | None = None,
                 block_table_device: torch.Tensor | None = None, forest: CascadePlan | None = None) -> CascadePlan:
    """Plan one cascade decode step from host metadata (see module doc).

    ``block_table_cpu [B, max_blocks]`` and ``seq_lens_cpu [B]``: host (CPU tensor / numpy) copies.
    ``groups``: optional explicit groups from the scheduler (lists of batch indices, nested or
    disjoint); their common leading full blocks are verified and only those are shared. ``cost``:
    the :class:`CascadeCost` deciding which nodes pay off. ``node_programs`` / ``leaf_programs``
    override the persistent grids (default SMs x occupancy). ``block_table_device``: the same table
    already on ``device`` (int32, any strides): the kernels read it instead of a fresh copy.
    ``forest``: the plan of an earlier step of the same batch (same requests in the same order) whose
    shared blocks are unchanged, as in decode steps that only append private blocks: its nodes are
    reused (finding and verifying the forest is most of the cost), and its partition too where only
    the tails' lengths changed (the same requests with tails, one piece each); else the partition is
    redone. Each request must still hold its shared blocks in full, and every member's last shared block is
    compared with its node's (the whole shared ranges with ``PAGED_BACKEND_DEBUG=1``).
    """
    table = _host_array("block_table_cpu", block_table_cpu, 2)
    lens = _host_array("seq_lens_cpu", seq_lens_cpu, 1).astype(np.int64)
    for name, val in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim), ("block_size", block_size)):
        _positive_int(name, val)
    check_heads(num_q_heads, num_kv_heads)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    if table.shape[0] != lens.size:
        raise ValueError(f"block_table_cpu has {table.shape[0]} rows but seq_lens_cpu has {lens.size} entries")
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens_cpu must be >= 0, got min {lens.min()}")
    if lens.size and lens.max() > table.shape[1] * block_size:
        raise ValueError(f"seq_lens_cpu max {lens.max()} exceeds the block table's capacity "
                         f"{table.shape[1]} blocks x {block_size}")
    if cost is None:
        cost = CascadeCost()
    elif not isinstance(cost, CascadeCost):
        raise TypeError(f"cost must be a CascadeCost or None, got {type(cost).__name__}")
    for name, val in (("node_programs", node_programs), ("leaf_programs", leaf_programs)):
        if val is not None:
            _positive_int(name, val)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch.device or device string, got {device!r}") from e
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if block_table_device is not None:
        if not isinstance(block_table_device, torch.Tensor):
            raise TypeError(f"block_table_device must be a torch.Tensor, got {type(block_table_device).__name__}")
        if block_table_device.dtype != torch.int32 or block_table_device.device != device \
                or block_table_device.dim() != 2 or block_table_device.shape[0] != lens.size \
                or block_table_device.shape[1] < min(table.shape[1], -(-int(lens.max() if lens.size else 0) // block_size)):
            raise ValueError("block_table_device must be an int32 [B, >= blocks in use] tensor on "
                             f"{device} holding block_table_cpu's ids")
    if forest is not None:
        _check_forest(forest, table, lens, groups, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size)
    return build_plan(table, lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, device=device, groups=groups, cost=cost,
                      node_programs=node_programs, leaf_programs=leaf_programs,
                      block_table_device=block_table_device, forest=forest)


def _check_forest(forest, table, lens, groups, **shape) -> None:
    """``forest`` (an earlier CascadePlan) still describes ``table``: same batch and shapes, every
    request holds its shared blocks in full, and each member's last shared block id (every shared id
    with PAGED_BACKEND_DEBUG=1) equals its node's first member's."""
    if not isinstance(forest, CascadePlan):
        raise TypeError(f"forest must be a CascadePlan from pb.plan_cascade, got {type(forest).__name__}")
    if groups is not None:
        raise ValueError("give groups or forest, not both (forest reuses an earlier plan's nodes)")
    shape["batch_size"] = lens.size
    for name, want in shape.items():
        if getattr(forest, name) != want:
            raise ValueError(f"forest was planned with {name}={getattr(forest, name)}, this step has {want}")
    bs, full = forest.block_size, lens // forest.block_size
    if (full < forest.shared_len_host // bs).any():
        b = int(np.flatnonzero(full < forest.shared_len_host // bs)[0])
        raise ValueError(f"forest shares {forest.shared_len_host[b]} tokens of request {b}, which now holds "
                         f"{lens[b]}: plan this step without forest")
    if forest.is_flat:
        return
    ptr, members = forest.node_ptr, forest.node_members
    first, last = forest.node_start // bs, forest.node_end // bs
    if debug_enabled():
        bad = (group_depths(table, members, ptr[:-1], first, last) < last).nonzero()[0]
        if bad.size:  # the first such node (its ancestors, listed before it, hold theirs): which member
            k = int(bad[0])
            m = members[ptr[k]:ptr[k + 1]]
            diff = (table[m, first[k]:last[k]] != table[m[0], first[k]:last[k]]).any(axis=1)
            _not_held(m[diff.argmax()])
        return
    sizes = np.diff(ptr)
    node = np.repeat(np.arange(sizes.size), sizes)  # [M] node of each membership
    held = table[members, last[node] - 1]  # each member's last shared block
    bad = held != held[ptr[:-1]][node]
    if bad.any():
        _not_held(members[np.flatnonzero(bad)[0]])


def _not_held(b) -> None:
    raise ValueError(f"block_table_cpu row {int(b)} no longer holds the shared blocks of forest's node: "
                     "plan this step without forest")
