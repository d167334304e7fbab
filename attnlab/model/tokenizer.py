"""Tokenizers through `transformers`, from the same GGUF file or folder as the weights.

Converting a GGUF vocabulary into a fast tokenizer takes seconds, so the result is
saved once under ~/.cache/attnlab/tokenizers (keyed by file path, size and mtime)
and reloaded from there; the cache is only an optimisation and is rebuilt if broken.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

CACHE = Path(os.environ.get("ATTNLAB_CACHE", Path.home() / ".cache" / "attnlab")) / "tokenizers"


def _quiet_transformers() -> None:
    from transformers.utils import logging as tlog
    tlog.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def load_tokenizer(path: Path):
    """A transformers tokenizer (with chat template when the checkpoint has one), or None if the folder has none."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    if path.is_dir():
        has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
        return AutoTokenizer.from_pretrained(str(path)) if has_tok else None
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = CACHE / key
    if (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:
            pass  # stale or partial cache: rebuild below
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = CACHE / f".{key}.{os.getpid()}"
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
    except OSError:
        pass  # read-only home: work without the cache
    return tok
