"""A GGUF's byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": Qwen2, SmolLM2, Llama 3 and most files
people run) built straight into a `tokenizers.Tokenizer`, as transformers' GGUF converter builds it.

Why: transformers' conversion (its import, its reader, then a Python tokenizer class around the same BPE) took
~20 s on a busy 2-core machine the first time a file was used, so a cache was built behind the user's back. The
same tokenizer built here from the header's arrays costs the header's read (~0.3 s of CPU for Qwen2.5's 152k tokens
and merges) and needs no cache. A test holds the ids equal to transformers'. Other vocabularies (sentencepiece,
unigram) keep the converted cache (`tokenizer.load_tokenizer`).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from attnlab.model.gguf_header import scan_gguf

ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
# the regexes transformers splits text by, per `tokenizer.ggml.pre` (its gguf_tokenizer_mapping); any other
# pre-tokenizer splits as GPT-2 does (ByteLevel's own regex)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2)}
SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


@lru_cache(maxsize=1)
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map (as transformers' bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b), cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_level(path: Path):
    """(tokenizers.Tokenizer, tokenizer_config dict, chat template or None) for a GGUF whose vocabulary is
    byte-level BPE with merges, or None for any other vocabulary."""
    meta = scan_gguf(path, keep=ARRAYS).meta
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if meta.get("tokenizer.ggml.model") != "gpt2" or not isinstance(tokens, list) or not isinstance(merges, list):
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tok.decoder = decoders.ByteLevel()
    config = {name: _token(tokens, meta.get(f"tokenizer.ggml.{key}")) for name, key in SPECIALS.items()}
    # transformers' GPT2Tokenizer defaults: <|endoftext|> for unk, bos and eos where the file names none... but the
    # GGUF path passes the file's (None included) for all four, so only what the file names is special
    types = meta.get("tokenizer.ggml.token_type")
    types = types if isinstance(types, list) else []
    specials = [config[k] for k in ("unk_token", "bos_token", "eos_token", "pad_token") if config[k] is not None]
    specials += [t for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(specials)])
    have = tok.get_vocab(with_added_tokens=True)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in have])
    bos, eos = meta.get("tokenizer.ggml.add_bos_token", False), meta.get("tokenizer.ggml.add_eos_token", False)
    tok.post_processor = _template(tok, config["bos_token"] if bos else None, config["eos_token"] if eos else None)
    config.update(add_bos_token=bool(bos), add_eos_token=bool(eos))
    template = meta.get("tokenizer.chat_template")
    return tok, config, template if isinstance(template, str) else None


def _token(tokens: list[str], index) -> str | None:
    return tokens[index] if type(index) is int and 0 <= index < len(tokens) else None


def _template(tok, bos: str | None, eos: str | None):
    """The post-processor transformers sets: bos / eos around each sequence where the file asks for them."""
    from tokenizers import processors
    single = " ".join([f"{bos}:0"] * bool(bos) + ["$A:0"] + [f"{eos}:0"] * bool(eos))
    pair = single + " " + " ".join([f"{bos}:1"] * bool(bos) + ["$B:1"] + [f"{eos}:1"] * bool(eos))
    special = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
