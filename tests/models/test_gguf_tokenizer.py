"""Our torch-free GGUF tokenizer equals transformers' own GGUF tokenizer loader."""

import os
import subprocess
import sys

import pytest

from jaxpage.engine.tokenizer import convert_gguf_file_tokenizer

TEXTS = ["Hello, my name is", "  leading spaces\tand tabs\n\nnew lines", "ünïcödé 日本語 😀",
         "<|im_start|>user\nhi<|im_end|>", "1234567890 3.14159", "def f(x):\n    return x ** 2",
         "", "a" * 300, "The capital of France is Paris."]


@pytest.fixture(scope="module")
def both(smollm2_path):
    from transformers import AutoTokenizer

    ours = convert_gguf_file_tokenizer(smollm2_path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path),
                                           gguf_file=os.path.basename(smollm2_path))
    return ours, theirs


def test_same_ids_text_and_specials(both):
    ours, theirs = both
    for text in TEXTS:
        assert ours(text).input_ids == theirs(text).input_ids, text
        ids = theirs(text).input_ids
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id,
                                                                 theirs.bos_token_id, len(theirs))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


def test_conversion_works_without_torch(smollm2_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from jaxpage.engine.tokenizer import convert_gguf_file_tokenizer\n"
            f"t = convert_gguf_file_tokenizer({smollm2_path!r})\n"
            "assert t('Hello').input_ids == [19556], t('Hello').input_ids\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
