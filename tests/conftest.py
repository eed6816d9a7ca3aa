"""The two CPU test tiers (tests/run_cpu.sh).

Tier 1 (``bash tests/run_cpu.sh``, the README's command) runs every op, path and integration once;
tier 2 (``bash tests/run_cpu.sh --exhaustive``, which .ci/run runs after tier 1) runs the rest of
the matrices: the cases marked ``exhaustive`` here. Nothing is dropped: a case leaves tier 1 only
for tier 2.

Most of the matrices cost nothing on the torch path, so there they all stay in tier 1; under
``TRITON_INTERPRET=1`` (the second pass) each kernel case costs 0.3-6 s, so there tier 1 keeps, per
test function, a covering subset: every value of every axis (mode, layout, feature, block size,
dtype, ...) at least once, and where two axes pick a code path together (a feature with and without
a plan, say) every pair. Which cases stay, and why, is written next to each rule; the others are
marked ``exhaustive``. The two tiers of each pass together select exactly what the pass selected
before the split.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _idx(values, v):
    return list(values).index(v)


# test (file::function) -> keep(params): True for the cases that stay in tier 1. BOTH: in both passes;
# INTERP: under TRITON_INTERPRET=1 only (on the torch path every case stays in tier 1).
BOTH = {
    # world 4 is the superset: an empty middle rank (world > 2), the TP x CP mesh and the two-level
    # (hierarchical) merges only run there; worlds 2 and 3 run the same code with fewer ranks
    "test_parallel.py::test_parallel_gloo": lambda p: p["world"] == 4,
    "test_parallel.py::test_tree_merger_collectives_and_buffers": lambda p: p["world"] == 4,
    "test_merge_graphs.py::test_graph_path_logic": lambda p: p["world"] == 4,
    # prefix-cache hits and forked greedy samples: tier 1 checks them in test_engine_models'
    # test_greedy_equals_transformers_generate (every family); this is the same on the 135M model
    "test_engine.py::test_prefix_cache_hit_and_forked_greedy_samples": lambda p: False,
}

INTERP = {
    # the slot steps on the kernels once; with PAGED_BACKEND_DEBUG=1 (its host check, no kernel change)
    # on the torch path, and in tier 2
    "test_vllm_backend.py::test_cascade_from_request_slots_without_sync": lambda p: not p["debug"],
    # the graph path's buffers and padding rows run on the torch path in tier 1 (75 s in the
    # interpreter); test_window's test_decode_graph_step_with_window runs a plan update on the
    # kernels, test_engine_on_every_attention_path the engine on them, the kernel tests 0-length rows
    "test_engine_models.py::test_decode_graph_buffers_and_padding_on_the_cpu": lambda p: False,
    # planned x kv dtype x q dtype: each value once (3 of 12)
    "test_fp8.py::test_decode": lambda p: (p["planned"], p["kv_dtype"], p["q_dtype"]) in {
        (True, E4M3, F16), (False, E5M2, BF16), (True, E5M2, F32)},
    "test_fp8.py::test_prefill": lambda p: (p["kv_dtype"], p["q_dtype"]) in {(E4M3, F16), (E5M2, F32)},
    "test_fp8.py::test_cascade": lambda p: (p["kv_dtype"], p["window"]) in {(E4M3, None), (E5M2, 20)},
    # the scalar checks are one code path: 0.0 stays (and the string and tensor scales)
    "test_fp8.py::test_bad_scales": lambda p: not (isinstance(p["bad"], float) and p["bad"] != 0.0),
    # block size i with GQA i (so each block size, group and head dim 64/80/128 once), dtypes alternating
    "test_prefill.py::test_block_sizes_and_gqa":
        lambda p: _idx([1, 4, 16, 64, 256], p["bs"]) == p["gqa"] and p["dtype"] == (F32, F16)[p["gqa"] % 2],
    # the filters (top-k, top-p, min-p, ties) are torch code, run for every distribution on the torch
    # path; the kernel (gumbel_argmax) draws from all-finite logits (T1) and from filtered ones
    "test_sampler.py::test_draws_follow_the_exact_distribution": lambda p: p["name"] in ("T1", "all_three"),
    # each planning with two windows, each window with two plannings, both dtypes (8 of 32)
    "test_window.py::test_decode": lambda p: (
        _idx(["exact", "upper", "split", "none"], p["planning"]) + _idx([1, 16, 37, 150], p["window"])
        + _idx([F32, F16], p["dtype"])) % 4 == 0,
    "test_window.py::test_cascade": lambda p: p["dtype"] == (F32, F16)[_idx([1, 20, 40, 70, 100, 1000],
                                                                             p["window"]) % 2],
    "test_window.py::test_prefill": lambda p: p["dtype"] == (F32, F16)[_idx([1, 7, 33, 100], p["window"]) % 2],
    # every feature set with and without a plan (or causal), dtypes alternating
    "test_softcap_sinks.py::test_decode": lambda p: (
        _idx(["softcap", "sinks", "both"], p["kind"]) + p["planned"] + _idx([F32, F16], p["dtype"])) % 2 == 0,
    "test_softcap_sinks.py::test_cascade": lambda p: (
        _idx(["softcap", "sinks", "both"], p["kind"]) + _idx([F32, F16], p["dtype"])) % 2 == 0,
    "test_softcap_sinks.py::test_prefill": lambda p: (
        _idx(["softcap", "sinks", "both"], p["kind"]) + p["causal"] + _idx([F32, F16], p["dtype"])) % 2 == 0,
    # CASES (poison value, poisoned cache, layout, dtype): each once, with each mode / causal flag;
    # the cascade keeps cases 1-3, which hold every value of every axis
    "test_outside_rows.py::test_decode": lambda p: _idx([None, "stream_k", "split"], p["mode"]) == p["case"] % 3,
    "test_outside_rows.py::test_prefill": lambda p: int(p["causal"]) == p["case"] % 2,
    "test_outside_rows.py::test_cascade": lambda p: p["case"] in (1, 2, 3),
    # every seed (block size, GQA, depth), dtypes alternating
    "test_cascade.py::test_random_forest_exact": lambda p: p["dtype"] == (F32, F16)[p["seed"] % 2],
    # the seeds cycle block size (4, 16), forest kind and depth: the first cycle of each; the plans
    # of every seed are checked on the torch path
    "test_cascade_plan.py::test_forest_reuse_after_decode_steps": lambda p: p["seed"] < 3,
    "test_cascade_reuse.py::test_removals_give_the_plan_made_from_scratch": lambda p: p["seed"] < 4,
    "test_cascade_reuse.py::test_removals_and_decode_steps_with_the_cost_model": lambda p: p["seed"] < 3,
    # vLLM plug-in on the kernels: each step kind / feature / fp8 format once, each with another layout
    # or row mix (cascade and flat, shared and mixed, NHD and HND all stay)
    "test_vllm_backend.py::test_step_on_kernels": lambda p: (
        _idx(["decode", "prefill", "mixed"], p["kind"]) % 2 == _idx(["NHD", "HND"], p["layout"])),
    "test_vllm_backend.py::test_shared_prefix": lambda p: (p["cascade"], p["kind"]) in {(True, "decode"),
                                                                                         (False, "mixed")},
    "test_vllm_backend.py::test_logit_features": lambda p: (p["feature"], p["kind"]) in {("softcap", "shared"),
                                                                                          ("sinks", "mixed")},
    "test_vllm_backend.py::test_fp8_kv_cache": lambda p: (p["kv_cache_dtype"], p["kind"]) in {
        ("fp8", "shared"), ("fp8_e5m2", "mixed")},
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marks
def pytest_collection_modifyitems(config, items):
    rules = {**BOTH, **INTERP} if INTERPRET else BOTH
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # tests/gpu/run.sh runs every gpu case
            continue
        keep = rules.get(f"{item.path.name}::{item.originalname}")
        if keep is not None and not keep(item.callspec.params if hasattr(item, "callspec") else {}):
            item.add_marker(pytest.mark.exhaustive)
    # a renamed test would quietly leave its whole matrix in tier 1 (slower, nothing lost): every rule
    # must name a test of its file (checked when whole files were collected)
    if not any("::" in str(a) for a in config.args):
        files = {item.path.name for item in items}
        names = {f"{item.path.name}::{item.originalname}" for item in items}
        stale = [r for r in {**BOTH, **INTERP} if r.split("::")[0] in files and r not in names]
        if stale:
            warnings.warn(pytest.PytestWarning(f"tests/conftest.py: tier rules name tests that do not exist "
                                               f"(their cases all run in tier 1): {stale}"))


def pytest_runtest_logreport(report):
    """With ``PAGED_BACKEND_TEST_TIMES`` (a file; tests/gpu/run.sh sets it): each test's call, and any
    phase over a second, appended as it finishes - where a run's time went even when it is cut short
    (pytest's --durations prints only at the end; the GPU suite ran out of device time at 85%)."""
    path = os.environ.get("PAGED_BACKEND_TEST_TIMES")
    if path and (report.when == "call" or report.duration > 1.0):
        with open(path, "a") as f:
            f.write(f"{report.duration:8.2f} {report.when:8s} {report.outcome:7s} {report.nodeid}\n")


@pytest.fixture(autouse=True, scope="session")
def _model_cache(tmp_path_factory):
    """Loads of the embedded model convert it into a cache of the test session's (one conversion a
    session, later loads read it), never into the user's (~/.cache), unless PAGED_BACKEND_CACHE
    says where."""
    if "PAGED_BACKEND_CACHE" not in os.environ:
        os.environ["PAGED_BACKEND_CACHE"] = str(tmp_path_factory.getbasetemp() / "model-cache")
    yield
