"""paged-sample: the README's command answers with Paris; the first start converts the embedded GGUF
model once into the model cache and later starts read it (same greedy tokens); JSONL out as
requests finish; prompt files, flags and Ctrl-C refused or reported in one line before any loading.
The model cache is a temporary directory (PAGED_BACKEND_CACHE), never ~/.cache."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from paged_backend.integration import cli, engine, model_cache, models

pytestmark = pytest.mark.xdist_group("engine")

README_PROMPT = "What is the capital of France?"


def run_cli(cache, *args, **popen):
    """paged-sample in a subprocess with the model cache at ``cache``, greedy on the README's prompt."""
    env = dict(os.environ, **{model_cache.ENV: str(cache)})
    cmd = [sys.executable, "-m", "paged_backend.integration.cli", "--prompt", README_PROMPT, "--temperature", "0",
           *args]
    if popen:
        return subprocess.Popen(cmd, env=env, text=True, **popen)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def first_start(tmp_path_factory):
    """The first start with an empty model cache (-q, JSONL on stdout): converts the GGUF file once
    and writes the cache that the other tests of this module read. -> (cache dir, its run)."""
    cache = tmp_path_factory.mktemp("model-cache")
    return cache, run_cli(cache, "-q", "-o", "-", "--max-tokens", "16")


def token_ids(run):
    return [o["token_ids"] for o in json.loads(run.stdout)["outputs"]]


def test_the_first_start_converts_quietly_and_later_starts_read_the_cache(first_start):
    cache, first = first_start
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""  # -q: no conversion note, no transformers bars, no summary
    assert [p.name for p in (cache / "models").iterdir()] == \
        [model_cache.entry_key(models.default_model_path())]  # one entry, no temporary directory left
    second = run_cli(cache, "-o", "-", "--max-tokens", "16")
    assert second.returncode == 0, second.stderr
    assert "onverting" not in second.stderr and "loaded " in second.stderr
    assert token_ids(second) == token_ids(first) and token_ids(first)[0]  # cached = converted, greedy


