"""The prefix forest of a decode batch, found from its block tables (host numpy).

Requests share their leading *full* blocks when those hold the same block ids (a partially filled
last block is never shared). The forest is a compressed trie over the rows' full blocks, built top
down, one vectorised pass per tree level (a loop over levels only: none over blocks or requests):

1. rows whose first full block is held by another row are grouped by that block (one sort of
   one column); a group of >= 2 rows is a node candidate starting at column ``c = 0``;
2. the group's depth ``d`` is found from ``c + 1`` on (:func:`group_depths`): a probe row per group
   is compared with the group's *leader* (its smallest batch index) at a few sampled columns;
   where they differ bounds ``d``. Then every row is compared with the row before it in the group
   up to that bound, one contiguous span each (a block of rows is gathered once and compared
   with itself shifted by a row): ``d`` is the first column where any two of them differ, capped
   at the group's full blocks. Every member then holds the leader's ids on ``[c, d)``, compared id
   by id (no hashing, so nothing is shared on a collision);
3. members with a block at column ``d`` are sub-grouped by it (one sort of (group, id, row)
   packed into an int64); a sub-group of >= 2 rows is a child candidate starting at ``d``, its
   smallest batch index the leader. A row is read about up to its group's depth: past it only
   where the probe shares more than the group, and there a block within one group stops at the
   smallest mismatch found so far (the blocks go in a spread order, to meet one early).

Nodes are folded by the cost model as they are produced (parents before children): a node's range
starts at its nearest *kept* ancestor's depth. ``auto_forest`` and ``group_forest`` return
``(members CSR ptr, members, start blk, end blk, level, kept depth per request)``, a node's level
being its kept ancestors (its place in each member's chain); nodes are parents first and each
node's members are ascending batch indices.
"""
from __future__ import annotations

import numpy as np

_STEP = 64            # columns between a probe's sampled ids
_SAMPLES = 1 << 12    # sampled ids per level, about, beyond which the step grows
_BLOCK = 1 << 16      # ids compared per row block: the block's rows and its mask stay in L2


def _empty(bsz: int):
    z = np.zeros(0, np.int64)
    return np.zeros(1, np.int64), z, z, z.copy(), z.copy(), np.zeros(bsz, np.int64)


def group_depths(table: np.ndarray, rows: np.ndarray, gstart: np.ndarray, a: np.ndarray,
                 cap: np.ndarray) -> np.ndarray:
    """Per group g (``rows[gstart[g]:gstart[g + 1]]``, >= 2 rows, the first one its leader, all equal
    before ``a[g]`` and holding ``cap[g] >= a[g]`` full blocks): the first column in ``[a[g], cap[g])``
    where a member differs from the leader, else ``cap[g]``. Exact: id by id.

    A few sampled ids bound each group's depth (:func:`_bounds`). Then each row is compared with
    the one before it up to that bound, one contiguous span each; the smallest of those first
    mismatches is the depth (if every pair agrees on ``[a, x)``, every member agrees with the
    leader there)."""
    size = np.empty_like(gstart)
    size[:-1] = gstart[1:] - gstart[:-1]
    size[-1] = rows.size - gstart[-1]
    if not a.all():  # chains read from the column before their range: settle column 0 first
        head = table[rows, 0]
        same = np.logical_and.reduceat(head == head[gstart].repeat(size), gstart)
        cap = np.where((a > 0) | same, cap, 0)  # a group differing there has depth 0
        a = np.minimum(np.maximum(a, 1), cap)
    span = int((cap - a).max())
    bound = _bounds(table, rows, gstart, size, a, cap, span) if span > _STEP else cap
    more = (bound > a).nonzero()[0]
    if more.size == gstart.size:
        return _chain_min(table, rows, gstart, a, bound)
    if more.size:
        n = size[more]
        at = np.cumsum(n) - n
        bound[more] = _chain_min(table, rows[(gstart[more] - at).repeat(n) + np.arange(int(at[-1] + n[-1]))], at,
                                 a[more], bound[more])
    return bound


