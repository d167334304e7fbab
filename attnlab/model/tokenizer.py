"""Tokenizers from the same GGUF file or folder as the weights.

A byte-level BPE vocabulary (most GGUF files: Qwen2, SmolLM2, Llama 3) is built straight from the file's
header (`gguf_vocab`), with no cache. Converting any other GGUF vocabulary takes seconds (transformers'
converter), so that result is saved once under ~/.cache/attnlab/tokenizers (keyed by file path, size and
mtime); the cache is only an optimisation and is rebuilt if broken. A cached tokenizer is read back by the
`tokenizers` package directly (`GGUFTokenizer`): importing transformers costs ~1 s of every load, and
its tokenizer is the same `tokenizers` object underneath (a test holds the ids equal). Hugging Face
folders keep transformers' AutoTokenizer (their configs vary more than a converted GGUF's).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from datetime import datetime
from functools import cached_property
from pathlib import Path

CACHE = Path(os.environ.get("ATTNLAB_CACHE", Path.home() / ".cache" / "attnlab")) / "tokenizers"
SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _quiet_transformers() -> None:
    from transformers.utils import logging as tlog
    tlog.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def load_tokenizer(path: Path):
    """A tokenizer (with chat template when the checkpoint has one), or None if the folder has none.
    A GGUF's is a `GGUFTokenizer`, built from the header (byte-level BPE) or over its cached conversion; a folder's is transformers'."""
    if path.is_dir():
        from transformers import AutoTokenizer
        _quiet_transformers()
        has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
        return AutoTokenizer.from_pretrained(str(path)) if has_tok else None
    from attnlab.model.gguf_vocab import byte_level
    parts = byte_level(path)
    if parts is not None:  # byte-level BPE: built from the header in a fraction of a second, no cache
        return GGUFTokenizer(parts=parts, source=path)
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = CACHE / key
    if (cached / "tokenizer.json").exists():
        try:
            return GGUFTokenizer(cached)
        except Exception:
            pass  # stale or partial cache: rebuild below
    from transformers import AutoTokenizer
    _quiet_transformers()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = CACHE / f".{key}.{os.getpid()}"
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
        return GGUFTokenizer(cached)  # the same object on the first run as on every later one
    except OSError:
        return tok  # read-only home: work without the cache


def _content(value) -> str | None:
    """A special token as tokenizer_config.json holds it: a string or an AddedToken-like object."""
    return value.get("content") if isinstance(value, dict) else value


class GGUFTokenizer:
    """The part of transformers' fast-tokenizer API attnlab uses, over `tokenizers.Tokenizer` read from
    a saved folder (tokenizer.json, tokenizer_config.json, chat_template.jinja). Anything else is asked
    of transformers' own tokenizer for the same folder, built on first use."""

    def __init__(self, folder: Path | None = None, parts: tuple | None = None, source: Path | None = None):
        """From a saved folder, or from (tokenizers.Tokenizer, config, chat template) built in memory (`parts`:
        `gguf_vocab.byte_level` of the GGUF file `source`)."""
        self.folder, self.source = (Path(folder) if folder is not None else None), source
        if parts is None:
            from tokenizers import Tokenizer
            self._tok = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
            config_file = self.folder / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.exists() else {}
            template = self.folder / "chat_template.jinja"
            self.chat_template = template.read_text() if template.exists() else config.get("chat_template")
        else:
            self._tok, config, self.chat_template = parts
        self.special_tokens_map = {k: _content(config[k]) for k in SPECIALS if config.get(k) is not None}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        for k in SPECIALS:
            setattr(self, k, self.special_tokens_map.get(k))

    def __getattr__(self, name):  # only reached for what this class does not define
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._transformers, name)

    @cached_property
    def _transformers(self):
        from transformers import AutoTokenizer
        _quiet_transformers()
        if self.folder is None:
            return AutoTokenizer.from_pretrained(str(self.source.parent), gguf_file=self.source.name)
        return AutoTokenizer.from_pretrained(str(self.folder))

    def _id(self, key: str) -> int | None:
        token = self.special_tokens_map.get(key)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        return dict(sorted(self._tok.get_added_tokens_decoder().items()))

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            found = self._tok.token_to_id(tokens)
            return found if found is not None else self._id("unk_token")
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        return self._tok.id_to_token(int(ids)) if isinstance(ids, int) else [self._tok.id_to_token(int(i)) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of text; split_special_tokens: '<|im_end|>' in the text is plain characters, not the token."""
        saved = self._tok.encode_special_tokens
        self._tok.encode_special_tokens = split_special_tokens
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self._tok.encode_special_tokens = saved

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(ids)] if isinstance(ids, int) or getattr(ids, "ndim", 1) == 0 else [int(i) for i in ids]
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(self, conversation, tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs):
        """Render the chat template as transformers does for plain messages (role/content strings); tools,
        documents and other options go to transformers itself."""
        plain = all(isinstance(m, dict) and all(type(v) is str for v in m.values()) for m in conversation)
        if kwargs or not plain or not self.chat_template:
            return self._transformers.apply_chat_template(conversation, tokenize=tokenize,
                                                          add_generation_prompt=add_generation_prompt, **kwargs)
        text = _template(self.chat_template).render(messages=[dict(m) for m in conversation], tools=None,
                                                    documents=None, add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens_map)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, path: str) -> None:
        self._transformers.save_pretrained(path)


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


_TEMPLATES: dict[str, object] = {}


def _template(source: str):
    """A chat template compiled the way transformers compiles it (a sandbox that trims blocks, tojson
    without HTML escaping, raise_exception, strftime_now, loop controls)."""
    if source not in _TEMPLATES:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
