"""paged_backend.testing, the public conformance suite: it passes for our ops (torch path; the
kernels under TRITON_INTERPRET=1 on the quick subset) and for torch SDPA on the cases SDPA can
express, it can fail (deliberately broken adapters are reported failed, and the CLI exits 1),
missing peers are "not supported", and the tests' own reference/inputs are the package's."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

import paged_backend.testing as pt
from paged_backend.testing.__main__ import main
from paged_backend.testing.adapters import FlashInfer, Ours, Xformers
from paged_backend.testing.suite import FAILED, NOT_SUPPORTED, PASSED

BROAD = {"decode", "prefill", "cascade", "gqa", "mqa", "mha", "ragged", "empty_rows", "long", "window", "softcap",
         "sinks", "fp8", "e4m3fn", "e5m2", "vllm_layout", "strided_metadata", "padding_rows", "nan_outside",
         "inf_outside", "causal", "noncausal", "chunked", "shared_prefix", "custom_scale", "fp32", "fp16", "bf16"}


def _statuses(results):
    return {r.case: r.status for r in results}


def test_cases_cover_every_feature_and_build_deterministically():
    seen = set().union(*(c.features for c in pt.CASES))
    assert BROAD <= seen, BROAD - seen
    assert {f for c in pt.QUICK for f in c.features} >= {"decode", "prefill", "cascade", "window", "softcap",
                                                         "sinks", "fp8", "vllm_layout", "nan_outside", "empty_rows",
                                                         "chunked"}
    assert not any(c.dtype == torch.bfloat16 for c in pt.QUICK)  # the interpreter has no bf16
    case = next(c for c in pt.CASES if c.name == "decode_all_features")
    a, b, c = case.build(seed=0), case.build(seed=0), case.build(seed=1)
    assert torch.equal(a.q, b.q) and not torch.equal(a.q, c.q)
    assert a.block_table.stride(-1) == 2 and a.seq_lens.stride(0) == 2  # strided metadata views
    assert not a.k_cache.is_contiguous()  # vLLM's layout
    assert torch.isnan(a.k_cache.float()).any()  # poisoned outside the rows
    o, lse = a.reference()
    assert o.dtype == torch.float64 and torch.isfinite(o).all() and not torch.isnan(lse).any()


def test_ours_passes_every_case_on_the_torch_path():
    results = pt.run_suite("ours", "cpu")
    bad = [r for r in results if r.status != PASSED]
    assert not bad, pt.format_table(bad)


@pytest.mark.kernel
def test_ours_quick_subset():
    """Under TRITON_INTERPRET=1 (tests/run_cpu.sh's second pass) these are the Triton kernels."""
    results = pt.run_suite("ours", "cpu", quick=True)
    assert all(r.status == PASSED for r in results), pt.format_table(results)
    assert len(results) == len(pt.QUICK)


def test_sdpa_passes_what_it_supports():
    results = pt.run_suite("sdpa", "cpu")
    for r in results:
        case = next(c for c in pt.CASES if c.name == r.case)
        if "softcap" in case.features:
            assert r.status == NOT_SUPPORTED and "soft-capping" in r.note
        else:
            assert r.status == PASSED and r.lse_err is None and r.note == "out only (no lse)", r


class _Broken(Ours):
    """Our ops with one deliberate bug, applied to the inputs or the outputs."""
    name = "broken"
    feature = ""

    def run(self, inp):
        out, lse = super().run(self.spoil(inp))
        return out, self.spoil_lse(inp, lse)

    def spoil(self, inp):
        return inp

    def spoil_lse(self, inp, lse):
        return lse


class DropSoftcap(_Broken):
    feature = "softcap"

    def spoil(self, inp):
        return dataclasses.replace(inp, case=dataclasses.replace(inp.case, softcap=None))


class DropWindow(_Broken):
    feature = "window"

    def spoil(self, inp):
        return dataclasses.replace(inp, case=dataclasses.replace(inp.case, window=None))


class DropSinks(_Broken):
    feature = "sinks"

    def spoil(self, inp):
        return dataclasses.replace(inp, sinks=None)


class DropFp8Scales(_Broken):
    feature = "fp8"

    def spoil(self, inp):
        return dataclasses.replace(inp, k_scale=None, v_scale=None)


class DropCausal(_Broken):
    feature = "causal"

    def spoil(self, inp):
        return dataclasses.replace(inp, case=dataclasses.replace(inp.case, causal=False))


class Base2Lse(_Broken):
    feature = "decode"  # and every other case: all have rows with keys

    def spoil_lse(self, inp, lse):
        return lse / math.log(2)


class ZeroLseForEmptyRows(_Broken):
    feature = "empty_rows"

    def spoil_lse(self, inp, lse):
        return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


@pytest.mark.parametrize("broken", [DropSoftcap, DropWindow, DropSinks, DropFp8Scales, DropCausal, Base2Lse,
                                    ZeroLseForEmptyRows])
def test_broken_adapters_fail(broken):
    """The suite can fail: each bug fails every case it concerns, and only those."""
    results = pt.run_suite(broken("cpu"), "cpu")
    st = _statuses(results)
    if broken is Base2Lse:
        hit = {c.name for c in pt.CASES}
    elif broken is ZeroLseForEmptyRows:  # the cases with an output row without keys (and without sinks)
        hit = {c.name for c in pt.CASES if torch.isinf(c.build().reference()[1]).any()}
    else:
        hit = {c.name for c in pt.CASES if broken.feature in c.features}
    assert hit and all(st[n] == FAILED for n in hit), pt.format_table(results)
    assert all(st[n] == PASSED for n in st if n not in hit), pt.format_table(results)


def test_cli_exit_status_table_and_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["--impl", "ours", "--device", "cpu", "--quick", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "| case" in text and "decode_ragged" in text and f"{len(pt.QUICK)} passed, 0 failed" in text
    saved = json.loads(path.read_text())
    assert saved["impl"] == "ours" and len(saved["results"]) == len(pt.QUICK)
    spec = f"{__name__}:DropSoftcap"  # a user's adapter, named module:attr
    assert main(["--impl", spec, "--device", "cpu", "--case", "decode_ragged"]) == 0
    assert main(["--impl", spec, "--device", "cpu", "--case", "decode_ragged", "--case", "decode_softcap"]) == 1
    assert "1 passed, 1 failed" in capsys.readouterr().out
    assert main(["--impl", spec, "--device", "cpu", "--case", "decode_ragged", "--case", "decode_softcap", "-v"]) == 1
    err = capsys.readouterr().err.splitlines()  # -v: a line per case as it ends
    assert [line.split(" (")[0] for line in err] == ["decode_ragged: passed", "decode_softcap: failed"]
    assert all(line.endswith(" s)") for line in err)


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "paged_backend.testing", "--impl", "sdpa", "--device", "cpu",
                        "--case", "decode_softcap", "--case", "prefill_chunked"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "not supported" in r.stdout and "1 passed, 0 failed, 1 not supported" in r.stdout


@pytest.mark.parametrize("peer", [FlashInfer, Xformers])
def test_peers_without_cuda_or_package_are_not_supported(peer):
    results = pt.run_suite(peer("cpu"), "cpu", quick=True)
    assert all(r.status == NOT_SUPPORTED and r.note for r in results)
    assert results[0].note in (f"{peer.package} not installed (ModuleNotFoundError)", "needs CUDA")


def test_tests_use_the_package():
    import paged_inputs
    import reference
    assert reference.decode_reference is pt.decode_reference and reference.assert_close_state is pt.assert_close_state
    assert paged_inputs.make_cache is pt.inputs.make_cache


def test_assert_close_state_rules():
    # seeded: unseeded, no entry of o exceeded 2 in about one run in nine and the NaN case had no NaN
    o = torch.randn(3, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lse = torch.tensor([[0.5] * 4, [float("-inf")] * 4, [1.0] * 4], dtype=torch.float64)
    pt.assert_close_state(o.float(), lse.float(), o, lse, torch.float32)
    for out, ls, why in ((o * 1.01, lse, "rel err"), (o, lse + 0.01, "lse abs err"),
                         (o, torch.where(torch.isinf(lse), 0.0, lse),
                          r"-inf pattern differs: 4 entries without keys have a finite lse \(e.g. 0\)"),
                         (o, lse.masked_fill(lse > 0.7, float("-inf")), "4 entries with keys have lse -inf"),
                         (o.masked_fill(o > 1, float("nan")), lse, "NaN"),
                         (o, lse.masked_fill(lse > 0.7, float("nan")), "NaN")):
        with pytest.raises(AssertionError, match=why):
            pt.assert_close_state(out.float(), ls.float(), o, lse, torch.float32)
    c = pt.check_state(o.half(), None, o, lse, torch.float16)
    assert c.ok and c.lse_err is None and c.out_err < pt.TOL[torch.float16]