def _bounds(table, rows, gstart, size, a, cap, span: int) -> np.ndarray:
    """A column per group (``group_depths``' arguments) at or past its depth where it most likely
    ends: any column where two of its rows differ bounds the depth. A probe (the middle row) is
    compared with the leader at every ``step``-th column from ``a``, then, in a group of more
    than two rows, at the _STEP columns up to the first sampled one where they differ (the
    group most likely ends there; a chain past it would find mismatches in every block). ``step``
    is _STEP columns, or more where many groups would sample more than _SAMPLES ids in all."""
    step = max(_STEP, -(-span * gstart.size // _SAMPLES))
    cols = np.minimum(a[:, None] + step * np.arange(-(-span // step)), (cap - 1)[:, None])  # [G, S]
    lead, probe = rows[gstart], rows[gstart + size // 2]
    c = _first_differing(table, lead, probe, cols)
    bound = np.where(c >= 0, c, cap)
    near = ((c > a) & (size > 2)).nonzero()[0]  # a big group: then the _STEP columns up to it
    if near.size:
        c = c[near, None]
        cols = np.minimum(np.maximum(c - _STEP, a[near, None]) + np.arange(_STEP + 1), c)
        bound[near] = _first_differing(table, lead[near], probe[near], cols)
    return bound


def _first_differing(table: np.ndarray, lead: np.ndarray, probe: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Per group g: the first of the columns ``cols[g]`` (ascending) where ``table[probe[g]]`` differs
    from ``table[lead[g]]``, else -1 (a few ids each: one cache line apiece)."""
    differ = table[lead[:, None], cols] != table[probe[:, None], cols]
    first = differ.argmax(axis=1)
    at = np.arange(cols.shape[0])
    return np.where(differ[at, first], cols[at, first], -1)


def _chain_min(table: np.ndarray, rows: np.ndarray, gstart: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per group g (``rows[gstart[g]:gstart[g + 1]]``, >= 2 rows; ``1 <= a[g] < b[g]``, the group's
    rows equal before ``a[g]``): the first column in ``[a[g], b[g])`` where two consecutive rows of
    the group differ, else ``b[g]`` - the smallest LCP of a member with the group's first row.

    Each row is compared with the one before it, so a row block is gathered once and compared
    with itself shifted by a row (two contiguous views: the fastest compare numpy has); the pairs
    straddling two groups are masked out. A block reads from one column before its rows' ranges
    (equal in all of them), so a pair's argmax is 0 only where it does not differ, and a block
    whose mask holds no mismatch at all (the usual case: groups end where their probe says) needs
    no argmax per row. Blocks of ~_BLOCK ids; groups whose ranges differ much go in order of
    ``b``, so that a block's columns stay close to its rows'."""
    n = rows.size
    size = np.empty_like(gstart)
    size[:-1] = gstart[1:] - gstart[:-1]
    size[-1] = n - gstart[-1]
    lo, hi = int(a.min()), int(b.max())
    total = int(((b - a) * (size - 1)).sum())
    order = None
    if (hi - lo) * (n - gstart.size) <= 1.25 * total:  # about one range: blocks of rows over it
        step = max(1, _BLOCK // (hi - lo + 1))
        edges = np.arange(1, n + step, step)
        edges[-1] = n
        cols = [(lo, hi)] * (edges.size - 1)
        start = lo - 1  # the column of each pair's mask's first entry
    else:
        order = np.argsort(b, kind="stable")
        size, a, b = size[order], a[order], b[order]
        at = np.cumsum(size) - size  # the groups' new starts
        rows = rows[(gstart[order] - at).repeat(size) + np.arange(n)]
        gstart = at
        ar, br = a.repeat(size), b.repeat(size)
        ar[gstart], br[gstart] = hi, lo  # a group's first row starts no pair
        cum = np.cumsum(np.maximum(br - ar, 0))
        edges = np.unique(np.concatenate(([1], cum.searchsorted(np.arange(_BLOCK, total, _BLOCK)) + 1, [n])))
        x0 = np.minimum.reduceat(ar, edges[:-1])
        cols = zip(x0.tolist(), np.maximum.reduceat(br, edges[:-1]).tolist())
        start = np.concatenate(([0], (x0 - 1).repeat(np.diff(edges))))
    cross = gstart[1:]  # pairs straddling two groups
    cut = cross.searchsorted(edges)
    cross = cross - edges[:-1].repeat(cut[1:] - cut[:-1])  # each one's row in its block's mask
    first = np.zeros(n, dtype=np.intp)  # each pair's first mismatch in its mask; 0: none
    # A block within one group reads only up to the group's smallest mismatch found so far; the
    # blocks go in a spread order, so that a run of rows ending early is met early.
    one = np.where(cut[1:] == cut[:-1], gstart.searchsorted(edges[:-1], side="right") - 1, -1).tolist()
    low, cut, cols = b.tolist(), cut.tolist(), list(cols)
    i0s, i1s = edges[:-1].tolist(), edges[1:].tolist()
    spread = max(1, int(len(cols) ** 0.5))
    for k in sorted(range(len(cols)), key=lambda k: k % spread):
        i0, i1, (c0, c1) = i0s[k], i1s[k], cols[k]
        if one[k] >= 0:
            c1 = min(c1, low[one[k]])
            if c1 <= c0:
                continue
        g = table[rows[i0 - 1:i1], c0 - 1:c1]  # one gather; a fresh (contiguous) mask is the fastest to write
        neq = g[1:] != g[:-1]
        neq[cross[cut[k]:cut[k + 1]]] = False
        if neq.reshape(-1)[neq.argmax()]:  # (one flat pass)
            f = first[i0:i1]
            neq.argmax(axis=1, out=f)  # stops at a pair's first mismatch
            if one[k] >= 0:
                low[one[k]] = min(low[one[k]], c0 - 1 + int(f[f > 0].min()))
    found = np.where(first > 0, first + start, hi)
    d = np.minimum(np.minimum.reduceat(found, gstart), b)
    if order is not None:
        d[order] = d.copy()
    return d


def _subgroups(gid, key: np.ndarray):
    """Runs of equal (gid, key) with >= 2 rows, stable (rows keep their order); ``gid`` ascends
    (None: one group). -> (positions into the inputs, sub-group starts, sub-group sizes)."""
    n = key.size
    pb = (n - 1).bit_length()
    gb = int(gid[-1]).bit_length() if gid is not None else 0
    small = key.dtype.itemsize <= 4
    lo = (-(1 << 31) if key.dtype.kind == "i" else 0) if small else int(key.min())
    if gb + pb <= 31 and (small or (key.dtype.kind == "i" and int(key.max()) - lo < 1 << 32)):
        # (gid, key, position) in one int64: an unstable sort of distinct values keeps the order
        s = key.astype(np.int64)
        s -= lo
        s <<= pb
        s |= np.arange(n)
        if gid is not None:
            s |= gid << (32 + pb)
        s.sort()
        o = s & ((1 << pb) - 1)
        s >>= pb
        same = s[1:] == s[:-1]  # [n - 1] as the previous row
    else:
        o = key.argsort(kind="stable") if gid is None else np.lexsort((key, gid))
        k = key[o]
        same = k[1:] == k[:-1]
        if gid is not None:
            g = gid[o]
            same &= g[1:] == g[:-1]
    keep = np.zeros(n, dtype=bool)
    keep[1:] = same
    keep[:-1] |= same
    head = keep.copy()  # a kept run's first row: kept, and not as the previous row
    np.greater(keep[1:], same, out=head[1:])
    o = o[keep]
    starts = head[keep].nonzero()[0]
    sizes = np.empty_like(starts)
    sizes[:-1] = starts[1:] - starts[:-1]
    sizes[-1:] = o.size - starts[-1:]
    return o, starts, sizes


def auto_forest(table: np.ndarray, full: np.ndarray, pays):
    """The prefix forest of ``table``'s rows over their first ``full`` blocks, folded by ``pays``."""
    bsz = full.size
    cand = (full > 0).nonzero()[0]
    if cand.size < 2:
        return _empty(bsz)
    # level 0: group by the first block (cand is ascending, the sort is stable)
    o, gstart, n = _subgroups(None, table[cand, 0])
    if not gstart.size:
        return _empty(bsz)  # no two rows share a first block: flat, without reading further
    rows = cand[o]
    gid = np.arange(gstart.size).repeat(n)  # [R] each row's group
    c = np.zeros(gstart.size, dtype=np.int64)   # [G] each group's key column: equal in all its rows
    kd = np.zeros(bsz, dtype=np.int64)           # kept depth per request
    kc = np.zeros(bsz, dtype=np.int64)           # kept nodes per request
    fr = full[rows]
    ptr_parts, mem_parts, start_parts, end_parts, level_parts = [], [], [], [], []
    while True:
        lead = rows[gstart]
        d = group_depths(table, rows, gstart, c + 1, np.minimum.reduceat(fr, gstart))
        dg = d[gid]
        pk = kd[lead]
        keep = pays(n, d - pk)
        if keep.any():
            el = keep[gid]
            m = rows[el]
            kd[m] = dg[el]
            ptr_parts.append(n[keep])
            mem_parts.append(m)
            start_parts.append(pk[keep])
            end_parts.append(d[keep])
            level_parts.append(kc[lead[keep]])
            kc[m] += 1
        # children: members with a block at their group's depth, sub-grouped by it
        live = (fr > dg).nonzero()[0]
        if live.size < 2:
            break
        rl = rows[live]
        o, gstart, n = _subgroups(gid[live], table[rl, dg[live]])
        if not gstart.size:
            break
        p = live[o]
        rows, fr, c = rl[o], fr[p], dg[p[gstart]]
        gid = np.arange(gstart.size).repeat(n)
    if not ptr_parts:
        return _empty(bsz)[:5] + (kd,)
    sizes = np.concatenate(ptr_parts)
    ptr = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    return (ptr, np.concatenate(mem_parts), np.concatenate(start_parts).astype(np.int64),
            np.concatenate(end_parts).astype(np.int64), np.concatenate(level_parts), kd)


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
    kc = np.zeros(bsz, dtype=np.int64)  # kept nodes per request
    ptr, members, starts, ends, levels = [0], [], [], [], []
    for gi in sorted(range(len(gs)), key=lambda i: -gs[i].size):  # parents before children
        g = gs[gi]
        if g.size == 0:
            continue
        if np.unique(owner[g]).size != 1:
            raise ValueError(f"groups must nest or be disjoint; groups[{gi}] straddles another group")
        owner[g] = gi
        cap = int(full[g].min())
        depth = cap
        if g.size > 1 and cap > kd[g[0]]:
            depth = int(group_depths(table, g, np.zeros(1, np.int64), kd[g[:1]], np.array([cap]))[0])
        pk = int(kd[g[0]])
        if g.size < 2 or depth <= pk or not pays(np.array([g.size]), np.array([depth - pk]))[0]:
            continue
        kd[g] = depth
        members.append(np.sort(g))
        ptr.append(ptr[-1] + g.size)
        starts.append(pk)
        ends.append(depth)
        levels.append(int(kc[g[0]]))
        kc[g] += 1
    if not members:
        return _empty(bsz)[:5] + (kd,)
    return (np.asarray(ptr, np.int64), np.concatenate(members), np.asarray(starts, np.int64),
            np.asarray(ends, np.int64), np.asarray(levels, np.int64), kd)
