"""Running the cases against one adapter: :func:`run_suite` -> a list of :class:`Result`;
:func:`format_table` prints them."""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from .adapters import Adapter, NotSupported, get_adapter
from .cases import CASES, QUICK, Case
from .compare import check_state, tolerance

PASSED, FAILED, NOT_SUPPORTED = "passed", "failed", "not supported"


@dataclass
class Result:
    """One case's outcome. ``out_err``: relative error of ``out``; ``lse_err``: max abs error of
    ``lse`` (None: not compared); ``tol``: the tolerance on ``out_err``; ``note``: why it failed
    or is not supported, or what was compared."""
    case: str
    op: str
    status: str
    out_err: float | None = None
    lse_err: float | None = None
    tol: float | None = None
    note: str = ""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_case(adapter: Adapter, case: Case, device="cpu", seed: int = 0) -> Result:
    """Builds the case, runs it through the adapter and compares with the fp64 reference. Never
    raises: an exception in ``supports`` or ``run`` is a failure (its message in ``note``), :class:`NotSupported`
    is "not supported"."""
    tol = tolerance(case.dtype, case.kv_dtype)
    try:
        ok = adapter.supports(case)
        if ok is not True:
            return Result(case.name, case.op, NOT_SUPPORTED, note=ok if isinstance(ok, str) and ok else "")
        inp = case.build(device, seed)
        out, lse = adapter.run(inp)
        ref_o, ref_lse = inp.reference()
    except NotSupported as e:
        return Result(case.name, case.op, NOT_SUPPORTED, note=str(e))
    except Exception as e:  # noqa: BLE001 - recorded as the case's failure
        last = traceback.extract_tb(e.__traceback__)[-1]
        return Result(case.name, case.op, FAILED, tol=tol,
                      note=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                           f"({last.filename.split('/')[-1]}:{last.lineno})")
    c = check_state(out, lse, ref_o, ref_lse, case.dtype, tol)
    note = c.problem or ("out only (no lse)" if lse is None else "")
    return Result(case.name, case.op, PASSED if c.ok else FAILED, c.out_err, c.lse_err, tol, note)


def run_suite(adapter="ours", device=None, quick: bool = False, cases=None, seed: int = 0, on_result=None) -> list:
    """Runs ``cases`` (default: ``QUICK`` if ``quick`` else ``CASES``; or names / Case objects)
    against ``adapter`` (an :class:`Adapter`, a built-in name or ``"module:attr"``) on ``device``
    (default cuda if available, else cpu) -> [Result]. ``on_result(result, seconds)``: called as
    each case ends (a peer's first calls can compile for minutes)."""
    device = device or default_device()
    adapter = get_adapter(adapter, device)
    if cases is None:
        cases = QUICK if quick else CASES
    by_name = {c.name: c for c in CASES}
    results = []
    for c in cases:
        t0 = time.perf_counter()
        results.append(run_case(adapter, by_name[c] if isinstance(c, str) else c, device, seed))
        if on_result is not None:
            on_result(results[-1], time.perf_counter() - t0)
    return results


def _num(x) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2e}"


def format_table(results, title: str = "") -> str:
    """A plain-text (Markdown) table: case, op, status, out rel err, lse abs err, tol, note; and a
    count line."""
    rows = [("case", "op", "status", "out rel err", "lse abs err", "out tol", "note")]
    rows += [(r.case, r.op, r.status, _num(r.out_err), _num(r.lse_err), _num(r.tol), r.note) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    out = ([title, ""] if title else []) + [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in rows[1:]]
    out += ["", summary(results)]
    return "\n".join(out)


def summary(results) -> str:
    n = {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, NOT_SUPPORTED)}
    return f"{n[PASSED]} passed, {n[FAILED]} failed, {n[NOT_SUPPORTED]} not supported ({len(results)} cases)"


def as_dicts(results) -> list:
    """JSON-ready results (inf becomes the string "inf")."""
    return [{k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(r).items()}
            for r in results]
