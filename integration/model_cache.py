"""A cache of GGUF models converted to transformers' own format, so that only the first start pays
for the conversion.

transformers loads a GGUF file by dequantizing every tensor and rebuilding the tokenizer from the
file's vocabulary: ~10 s for the embedded 93 MB SmolLM2-135M on 2 CPU cores (the file parsed once,
:func:`_gguf_parsed_once`). The first load saves
what it built (``save_pretrained`` of the model and the tokenizer: ``model.safetensors``,
``config.json``, ``generation_config.json``, ``tokenizer.json``, ...) in a cache entry; later loads
read the entry back with ``from_pretrained`` (well under a second).

Where: ``$PAGED_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/paged-backend``, else
``~/.cache/paged-backend``; entries under ``models/``. ``PAGED_BACKEND_CACHE=off`` turns the cache off
(every load converts). An entry is keyed by the SHA-256 of the GGUF file's content (~0.1 s for
93 MB), the transformers version and :data:`FORMAT`, so a changed file or another transformers
makes a new entry (old ones are not removed: delete the directory to reclaim the space).

The converted weights are stored in fp32 (what transformers dequantizes to) whatever dtype is
asked for, and cast on load: the same values as an uncached load in that dtype. An entry is
written into a temporary directory next to it and renamed into place, so a reader never sees a
half-written entry and of two processes converting at once, one entry wins and the other's copy
is dropped. An entry that does not load (a truncated or missing file) is reported in one line,
deleted and rebuilt.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("paged_backend.model_cache")

ENV = "PAGED_BACKEND_CACHE"
OFF = ("off", "none", "0", "false", "no")  # values of ENV (or cache_dir) that turn the cache off
FORMAT = 1  # bump when what an entry holds changes: older entries are then ignored
META = "paged-backend-cache.json"  # written last into an entry: its key, source and files with their sizes
STALE_TMP_S = 24 * 3600  # temporary directories older than this are what a killed writer left behind


class DamagedEntry(Exception):
    """A cache entry that is incomplete or does not load."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The cache directory: ``cache_dir``, else $PAGED_BACKEND_CACHE, else $XDG_CACHE_HOME/paged-backend
    (an absolute XDG_CACHE_HOME only, as the XDG spec says), else ~/.cache/paged-backend; None when
    the cache is turned off ("off")."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(ENV) or None
    if chosen is not None:
        if str(chosen).strip().lower() in OFF:
            return None
        return Path(chosen).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "paged-backend"


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of the file's content (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def entry_key(path: str | os.PathLike, digest: str | None = None) -> str:
    """The name of a GGUF file's entry: the file's stem (for people), its content digest, the
    transformers version and the cache format."""
    import transformers
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(path).stem)[:64]
    return f"{stem}-{(digest or file_digest(path))[:24]}-tf{transformers.__version__}-v{FORMAT}"


