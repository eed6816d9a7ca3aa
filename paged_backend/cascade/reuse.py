"""Reusing an earlier step's prefix forest (``plan_cascade(..., forest=)``), host numpy.

Finding and verifying the forest reads every shared block id, most of a new plan's cost. A decode
step that only appends private blocks keeps the forest as it was, and a step whose batch lost
requests (samples that finished, as in best-of-n or RL rollouts) keeps it restricted to the
requests left: removing requests never creates sharing. So the earlier nodes are reused, and
checked cheaply instead of found again (:func:`check_held`).
"""
from __future__ import annotations

import numpy as np

from paged_backend.cascade.forest import group_depths
from paged_backend.cascade.merge_lists import memberships


def restrict_forest(ptr, members, start, end, level, rows: np.ndarray, prev_batch: int, pays):
    """The forest of a batch made of some requests of an earlier one, from that batch's kept nodes.

    ``ptr``/``members`` (CSR, earlier batch indices), ``start``/``end`` (blocks) and ``level`` are
    the earlier plan's nodes, parents first; ``rows [B]`` holds each request's index in the earlier
    batch (distinct). Each node keeps the members still there. A node left with the same members
    as its kept parent merges into it, so the trie stays compressed as ``auto_forest`` builds it.
    Otherwise the node is dropped when it has fewer than 2 members or no longer pays off
    (``pays``), and its blocks fold into its children, as when a forest is found.
    -> ``(ptr, members, start, end, level, kept depth per request)`` as :func:`auto_forest` returns.
    """
    bsz = rows.size
    inv = np.full(prev_batch, -1, dtype=np.int64)
    inv[rows] = np.arange(bsz)
    sizes = ptr[1:] - ptr[:-1]
    mem = inv[members]
    live = mem >= 0
    key = np.arange(sizes.size).repeat(sizes)[live] * bsz + mem[live]
    key.sort()  # by node, then new batch index: members ascend within each node
    node, mem = np.divmod(key, bsz)
    n = np.bincount(node, minlength=sizes.size)  # [K] members left per node
    first = np.cumsum(n) - n
    kd = np.zeros(bsz, dtype=np.int64)           # kept depth per request
    kc = np.zeros(bsz, dtype=np.int64)           # kept nodes per request
    last = np.full(bsz, -1, dtype=np.int64)      # each request's last kept node (an earlier node id)
    new_start, new_end, new_level = start.copy(), end.copy(), level.copy()
    made = []
    for lv in range(int(level.max()) + 1 if level.size else 0):  # parents before children
        ks = ((level == lv) & (n >= 2)).nonzero()[0]
        lead = mem[first[ks]]
        pk = kd[lead]  # the kept depth above the node: where its range starts now
        par = last[lead]
        merge = par >= 0
        merge[merge] = n[par[merge]] == n[ks[merge]]  # a subset of its parent's members, as many
        keep = merge | pays(n[ks], end[ks] - pk)
        ks, lead, pk, par, merge = ks[keep], lead[keep], pk[keep], par[keep], merge[keep]
        cnt = n[ks]
        m = mem[memberships(first[ks], cnt)[0]]  # node by node
        kd[m] = end[ks].repeat(cnt)
        new_end[par[merge]] = end[ks[merge]]
        fresh = ~merge
        m = m[fresh.repeat(cnt)]
        ks, cnt = ks[fresh], cnt[fresh]
        new_start[ks], new_level[ks] = pk[fresh], kc[lead[fresh]]
        kc[m] += 1
        last[m] = ks.repeat(cnt)
        made.append(ks)
    made = np.concatenate(made) if made else np.zeros(0, dtype=np.int64)
    cnt = n[made]
    out_ptr = np.zeros(made.size + 1, dtype=np.int64)
    np.cumsum(cnt, out=out_ptr[1:])
    return out_ptr, mem[memberships(first[made], cnt)[0]], new_start[made], new_end[made], new_level[made], kd


def check_held(table: np.ndarray, lens: np.ndarray, bs: int, ptr, members, start, end, kd, debug: bool) -> None:
    """The reused nodes (blocks ``[start, end)``, CSR members; ``kd`` blocks shared per request)
    still hold in ``table`` with ``lens`` tokens per request: each request holds its shared blocks
    in full, and each member's last shared block id equals its node's first member's (with
    ``debug``, every shared id). ``ValueError`` naming the first request that does not."""
    short = (lens // bs < kd).nonzero()[0]
    if short.size:
        b = int(short[0])
        raise ValueError(f"forest shares {int(kd[b]) * bs} tokens of request {b}, which now holds {int(lens[b])}: "
                         "plan this step without forest")
    if not members.size:
        return
    if debug:
        bad = (group_depths(table, members, ptr[:-1], start, end) < end).nonzero()[0]
        if bad.size:  # the first such node (its ancestors, listed before it, hold theirs): which member
            k = int(bad[0])
            m = members[ptr[k]:ptr[k + 1]]
            diff = (table[m, start[k]:end[k]] != table[m[0], start[k]:end[k]]).any(axis=1)
            _not_held(m[diff.argmax()])
        return
    sizes = ptr[1:] - ptr[:-1]
    node = np.arange(sizes.size).repeat(sizes)  # [M] node of each membership
    held = table[members, end[node] - 1]  # each member's last shared block
    bad = (held != held[ptr[:-1]][node]).nonzero()[0]
    if bad.size:
        _not_held(members[bad[0]])


def _not_held(b) -> None:
    raise ValueError(f"block_table_cpu row {int(b)} no longer holds the shared blocks of forest's node: "
                     "plan this step without forest")
