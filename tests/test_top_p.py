"""Top-p floors (paged_backend/top_p.py, kernels/top_p.py) against a plain fp64 reference of the rule:
a token stays while the mass of the tokens strictly more likely than it is < top_p of the mass of
the tokens >= the row's floor. Marked ``kernel``: the Triton search runs under the interpreter, and
the sorted torch version without it; on the GPU both, bit for bit each other's floors."""
import math

import pytest
import torch

from paged_backend.top_p import top_p_floor, top_p_floor_torch

pytestmark = pytest.mark.kernel
GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")])


def reference(row: list[float], floor: float, p: float) -> tuple[float, float]:
    """(the floor after top-p, the margin: how near top_p * Z the mass ahead of any tie group comes,
    over Z) by plain Python in fp64 on one row's values."""
    vals = sorted((a for a in row if a >= floor), reverse=True)
    if p >= 1.0 or not vals or vals[0] == -math.inf:
        return floor, math.inf
    m = vals[0]
    e = [math.exp(a - m) if a > -math.inf else 0.0 for a in vals]
    z = math.fsum(e)
    keep, ahead, margin, i = vals[0], 0.0, math.inf, 0
    partials = []  # the exact sum of e[:i] (as math.fsum keeps it): each mass ahead is fsum(e[:j])'s
    while i < len(vals):
        j = i
        while j < len(vals) and vals[j] == vals[i]:
            j += 1
        if i:  # (nothing is ahead of the first group: no rounding there)
            margin = min(margin, abs(ahead - p * z) / z)
        if ahead < p * z:
            keep = vals[i]
        for x in e[i:j]:
            _add_exact(partials, x)
        ahead = math.fsum(partials)
        i = j
    return max(keep, floor), margin


def _add_exact(partials: list, x: float) -> None:
    """Adds ``x`` to the non-overlapping partials whose sum is a running sum, exactly (Shewchuk's
    algorithm, as Python's math.fsum): math.fsum(partials) is then the correctly rounded sum so far,
    in time linear in the terms where fsum of each prefix was quadratic."""
    i = 0
    for y in partials:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            partials[i] = lo
            i += 1
        x = hi
    partials[i:] = [x]


def lm_rows(s: int, v: int, temperature: float, g: torch.Generator) -> torch.Tensor:
    """Rows shaped like a language model's, as the sampler sees them: a long tail, a few tokens far above
    it, bf16-rounded logits divided by the temperature in fp32."""
    x = torch.randn(s, v, generator=g) * 2.0
    x.scatter_(1, torch.randint(0, v, (s, 8), generator=g), 8.0 + 4.0 * torch.rand(s, 8, generator=g))
    return x.bfloat16().float() / temperature


def check_rows(x, floor, top_p, got, min_margin=1e-6):
    """Every row whose reference margin exceeds ``min_margin`` has the reference's floor -> rows checked."""
    checked = 0
    for r in range(x.shape[0]):
        want, margin = reference(x[r].tolist(), floor[r].item(), top_p[r].item())
        if margin > min_margin:
            assert got[r].item() == want, (r, got[r].item(), want, top_p[r].item())
            checked += 1
    return checked


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_floors_are_the_rule(device):
    """Tie-heavy rows (tie groups stay or go whole), -inf entries, a row of one finite token, -0.0
    tied with +0.0, floors from earlier filters (none, a value of the row, a value between two),
    top_p from 1e-6 (the most likely tokens only) to off (>= 1, inf)."""
    g = torch.Generator().manual_seed(0)
    for v in (1, 7, 300, 2000):
        x = torch.randint(-4, 5, (12, v), generator=g).float() / 2
        x[0, :3] = float("-inf")
        x[5, 1:] = float("-inf")
        x[6] = torch.where(x[6] == 0, -0.0, x[6])
        x[7, : v // 2] = -0.0
        x[7, v // 2:] = 0.0
        floor = torch.full((12,), float("-inf"))
        floor[8], floor[9], floor[10] = x[8].max() - 1.5, 0.5, 0.25
        for p in (1e-6, 0.3, 0.5, 0.9, float("inf")):
            top_p = torch.full((12,), p)
            top_p[11] = 0.7
            got = top_p_floor(x.to(device), floor.to(device), top_p.to(device)).cpu()
            assert check_rows(x, floor, top_p, got) >= 11, (v, p)


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_floors_of_language_model_rows(device):
    """Long-tail rows at several temperatures and top_p levels: the reference's floor wherever the mass
    at the boundary is not within 1e-6 of top_p (where fp32 exponentials may round either way)."""
    g = torch.Generator().manual_seed(1)
    v = 3000 if device == "cpu" else 49152
    for t in (0.7, 1.3):
        x = lm_rows(8, v, t, g)
        for p in (0.5, 0.9, 0.95):
            top_p = torch.full((8,), p)
            floor = torch.full((8,), float("-inf"))
            got = top_p_floor(x.to(device), floor.to(device), top_p.to(device)).cpu()
            assert check_rows(x, floor, top_p, got) >= 6, (t, p)


def test_the_torch_version_is_the_rule():
    """The torch version (the CPU engine's path) on the tie-heavy and long-tail rows of the tests above,
    with and without a floor on every row (then the CPU sorts only as many values as a row keeps)."""
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randint(-4, 5, (6, 400), generator=g).float() / 2, lm_rows(6, 400, 1.0, g)])
    x[1, 7:] = float("-inf")
    floor = torch.full((12,), float("-inf"))
    floor[2] = 0.5
    kth = torch.topk(x, 30, dim=-1).values[:, -1]  # (every row floored: the CPU sorts only what rows keep)
    for p in (1e-6, 0.4, 0.9, float("inf")):
        top_p = torch.full((12,), p)
        assert check_rows(x, floor, top_p, top_p_floor_torch(x, floor, top_p)) >= 10
        assert check_rows(x, kth, top_p, top_p_floor_torch(x, kth, top_p)) >= 10


