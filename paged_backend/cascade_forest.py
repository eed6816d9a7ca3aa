"""The prefix forest of a decode batch, found from its block tables (host numpy).

Requests share their leading *full* blocks when those hold the same block ids (a partially filled
last block is never shared). The forest is a compressed trie over the rows' full blocks, built top
down, one vectorised pass per tree level (a loop over levels only: none over blocks or requests):

1. rows whose first full block is held by another row are grouped by that block (one argsort of
   one column); a group of >= 2 rows is a node candidate starting at column ``c = 0``;
2. each row of a group is compared against the group's *leader* (its smallest batch index),
   from ``c + 1`` on (:func:`lcp_with_leaders`): a probe row per group first, then the others
   one contiguous span each, up to where their probe differs (row spans read several times
   faster than narrow column chunks across rows; the rows that match all of it go on). The exact
   first mismatch (capped at both rows' full blocks) is the row's LCP with its leader, and the
   group's depth ``d`` is the smallest of them: every member holds the leader's ids on
   ``[c, d)``, compared id by id (no hashing, so nothing is shared on a collision);
3. members with a block at column ``d`` are sub-grouped by it (a stable sort of (group, id)); a
   sub-group of >= 2 rows is a child candidate starting at ``d``. The leader's own sub-group keeps
   its leader and the LCPs already measured (no column is read twice); the others take a new leader.

Nodes are folded by the cost model as they are produced (parents before children): a node's range
starts at its nearest *kept* ancestor's depth. ``auto_forest`` and ``group_forest`` return
``(members CSR ptr, members, start blk, end blk, kept depth per request)``; nodes are parents first
and each node's members are ascending batch indices.
"""
from __future__ import annotations

import numpy as np

_CHUNK0 = 64          # columns a row reads at least, and the first chunk of a chunked scan
_BLOCK = 1 << 16      # ids compared per row block: the block's rows, its leaders and the mask stay in L2
_SPAN_MAX = 1 << 17   # ids below which rows read their whole range in one pass (chunks would not pay)


def _empty(bsz: int):
    z = np.zeros(0, np.int64)
    return np.zeros(1, np.int64), z, z, z.copy(), np.zeros(bsz, np.int64)


