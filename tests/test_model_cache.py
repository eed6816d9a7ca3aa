"""The cache of converted GGUF models (integration/model_cache.py), on a tiny model standing in for
transformers' GGUF conversion: the second load reads the entry (no conversion), a damaged entry is
reported in one line and rebuilt, entries are written into a temporary directory and renamed into
place (a concurrent writer's entry wins, nothing half-written stays), the key follows the file's
content, and where the cache lives. Every test points the cache at tmp_path, never ~/.cache. (The
embedded model, cached vs converted, is in test_cli.py.)"""
import json
import logging
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

from paged_backend.integration import model_cache

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(62)]


def tiny_pair(seed: int = 0):
    """(a tiny Llama, a word-level tokenizer): what the conversion of a GGUF file returns."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   max_position_embeddings=128, eos_token_id=1, bos_token_id=None)
    net = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tk = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    return net, tokenizer


@pytest.fixture
def gguf(tmp_path):
    f = tmp_path / "models" / "tiny.gguf"
    f.parent.mkdir()
    f.write_bytes(b"GGUF" + bytes(range(256)) * 64)  # only its bytes matter: the conversion is faked
    return f


@pytest.fixture
def conversions(monkeypatch):
    """Fakes transformers' GGUF conversion with a tiny model; -> the list of converted paths."""
    calls = []

    def convert(path, attn_implementation):
        calls.append(path)
        return tiny_pair()

    monkeypatch.setattr(model_cache, "convert", convert)
    return calls


@pytest.fixture(autouse=True)
def no_env_cache(monkeypatch, tmp_path):
    """Whatever the environment says, nothing here reaches the user's cache."""
    monkeypatch.setenv(model_cache.ENV, str(tmp_path / "env-cache"))


def load(path, cache, dtype=torch.float32):
    return model_cache.load_gguf(path, dtype=dtype, attn_implementation="sdpa", cache_dir=cache)


def no_conversion(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("converted the GGUF file again instead of reading the cache")
    monkeypatch.setattr(model_cache, "convert", refuse)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_second_load_reads_the_cache(tmp_path, gguf, conversions, monkeypatch, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="paged_backend"):
        net, tok = load(gguf, cache)
    assert conversions == [gguf.absolute()]
    entry = model_cache.entry_path(gguf, cache)
    assert entry.parent == cache / "models" and entry.name.startswith("tiny-")
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "converting tiny.gguf once" in notes[0] and str(entry) in notes[0]
    meta = json.loads((entry / model_cache.META).read_text())
    assert meta["format"] == model_cache.FORMAT and meta["source"]["sha256"] == model_cache.file_digest(gguf)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(meta["files"])
    assert [p.name for p in (cache / "models").iterdir()] == [entry.name]  # no temporary directory left

    no_conversion(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="paged_backend"):
        net2, tok2 = load(gguf, cache)
    assert not caplog.records  # nothing to say on a cached start
    assert same_weights(net, net2) and net2.dtype == torch.float32
    assert tok2("w1 w7 w30 zz").input_ids == tok("w1 w7 w30 zz").input_ids == [3, 9, 32, 0]
    assert tok2.eos_token_id == 1 and net2.config._attn_implementation == "sdpa"


def test_dtype_is_the_one_asked_for_cached_or_not(tmp_path, gguf, conversions, monkeypatch):
    """The entry holds the fp32 conversion; a load in bf16 casts it: the same values as converting
    in bf16 (the uncached load)."""
    cache = tmp_path / "cache"
    first, _ = load(gguf, cache, torch.bfloat16)
    no_conversion(monkeypatch)
    cached, _ = load(gguf, cache, torch.bfloat16)
    assert first.dtype == cached.dtype == torch.bfloat16
    assert same_weights(first, cached) and same_weights(cached, tiny_pair()[0].to(torch.bfloat16))
    assert same_weights(load(gguf, cache)[0], tiny_pair()[0])  # and fp32 from the same entry


def _truncate(entry):
    f = entry / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garble_same_size(entry):  # the sizes match: only the load finds it
    f = entry / "model.safetensors"
    f.write_bytes(b"\xff" * f.stat().st_size)


@pytest.mark.parametrize("damage", [
    _truncate,
    _garble_same_size,
    lambda entry: (entry / "tokenizer.json").unlink(),
    lambda entry: (entry / "config.json").write_text("{", encoding="utf-8"),
    lambda entry: (entry / model_cache.META).unlink(),
], ids=["truncated-weights", "garbled-weights", "no-tokenizer", "bad-config", "no-meta"])
def test_a_damaged_entry_is_named_deleted_and_rebuilt(tmp_path, gguf, conversions, monkeypatch, caplog, damage):
    cache = tmp_path / "cache"
    load(gguf, cache)
    entry = model_cache.entry_path(gguf, cache)
    damage(entry)
    with caplog.at_level(logging.INFO, logger="paged_backend"):
        net, tok = load(gguf, cache)
    assert len(conversions) == 2  # rebuilt
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0] and str(entry) in warnings[0] \
        and "\n" not in warnings[0]
    assert same_weights(net, tiny_pair()[0])
    no_conversion(monkeypatch)
    assert same_weights(load(gguf, cache)[0], net)  # the rebuilt entry is whole
    assert [p.name for p in (cache / "models").iterdir()] == [entry.name]


