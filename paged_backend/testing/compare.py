"""Comparing an attention state with the fp64 reference, with tolerances per dtype.

``out`` is judged by its relative error ``||out - ref|| / ||ref||`` (Frobenius, over the whole
tensor) against ``TOL[q dtype]``; ``lse`` (float32, natural log) by its largest absolute error
over the rows whose reference is finite, against ``LSE_TOL``, and its ``-inf`` pattern (rows
without keys) must be the reference's exactly. fp8 caches: the reference runs on the dequantized
cache and the tolerance is the query dtype's (the kernels convert fp8 values exactly; what
differs is the query's and the probabilities' rounding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
LSE_TOL = 1e-3


def tolerance(q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> float:
    """The relative error allowed on ``out`` for queries of ``q_dtype`` (any cache dtype: fp8
    caches are compared on their dequantized values)."""
    return TOL[q_dtype]


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


@dataclass
class Check:
    """Result of :func:`check_state`: ``ok``; ``problem`` (the first failed rule, "" if ok);
    ``out_err`` (relative); ``lse_err`` (max abs, None when lse was not given; inf when the
    -inf pattern differs or lse holds NaN)."""
    ok: bool
    problem: str
    out_err: float
    lse_err: float | None


def check_state(out, lse, ref_o, ref_lse, dtype, tol=None, lse_tol=LSE_TOL) -> Check:
    """Compares ``out [T, Hq, D]`` (and ``lse [T, Hq]`` unless None) with the reference state;
    never raises. ``tol``: the relative error allowed on ``out`` (default ``TOL[dtype]``)."""
    tol = TOL[dtype] if tol is None else tol
    if tuple(out.shape) != tuple(ref_o.shape):
        return Check(False, f"out shape {tuple(out.shape)} != {tuple(ref_o.shape)}", math.inf, None)
    finite = bool(torch.isfinite(out).all())
    err = rel_err(out, ref_o) if finite else math.inf
    problem = "" if finite else "output has NaN/inf"
    if not problem and not err <= tol:
        problem = f"rel err {err:.3g} > {tol}"
    dl = None
    if lse is not None:
        if tuple(lse.shape) != tuple(ref_lse.shape):
            return Check(False, problem or f"lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}", err, math.inf)
        lse, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
        fin = torch.isfinite(ref_lse)
        if torch.isnan(lse).any():
            dl, why = math.inf, "lse has NaN"
        elif not torch.equal(torch.isfinite(lse), fin):
            dl, why = math.inf, _pattern_problem(lse, fin)
        else:
            dl = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
            why = "" if dl <= lse_tol else f"lse abs err {dl:.3g} > {lse_tol}"
        problem = problem or why
    return Check(not problem, problem, err, dl)


def _pattern_problem(lse, fin) -> str:
    """Says where ``lse``'s -inf pattern differs from the reference's (``fin``: its finite rows)."""
    should_inf = ~fin & torch.isfinite(lse)   # rows without keys that got a finite lse
    should_fin = fin & ~torch.isfinite(lse)
    parts = []
    if should_inf.any():
        parts.append(f"{int(should_inf.sum())} entries without keys have a finite lse "
                     f"(e.g. {lse[should_inf][0].item():.6g}) instead of -inf")
    if should_fin.any():
        parts.append(f"{int(should_fin.sum())} entries with keys have lse {lse[should_fin][0].item()}")
    return "lse -inf pattern differs: " + "; ".join(parts)


def assert_close_state(out, lse, ref_o, ref_lse, dtype, tol=None):
    """Raises ``AssertionError`` (naming the rule) unless the state matches the reference:
    ``out`` finite with relative error <= ``tol`` (default ``TOL[dtype]``); ``lse`` (if not None)
    without NaN, with the reference's -inf pattern and abs error <= ``LSE_TOL``."""
    c = check_state(out, lse, ref_o, ref_lse, dtype, tol)
    assert c.ok, c.problem