def test_strided_rows():
    """Rows of a wider tensor (a row stride other than V) and a column-strided view give the floors of
    their contiguous copies."""
    g = torch.Generator().manual_seed(6)
    big = lm_rows(4, 700, 1.0, g)
    floor, top_p = torch.full((4,), float("-inf")), torch.full((4,), 0.8)
    want = top_p_floor(big[:, :500].contiguous(), floor, top_p)
    assert torch.equal(top_p_floor(big[:, :500], floor, top_p), want)
    assert torch.equal(top_p_floor(big[:, :1000:2][:, :250], floor, top_p),
                       top_p_floor(big[:, :1000:2][:, :250].contiguous(), floor, top_p))


def test_off_rows_keep_their_floor_and_empty_inputs():
    x = torch.randn(3, 50)
    floor = torch.tensor([float("-inf"), 0.1, -0.3])
    assert torch.equal(top_p_floor(x, floor, torch.tensor([1.0, float("inf"), 1.5])), floor)
    assert top_p_floor(torch.zeros(0, 5), torch.zeros(0), torch.zeros(0)).shape == (0,)


@pytest.mark.parametrize("args,err,match", [
    ((torch.zeros(2, 5, dtype=torch.float16), torch.zeros(2), torch.ones(2)), TypeError, "x must have dtype"),
    ((torch.zeros(2, 5), torch.zeros(3), torch.ones(2)), ValueError, "floor must have 2 entries"),
    ((torch.zeros(2, 5), torch.zeros(2), torch.ones(2, 1)), ValueError, "top_p must have 1 dims"),
    ((torch.zeros(5), torch.zeros(2), torch.ones(2)), ValueError, "x must have 2 dims"),
    ((torch.zeros(2, 5), torch.zeros(2, dtype=torch.float64), torch.ones(2)), TypeError, "floor must have dtype"),
])
def test_bad_arguments_are_named(args, err, match):
    with pytest.raises(err, match=match):
        top_p_floor(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_search_is_the_sorted_versions_bits():
    """64 x 128,256 and 256 x 49,152 long-tail rows, with floors from a top-k and without: the search's
    floors equal the sorted fp64 version's (both take torch's exp bits), and repeat bit for bit."""
    g = torch.Generator().manual_seed(3)
    for s, v in ((64, 128256), (256, 49152)):
        for t in (0.7, 1.0, 1.3):
            x = lm_rows(s, v, t, g).cuda()
            kth = torch.topk(x, 50, dim=-1).values[:, -1]
            for floor in (torch.full((s,), float("-inf"), device="cuda"), torch.where(torch.arange(s, device="cuda") % 2 == 0, kth, float("-inf"))):
                for p in (0.5, 0.9, 0.95, 0.999):
                    top_p = torch.full((s,), p, device="cuda")
                    got = top_p_floor(x, floor, top_p)
                    assert torch.equal(got, top_p_floor_torch(x, floor, top_p)), (s, v, t, p)
                    assert torch.equal(got, top_p_floor(x, floor, top_p))


def test_rows_cut_into_chunks(monkeypatch):
    """Rows whose values several programs share (the GPU's blocks: few rows, a long vocabulary): their
    chunks' masses fold into one bracket per row."""
    import paged_backend.kernels.top_p as K
    monkeypatch.setattr(K, "BLOCK", 256)
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.randint(-4, 5, (1, 2000), generator=g).float() / 2, lm_rows(1, 2000, 1.0, g)])
    floor = torch.tensor([float("-inf"), -1.0])
    for p in (1e-6, 0.3, 0.9, 0.999):
        top_p = torch.full((2,), p)
        assert check_rows(x, floor, top_p, top_p_floor(x, floor, top_p)) == 2, p


@pytest.mark.parametrize("nc", [2, 4, 8, 16, 32])
def test_the_passes_settle_any_bracket_of_int32_keys(nc):
    """The search's arithmetic (kernels/top_p.py: cuts at lo + (w * j) // NC, j = 1..NC-1) taking the
    widest part at every pass from the widest bracket there is (-inf's key to +inf's): settled
    (width 0) after ``passes(NC)``, and not one pass earlier (the count is tight)."""
    from paged_backend.kernels.top_p import passes
    lo, hi = -2139095041, 2139095040  # the keys of -inf and +inf
    widths = []
    for _ in range(passes(nc)):
        w = hi - lo
        cuts = [lo + (w * j) // nc for j in range(1, nc)]
        parts = [(lo, cuts[0])] + [(a + 1, b) for a, b in zip(cuts, cuts[1:])] + [(cuts[-1] + 1, hi)]
        lo, hi = max(parts, key=lambda p: p[1] - p[0])
        widths.append(hi - lo)
    assert widths[-1] <= 0 < widths[-2]