def test_the_readme_command_answers_paris(first_start):
    r = run_cli(first_start[0], "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    for line in ("requests   1 (1 samples)", "generated tokens/s", "KV cache   peak"):
        assert line in r.stderr


def test_the_first_start_says_it_converts_in_one_line(first_start, tmp_path, monkeypatch, capsys):
    """(The conversion itself stands in: it reads the module's cache entry.)"""
    entry = first_start[0] / "models" / model_cache.entry_key(models.default_model_path())
    monkeypatch.setattr(model_cache, "convert", lambda path, attn: model_cache.read_entry(
        entry, dtype=__import__("torch").float32, attn_implementation=attn))
    assert cli.main(["-p", "Say hi.", "-t", "0", "--max-tokens", "2", "--num-blocks", "16",
                     "--model-cache", str(tmp_path / "cache")]) == 0
    err = capsys.readouterr().err.splitlines()
    notes = [line for line in err if "converting" in line]
    assert len(notes) == 1 and "once" in notes[0] and str(tmp_path / "cache") in notes[0]
    assert os.environ.get(model_cache.ENV) != str(tmp_path / "cache")  # --model-cache set it for the load only
    assert (tmp_path / "cache" / "models" / entry.name / model_cache.META).is_file()


@pytest.fixture
def shared_llm(monkeypatch, first_start):
    """The CLI with one small engine for the whole module (loaded from the module's model cache)."""
    if not hasattr(shared_llm, "llm"):
        with monkeypatch.context() as m:
            m.setenv(model_cache.ENV, str(first_start[0]))
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


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(engine, "LLM", refuse)
    monkeypatch.setattr(models, "load", refuse)
    monkeypatch.setattr(model_cache, "load_gguf", refuse)


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": 3}\n', "p.jsonl:2: needs \"prompt\""),
    ('{"prompt": "ok"}\nnot json\n', "p.jsonl:2: not valid JSON (Expecting value at column 1)"),
    ('{"prompt": "ok"}\n{"prompt": "x\n', "p.jsonl:2: not valid JSON (Unterminated string starting at column 12)"),
    ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "p.jsonl:2: prompt id 'a' appears twice (first at"),
    ('{"prompt": "ok"}\n\n{"id": "q", "prompt": ""}\n', "p.jsonl:3: the prompt is empty"),
    (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "p.jsonl:2: not UTF-8 text (byte 0xe9 at column 16)"),
])
def test_bad_prompt_files_fail_before_loading(tmp_path, monkeypatch, capsys, no_loading, content, message):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "p.jsonl"
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert cli.main(["p.jsonl"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "at at" not in err


def test_prompt_files_are_utf8_text_lines(tmp_path, monkeypatch, capsys):
    """Lines end at newlines only (U+2028 in a JSON string is text); a byte-order mark is dropped;
    a non-UTF-8 text file and an empty --prompt are named by line and by flag."""
    src = tmp_path / "p.jsonl"
    line = json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False)
    src.write_bytes(("\ufeff" + line).encode() + b"\r\n\"c\"\n")
    assert cli.read_prompts(str(src), ["d"]) == [{"prompt": "a\u2028b", "id": "0"}, {"prompt": "c", "id": "1"},
                                                {"prompt": "d", "id": "2"}]
    txt = tmp_path / "p.txt"
    txt.write_bytes(b"fine\n\xff\xfe\n")
    with pytest.raises(cli.InputError, match=r"p\.txt:2: not UTF-8 text \(byte 0xff at column 1\)"):
        cli.read_prompts(str(txt), [])
    with pytest.raises(cli.InputError, match="--prompt #2: the prompt is empty"):
        cli.read_prompts(None, ["x", ""])


@pytest.mark.parametrize("args, flag", [
    (["--kv-cache-dtype", "bogus"], "--kv-cache-dtype"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--block-size", "3"], "--block-size"),
    (["--device", "bogus"], "--device"),
    (["--device", "mps"], "--device"),
    (["--dtype", "fp64"], "--dtype"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--kv-memory-fraction", "1.5"], "--kv-memory-fraction"),
    (["-o", "{tmp}/no/such/dir/out.jsonl"], "--output"),
    (["-o", "{tmp}"], "--output"),
    (["--model", "{tmp}/none.gguf"], "--model"),
    (["--model-cache", "{tmp}/a-file"], "--model-cache"),
])
def test_bad_flags_are_refused_in_one_line_before_loading(tmp_path, capsys, no_loading, args, flag):
    (tmp_path / "a-file").write_text("x")
    assert cli.main(["--prompt", "x", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"paged-sample: error: argument {flag}: ") and err.count("\n") == 1, err


def test_ctrl_c_while_loading_is_one_line(monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(engine, "LLM", interrupted)
    assert cli.main(["--prompt", "x", "-q"]) == 130
    assert capsys.readouterr().err == "paged-sample: interrupted before any request ran\n"


def test_ctrl_c_during_the_conversion(tmp_path):
    """A real SIGINT while the first start converts: one line, exit 130, nothing left in the cache."""
    # SIGINT's default action as at a terminal: a runner started in the background of a shell hands
    # its children SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    p = run_cli(tmp_path / "cache", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stderr.readline().startswith("loading ")
    assert p.stderr.readline().startswith("converting ")
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    # 130; or killed by SIGINT itself (a shell shows 130 too): CPython does that at exit when the
    # interrupt went through code that C ran with PyRun_* (some imports), however main ended
    assert p.returncode in (130, -signal.SIGINT), err
    assert err.splitlines()[-1] == "paged-sample: interrupted before any request ran" and "Traceback" not in err
    assert not (tmp_path / "cache" / "models").exists() or not list((tmp_path / "cache" / "models").iterdir())


def test_bad_arguments(capsys):
    assert cli.main(["--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "no prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = "".join(capsys.readouterr().out.split())  # (argparse wraps to the terminal's width)
    for text in ("examples:", "--max-model-len MAX_MODEL_LEN prompt + output tokens per sequence (default: the model's",
                 "--num-blocks NUM_BLOCKS KV blocks in the pool (default: as many as --kv-memory-fraction",
                 "bfloat16 (default auto)", "half the KV memory and bytes read (default auto)", "--model-cache DIR",
                 "exit codes: 0 every request ran 1 some requests were rejected", "2 bad arguments",
                 "130 interrupted (Ctrl-C)"):
        assert "".join(text.split()) in out, text


def test_quiet_loading_turns_transformers_bars_off_and_back_on():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging
    assert hf_logging.is_progress_bar_enabled()
    with models.quiet_loading():
        assert not hf_logging.is_progress_bar_enabled()
        assert gguf_utils.tqdm(range(3)).disable  # the GGUF conversion's own tqdm.auto bar
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    assert hf_logging.is_progress_bar_enabled() and not gguf_utils.tqdm(range(3), file=open(os.devnull, "w")).disable
