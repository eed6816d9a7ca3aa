"""paged_backend.testing: the conformance suite, public and stable.

- :mod:`.reference`: float64 dense references (decode, prefill causal bottom-right / chunked,
  cascade; windows, soft-cap, sinks; fp8 via :func:`dequantize`), natural-log LSE;
- :mod:`.inputs`: builders (shuffled pages, ragged and empty rows, ours and vLLM's KV layouts,
  NaN/inf outside every row, strided metadata, padding rows, fp8 caches, shared prefixes);
- :mod:`.compare`: :func:`assert_close_state`, :func:`check_state`, tolerances per dtype;
- :mod:`.cases`, :mod:`.adapters`, :mod:`.suite`: the named cases, one adapter per
  implementation, the runner. ``python -m paged_backend.testing --impl ours`` (docs/testing.md).

Importing this package imports torch, not Triton or the ops.
"""
from .adapters import Adapter, NotSupported, get_adapter
from .cases import CASES, QUICK, Case, CaseInputs
from .compare import LSE_TOL, TOL, Check, assert_close_state, check_state, rel_err, tolerance
from .reference import attend, cascade_reference, decode_reference, dequantize, gather_kv, prefill_reference
from .suite import Result, format_table, run_case, run_suite

__all__ = ["Adapter", "NotSupported", "get_adapter", "CASES", "QUICK", "Case", "CaseInputs", "LSE_TOL", "TOL",
           "Check", "assert_close_state", "check_state", "rel_err", "tolerance", "attend", "cascade_reference",
           "decode_reference", "dequantize", "gather_kv", "prefill_reference", "Result", "format_table",
           "run_case", "run_suite"]