def entry_path(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Where the entry of a GGUF file is (or would be); None when the cache is off."""
    root = cache_root(cache_dir)
    return None if root is None else root / "models" / entry_key(path)


def convert(path: Path, attn_implementation: str):
    """transformers' own GGUF load, in fp32 (what it dequantizes to) -> (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        net = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                   dtype=torch.float32, attn_implementation=attn_implementation)
    return net, tokenizer


@contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file anew for the tokenizer, the config and the weights (its
    header holds the whole vocabulary: ~3 s each for SmolLM2 on 2 CPU cores) and builds gguf's
    tensor-name map once per module of the model (~400 times, ~3.5 s): within one conversion the
    file's reader and the map are made once and reused (both read-only: transformers reads fields
    and tensor views from the reader, names from the map)."""
    import gguf
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype, attn_implementation: str,
              cache_dir: str | os.PathLike | None = None):
    """The GGUF file ``path`` as (model in ``dtype`` on the CPU, tokenizer): from its cache entry,
    else converted (and the entry written)."""
    path = Path(path).absolute()
    root = cache_root(cache_dir)
    if root is None:
        net, tokenizer = convert(path, attn_implementation)
        return net.to(dtype), tokenizer
    digest = file_digest(path)
    entry = root / "models" / entry_key(path, digest)
    if entry.exists():
        try:
            return read_entry(entry, dtype=dtype, attn_implementation=attn_implementation)
        except DamagedEntry as e:
            log.warning("warning: the model cache entry %s is damaged (%s); deleting and rebuilding it", entry, e)
            remove_entry(entry)
    log.info("converting %s once (about 10 s); cached at %s", path.name, entry)
    net, tokenizer = convert(path, attn_implementation)
    try:
        write_entry(entry, net, tokenizer, dict(source=str(path), size=path.stat().st_size, sha256=digest))
    except Exception as e:  # a cache that cannot be written costs the next start, not this one
        log.warning("warning: could not cache the converted model at %s (%s); the next start converts it again",
                    entry, _one_line(e))
    return net.to(dtype), tokenizer


def read_entry(entry: Path, *, dtype: torch.dtype, attn_implementation: str):
    """-> (model in ``dtype``, tokenizer) of a complete entry; raises :class:`DamagedEntry` otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        meta = json.loads((entry / META).read_text(encoding="utf-8"))
        files = meta["files"]
        if meta.get("format") != FORMAT or not files:
            raise DamagedEntry(f"{META} is not of format {FORMAT}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedEntry(f"{META} is missing or unreadable: {_one_line(e)}") from None
    for name, size in files.items():
        f = entry / name
        if not f.is_file():
            raise DamagedEntry(f"{name} is missing")
        if f.stat().st_size != size:
            raise DamagedEntry(f"{name} has {f.stat().st_size} bytes, not {size}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
        net = AutoModelForCausalLM.from_pretrained(entry, local_files_only=True, dtype=dtype,
                                                   attn_implementation=attn_implementation)
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:  # whatever a damaged file makes transformers / safetensors raise
        raise DamagedEntry(_one_line(e)) from None
    return net, tokenizer


def write_entry(entry: Path, net: torch.nn.Module, tokenizer, source: dict) -> bool:
    """Saves (model, tokenizer) as the entry ``entry``: into a temporary directory beside it, then
    renamed into place. -> False when another writer's entry got there first (then it is kept, and
    this copy dropped); OSError when the cache cannot be written."""
    import torch
    import transformers
    entry.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(entry.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        _save_pretrained(net, tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        meta = dict(format=FORMAT, transformers=transformers.__version__, torch=torch.__version__,
                    written=time.strftime("%Y-%m-%dT%H:%M:%S%z"), source=source, files=files)
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, entry)  # atomic; fails when the entry exists (another writer was faster)
        except OSError:
            if (entry / META).is_file():
                return False
            raise
        return True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_entry(entry: Path) -> None:
    """Takes an entry out of its place at once (a rename), then deletes it."""
    gone = entry.with_name(f".tmp-{entry.name}-damaged-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(entry, gone)
    except OSError:  # another process removed (or replaced) it first
        return
    shutil.rmtree(gone, ignore_errors=True)


def _save_pretrained(net: torch.nn.Module, directory: Path) -> None:
    """``save_pretrained`` of a model transformers loaded from GGUF. Such a model carries the GGUF
    "quantizer" that refuses to serialize, although every weight was dequantized to a plain
    tensor; it is detached for the save (and the model left as it was)."""
    quantizer = getattr(net, "hf_quantizer", None)
    if getattr(quantizer, "packed_modules", None):  # weights kept in GGUF blocks (transformers' GGUF kernels)
        raise OSError("the model keeps its weights packed in GGUF blocks, which cannot be saved")
    had_qc = "quantization_config" in net.config.__dict__
    qc = net.config.__dict__.pop("quantization_config", None)
    net.hf_quantizer = None
    try:
        net.save_pretrained(directory)
    finally:
        net.hf_quantizer = quantizer
        if had_qc:
            net.config.quantization_config = qc


def _sweep_stale(models_dir: Path) -> None:
    """Deletes temporary directories that a writer killed mid-write left behind."""
    now = time.time()
    for p in models_dir.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
