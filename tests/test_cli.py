"""paged-sample: the README's command answers with Paris; JSONL out as requests finish; prompt
files and bad input."""
import json
import subprocess
import sys

import pytest

from paged_backend.integration import cli, engine

pytestmark = pytest.mark.xdist_group("engine")


def test_the_readme_command_answers_paris():
    r = subprocess.run([sys.executable, "-m", "paged_backend.integration.cli", "--prompt",
                        "What is the capital of France?", "--temperature", "0", "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    for line in ("requests   1 (1 samples)", "generated tokens/s", "KV cache   peak"):
        assert line in r.stderr


@pytest.fixture
def shared_llm(monkeypatch):
    """The CLI with one small engine for the whole module (a model load is ~20 s on 2 cores)."""
    if not hasattr(shared_llm, "llm"):
        shared_llm.llm = engine.LLM(device="cpu", num_blocks=128, max_num_seqs=16, max_model_len=512)
    monkeypatch.setattr(engine, "LLM", lambda *a, **k: shared_llm.llm)
    return shared_llm.llm


def test_jsonl_in_and_out(tmp_path, shared_llm, capsys):
    src = tmp_path / "prompts.jsonl"
    src.write_text('{"id": "france", "prompt": "What is the capital of France?"}\n\n'
                   '"Name a color."\n'
                   '{"messages": [{"role": "user", "content": "Say hi."}]}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    rc = cli.main([str(src), "-n", "2", "--temperature", "0.7", "--seed", "3", "--max-tokens", "12",
                   "--prompt", "word " * 700, "-o", str(out), "-q"])
    assert rc == 1  # the last prompt is over max_model_len: reported, the others ran
    recs = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert set(recs) == {"france", "1", "2", "3"}
    for rid in ("france", "1", "2"):
        assert len(recs[rid]["outputs"]) == 2 and all(o["token_ids"] for o in recs[rid]["outputs"])
        assert {"text", "finish_reason", "cumulative_logprob", "index"} <= set(recs[rid]["outputs"][0])
    assert "messages" in recs["2"] and "max_model_len" in recs["3"]["error"]
    assert capsys.readouterr().out == ""


def test_readable_output_and_raw_prompts(shared_llm, capsys):
    assert cli.main(["--prompt", "The capital of France is", "--no-chat", "-t", "0", "--max-tokens", "6", "-q"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== [0] The capital of France is") and "Paris" in out


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": 3}\n', ":2: needs \"prompt\""),
    ('{"prompt": "ok"}\nnot json\n', ":2: not valid JSON"),
    ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "'a' appears twice"),
    ('{"prompt": ""}\n', "is empty"),
])
def test_bad_prompt_files_fail_before_loading(tmp_path, capsys, content, message):
    src = tmp_path / "p.jsonl"
    src.write_text(content, encoding="utf-8")
    assert cli.main([str(src)]) == 2
    assert message in capsys.readouterr().err


def test_bad_arguments(capsys):
    assert cli.main(["--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "no prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "examples:" in capsys.readouterr().out