def test_the_entry_is_written_into_a_temporary_directory_then_renamed(tmp_path, gguf, conversions, monkeypatch):
    cache = tmp_path / "cache"
    entry = model_cache.entry_path(gguf, cache)
    renames, rename = [], os.rename

    def watch(src, dst):
        src, dst = Path(src), Path(dst)
        assert not dst.exists()  # nothing at the entry's place until the rename
        assert src.parent == dst.parent and src.name.startswith(".tmp-")  # the same file system
        assert {model_cache.META, "model.safetensors", "tokenizer.json"} <= {p.name for p in src.iterdir()}
        renames.append((src, dst))
        rename(src, dst)

    monkeypatch.setattr(model_cache.os, "rename", watch)
    load(gguf, cache)
    assert [dst for _, dst in renames] == [entry] and not renames[0][0].exists()


def test_a_failed_write_leaves_nothing_and_the_load_goes_on(tmp_path, gguf, conversions, monkeypatch, caplog):
    cache = tmp_path / "cache"

    def full_disk(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tiny_pair()[1]), "save_pretrained", full_disk)
    with caplog.at_level(logging.WARNING, logger="paged_backend"):
        net, _ = load(gguf, cache)
    assert same_weights(net, tiny_pair()[0])
    assert "could not cache" in caplog.text and "No space left" in caplog.text
    assert list((cache / "models").iterdir()) == []  # the temporary directory went too


def test_concurrent_writers_leave_one_whole_entry(tmp_path, gguf):
    entry = model_cache.entry_path(gguf, tmp_path / "cache")
    pairs = [tiny_pair() for _ in range(4)]
    results, start = [None] * 4, threading.Barrier(4)

    def write(i):
        start.wait()
        results[i] = model_cache.write_entry(entry, *pairs[i], source={})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]  # one won; the others dropped their copies
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
    net, _ = model_cache.read_entry(entry, dtype=torch.float32, attn_implementation="sdpa")
    assert same_weights(net, pairs[0][0])


def test_the_key_follows_the_content_and_the_versions(tmp_path, gguf, monkeypatch):
    key = model_cache.entry_key(gguf)
    st = gguf.stat()
    data = bytearray(gguf.read_bytes())
    data[100] ^= 1  # one bit, same size, same mtime
    gguf.write_bytes(bytes(data))
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = model_cache.entry_key(gguf)
    assert changed != key
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    assert model_cache.entry_key(copy) == changed  # the content decides, not the path
    # (the module now in sys.modules: transformers replaces its lazy module object as it loads)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "9.9.9")
    assert model_cache.entry_key(copy) != changed and "tf9.9.9" in model_cache.entry_key(copy)
    monkeypatch.setattr(model_cache, "FORMAT", model_cache.FORMAT + 1)
    assert model_cache.entry_key(copy).endswith(f"-v{model_cache.FORMAT}")


def test_where_the_cache_is(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(model_cache.ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert model_cache.cache_root() == tmp_path / "home" / ".cache" / "paged-backend"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    assert model_cache.cache_root() == tmp_path / "home" / ".cache" / "paged-backend"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_root() == tmp_path / "xdg" / "paged-backend"
    monkeypatch.setenv(model_cache.ENV, str(tmp_path / "env"))
    assert model_cache.cache_root() == tmp_path / "env"
    assert model_cache.cache_root(tmp_path / "arg") == tmp_path / "arg"  # an argument wins
    for off in ("off", "OFF", "0", "none"):
        assert model_cache.cache_root(off) is None
    monkeypatch.setenv(model_cache.ENV, "off")
    assert model_cache.cache_root() is None


def test_cache_off_converts_every_time_and_writes_nothing(tmp_path, gguf, conversions):
    for _ in range(2):
        net, _ = load(gguf, "off", torch.bfloat16)
        assert net.dtype == torch.bfloat16
    assert len(conversions) == 2 and not (tmp_path / "env-cache").exists()


def test_leftovers_of_killed_writers_are_swept(tmp_path, gguf, conversions):
    models_dir = tmp_path / "cache" / "models"
    old, recent = models_dir / ".tmp-old-x", models_dir / ".tmp-recent-y"
    for d in (old, recent):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    os.utime(old, (0, 0))
    load(gguf, tmp_path / "cache")
    assert not old.exists() and recent.exists()  # a recent one may be another writer's, still writing


def test_a_conversion_parses_the_gguf_file_once(tmp_path):
    """transformers' GGUF load makes a reader of the file for the tokenizer, the config and the weights,
    and gguf's tensor-name map once per module: within a conversion the same reader and map are given
    back (the file parsed once: the embedded model's first start 17 -> 10 s on 2 cores), and gguf's own
    functions are restored after it, also when it fails."""
    import gguf as G
    import numpy as np
    path = str(tmp_path / "small.gguf")
    w = G.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader, names = G.GGUFReader, G.get_tensor_name_map
    with pytest.raises(RuntimeError, match="stop"):
        with model_cache._gguf_parsed_once():
            readers = [G.GGUFReader(path) for _ in range(3)]
            maps = [G.get_tensor_name_map(G.MODEL_ARCH.LLAMA, 2) for _ in range(3)]
            raise RuntimeError("stop")
    assert readers[0] is readers[1] is readers[2] and isinstance(readers[0], reader)
    assert readers[0].tensors[0].name == "token_embd.weight"
    assert maps[0] is maps[1] is maps[2]
    assert G.GGUFReader is reader and G.get_tensor_name_map is names
    assert reader(path) is not reader(path)  # (outside a conversion: gguf's own, a reader a call)