def _first_mismatch(table: np.ndarray, rows: np.ndarray, leads: np.ndarray, a: np.ndarray,
                    b: np.ndarray) -> np.ndarray:
    """Per row: the first column in ``[a[i], b[i])`` where ``table[rows[i]]`` and
    ``table[leads[i]]`` differ, else ``b[i]``. Row blocks of ~_BLOCK ids, each row read as one
    contiguous span of its block's columns; rows whose ranges differ much go in order of ``b``, so
    that a block's columns stay close to each of its rows' own."""
    n, lo, hi = rows.size, int(a.min()), int(b.max())
    order = None
    if (hi - lo) * n <= 1.25 * float((b - a).sum()):  # about one range: compare all rows over it
        step = max(1, _BLOCK // (hi - lo))
        edges = list(range(0, n, step)) + [n]
        x0, x1 = [lo] * len(edges), [hi] * len(edges)
    else:
        order = np.argsort(b, kind="stable")
        rows, leads, a, b = rows[order], leads[order], a[order], b[order]
        cum = np.cumsum(b - a)
        edges = np.unique(np.searchsorted(cum, np.arange(0, int(cum[-1]), _BLOCK), side="right").tolist() + [0, n])
        x0, x1 = np.minimum.reduceat(a, edges[:-1]), b[edges[1:] - 1]  # each block's columns
        edges, x0, x1 = edges.tolist(), x0.tolist(), x1.tolist()
    first = np.empty(n, dtype=np.intp)
    for i0, i1, c0, c1 in zip(edges[:-1], edges[1:], x0, x1):
        neq = table[rows[i0:i1], c0:c1] != table[leads[i0:i1], c0:c1]
        neq.argmax(axis=1, out=first[i0:i1])  # stops at a row's first mismatch
    first += lo if order is None else np.repeat(x0, np.diff(edges))
    out = np.where((first < b) & (table[rows, first] != table[leads, first]), first, b)
    if order is not None:
        out[order] = out.copy()
    return out


def lcp_with_leaders(table: np.ndarray, rows: np.ndarray, leads: np.ndarray, start: np.ndarray,
                     cap: np.ndarray) -> np.ndarray:
    """First column ``j`` in ``[start[i], cap[i])`` where ``table[rows[i], j] != table[leads[i], j]``,
    else ``cap[i]``; columns before ``start[i]`` must already be known equal. Exact: id by id.

    Reading whole row spans in one pass is several times faster than narrow column chunks across
    the rows, so: few ids -> one pass over each row's range. Else each run of rows with the same
    leader (callers pass rows grouped by leader) sends its middle row ahead as a probe; the others
    read one span up to and including the column where their probe differs (where the run most
    likely ends, at least _CHUNK0 columns), and the rows that match all of it go on the same way.
    Rows that each have their own leader scan in chunks of 64, 256, 1024, ... columns. A run whose
    probe shares far more than its other rows reads past their LCPs (at worst up to the probe's)."""
    cap = np.asarray(cap, dtype=np.int64)
    e = cap.copy()
    todo = np.flatnonzero(cap > start)
    if not todo.size:
        return e
    r0, c = start[todo], cap[todo]
    if int((c - r0).sum()) <= _SPAN_MAX:
        e[todo] = _first_mismatch(table, rows[todo], leads[todo], r0, c)
        return e
    lt = leads[todo]
    new = np.ones(todo.size, dtype=bool)
    np.not_equal(lt[1:], lt[:-1], out=new[1:])
    rs = np.flatnonzero(new)
    if rs.size == todo.size:  # every row has its own leader: chunks
        w = _CHUNK0
        while todo.size:
            end = np.minimum(r0 + w, c)
            f = _first_mismatch(table, rows[todo], leads[todo], r0, end)
            go = (f == end) & (end < c)
            e[todo] = f
            todo, r0, c, w = todo[go], end[go], c[go], 4 * w
        return e
    mid = (rs + np.append(rs[1:], todo.size)) // 2
    probe = todo[mid]
    e[probe] = lcp_with_leaders(table, rows[probe], leads[probe], start[probe], cap[probe])
    others = np.ones(todo.size, dtype=bool)
    others[mid] = False
    rest, r0 = todo[others], r0[others]
    bound = np.minimum(np.maximum(e[probe][(np.cumsum(new) - 1)[others]] + 1, r0 + _CHUNK0), cap[rest])
    e[rest] = f = _first_mismatch(table, rows[rest], leads[rest], r0, bound)
    more = (f == bound) & (bound < cap[rest])  # matched all of their span: go on from its end
    m = rest[more]
    e[m] = lcp_with_leaders(table, rows[m], leads[m], bound[more], cap[m])
    return e


def _subgroups(rows: np.ndarray, gid: np.ndarray, key: np.ndarray):
    """Runs of equal (gid, key) with >= 2 rows, stable (rows keep their order) -> (positions into
    the inputs, sub-group id per kept position, sub-group starts)."""
    if np.can_cast(key.dtype, np.int32) and gid.size and int(gid[-1]) < (1 << 30):  # gid ascends
        o = np.argsort((gid << 32) + (key.astype(np.int64) + (1 << 31)), kind="stable")
    else:
        o = np.lexsort((key, gid))
    g, k = gid[o], key[o]
    new = np.ones(o.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (k[1:] != k[:-1])
    rid = np.cumsum(new) - 1
    size = np.bincount(rid)
    keep = size[rid] >= 2
    o, rid = o[keep], rid[keep]
    new = np.ones(o.size, dtype=bool)
    new[1:] = rid[1:] != rid[:-1]
    return o, np.cumsum(new) - 1, np.flatnonzero(new)


def auto_forest(table: np.ndarray, full: np.ndarray, pays):
    """The prefix forest of ``table``'s rows over their first ``full`` blocks, folded by ``pays``."""
    bsz = full.size
    cand = np.flatnonzero(full > 0)
    if cand.size < 2:
        return _empty(bsz)
    # level 0: group by the first block (cand is ascending, the sort is stable)
    o, gid, gstart = _subgroups(cand, np.zeros(cand.size, np.int64), table[cand, 0])
    if not gstart.size:
        return _empty(bsz)  # no two rows share a first block: flat, without reading further
    rows = cand[o]
    c = np.zeros(gstart.size, dtype=np.int64)   # first column of each group's own range
    e = np.full(rows.size, -1, dtype=np.int64)  # LCP with the group's leader, -1: not measured
    kd = np.zeros(bsz, dtype=np.int64)           # kept depth per request
    fr = full[rows]
    ptr_parts, mem_parts, start_parts, end_parts = [], [], [], []
    while gstart.size:
        lead = rows[gstart]
        e[gstart] = fr[gstart]
        t = np.flatnonzero(e < 0)
        if t.size:
            lt = lead[gid[t]]
            e[t] = lcp_with_leaders(table, rows[t], lt, c[gid[t]] + 1, np.minimum(fr[t], full[lt]))
        d = np.minimum.reduceat(e, gstart)
        n = np.diff(np.append(gstart, rows.size))
        pk = kd[lead]
        keep = pays(n, d - pk)
        if keep.any():
            el = keep[gid]
            kd[rows[el]] = d[gid[el]]
            ptr_parts.append(n[keep])
            mem_parts.append(rows[el])
            start_parts.append(pk[keep])
            end_parts.append(d[keep])
        # children: members with a block at their group's depth, sub-grouped by it
        dg = d[gid]
        live = np.flatnonzero(fr > dg)
        if live.size < 2:
            break
        o, sub, gstart = _subgroups(rows[live], gid[live], table[rows[live], dg[live]])
        if not gstart.size:
            break
        p = live[o]
        c = d[gid[p[gstart]]]
        keep_e = e[p] > dg[p]  # in the leader's sub-group: the measured LCP stays valid
        rows, gid, fr = rows[p], sub, fr[p]
        e = np.where(keep_e, e[p], -1)
    if not ptr_parts:
        return _empty(bsz)[:4] + (kd,)
    sizes = np.concatenate(ptr_parts)
    ptr = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    return (ptr, np.concatenate(mem_parts), np.concatenate(start_parts).astype(np.int64),
            np.concatenate(end_parts).astype(np.int64), kd)


def group_forest(table: np.ndarray, full: np.ndarray, groups, pays):
    """Explicit (laminar) groups from the scheduler; each is verified: only the blocks common to
    all its members are shared."""
    bsz = full.size
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"groups must be a list of lists of batch indices, got {type(groups).__name__}")
    gs = []
    for i, g in enumerate(groups):
        arr = np.asarray(g)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"groups[{i}] must be a 1-D list of integer batch indices")
        arr = arr.astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= bsz):
            raise ValueError(f"groups[{i}] holds batch indices outside [0, {bsz})")
        if np.unique(arr).size != arr.size:
            raise ValueError(f"groups[{i}] repeats a batch index")
        gs.append(arr)
    owner = np.full(bsz, -1, dtype=np.int64)
    kd = np.zeros(bsz, dtype=np.int64)
    ptr, members, starts, ends = [0], [], [], []
    for gi in sorted(range(len(gs)), key=lambda i: -gs[i].size):  # parents before children
        g = gs[gi]
        if g.size == 0:
            continue
        if np.unique(owner[g]).size != 1:
            raise ValueError(f"groups must nest or be disjoint; groups[{gi}] straddles another group")
        owner[g] = gi
        cap = int(full[g].min())
        depth = cap
        if g.size > 1 and cap > 0:
            lead = np.full(g.size - 1, g[0])
            depth = int(lcp_with_leaders(table, g[1:], lead, np.full(g.size - 1, kd[g[0]]),
                                         np.full(g.size - 1, cap)).min())
        pk = int(kd[g[0]])
        if g.size < 2 or depth <= pk or not pays(np.array([g.size]), np.array([depth - pk]))[0]:
            continue
        kd[g] = depth
        members.append(np.sort(g))
        ptr.append(ptr[-1] + g.size)
        starts.append(pk)
        ends.append(depth)
    if not members:
        return _empty(bsz)[:4] + (kd,)
    return (np.asarray(ptr, np.int64), np.concatenate(members), np.asarray(starts, np.int64),
            np.asarray(ends, np.int64), kd)
