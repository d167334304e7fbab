"""The GGUF tokenizer read by `tokenizers` (no transformers import) gives transformers' ids, text and chat prompt."""
from __future__ import annotations

import subprocess
import sys

import pytest

from attnlab.model.files import resolve

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Hamlet?"},
            {"role": "assistant", "content": "A prince of Denmark."}, {"role": "user", "content": "And Ophelia?"}]
SPECIALS = " <|im_start|>user\nhi<|im_end|>\n<|endoftext|> <|im_start|>assistant\n"


@pytest.fixture(scope="module")
def pair():
    """(ours, transformers' tokenizer converted from the same GGUF file directly, not from our cache)."""
    from transformers import AutoTokenizer

    from attnlab.model.tokenizer import GGUFTokenizer, load_tokenizer
    path = resolve("smollm2-135m")
    ours = load_tokenizer(path)
    assert isinstance(ours, GGUFTokenizer)
    return ours, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def texts():
    from attnlab.data import corpus
    plays = corpus("shakespeare")
    return [plays[:20000], plays[-5000:], SPECIALS, "  two spaces\n\n\ttab  ", "émoji 🤖 中文 don't ."]


def test_same_ids_and_text_as_transformers(pair):
    ours, ref = pair
    for text in texts():
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special, split_special_tokens=True) == \
                ref.encode(text, add_special_tokens=special, split_special_tokens=True)
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.encode(SPECIALS, add_special_tokens=False) != ours.encode(SPECIALS, split_special_tokens=True)


def test_same_specials_vocabulary_and_chat_prompt(pair):
    ours, ref = pair
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                         ref.pad_token_id)
    assert (ours.vocab_size, len(ours), ours.get_vocab()) == (ref.vocab_size, len(ref), ref.get_vocab())
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in ref.added_tokens_decoder.items()}
    assert ours.convert_tokens_to_ids("<|im_end|>") == ref.convert_tokens_to_ids("<|im_end|>")
    assert ref.chat_template and ours.chat_template == ref.chat_template
    for gen in (True, False):
        text = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == \
            ref.encode(text, add_special_tokens=False)


def test_gguf_load_imports_no_transformers():
    """A fresh process: attnlab.load of the embedded GGUF (tokenizer cached by the fixtures above) keeps
    transformers out, and `import attnlab.engine` pulls no tokenizer, gguf reader or compiler."""
    code = ("import sys, attnlab.engine\n"
            "heavy = ('transformers', 'tokenizers', 'gguf', 'jinja2', 'torch._dynamo', 'torch._inductor', 'sympy')\n"
            "print([m for m in heavy if m in sys.modules])\n"
            "from attnlab.model.files import resolve\n"
            "from attnlab.model.tokenizer import load_tokenizer\n"
            "tok = load_tokenizer(resolve('smollm2-135m'))\n"
            "print(type(tok).__name__, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", out
    assert out[1] == "GGUFTokenizer False", out


def test_byte_level_gguf_needs_no_cache(tmp_path):
    """A fresh process with an empty cache folder: the embedded GGUF's tokenizer is built from its header (no
    first-use conversion, nothing written) and gives the ids of the converted one the fixtures compare."""
    code = ("import os, sys\n"
            "from attnlab.model.files import resolve\n"
            "from attnlab.model.tokenizer import load_tokenizer\n"
            "tok = load_tokenizer(resolve('smollm2-135m'))\n"
            f"print(tok.folder, os.listdir({str(tmp_path)!r}), 'transformers' in sys.modules)\n"
            "print(tok.encode('Hello, world! <|im_end|> 12345'))\n")
    env = {**__import__("os").environ, "ATTNLAB_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    first, ids = out.stdout.split("\n")[:2]
    assert first == "None [] False", out.stdout
    from transformers import AutoTokenizer
    path = resolve("smollm2-135m")
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ids == str(ref.encode("Hello, world! <|im_end|> 12345"))
