"""The shipped BPE files give exactly tiktoken's own "gpt2" encoding, offline."""
import os
import shutil

import pytest

from conftest import ROOT
import tokenizer


def tiktoken_reference(tmp_path, monkeypatch):
    # tiktoken caches its downloads under the sha1 of their URL; seeding that cache with the shipped files makes the
    # real get_encoding("gpt2") work offline, and it verifies the files against its own expected hashes.
    cache = tmp_path / "tiktoken_cache"
    cache.mkdir()
    shutil.copy(os.path.join(tokenizer.BPE_DIR, "vocab.bpe"), cache / "6d1cbeee0f20b3d9449abfede4726ed8212e3aee")
    shutil.copy(os.path.join(tokenizer.BPE_DIR, "encoder.json"), cache / "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    import tiktoken
    return tiktoken.get_encoding("gpt2")


def test_matches_tiktoken_gpt2(tmp_path, monkeypatch):
    ours, ref = tokenizer.gpt2_encoding(), tiktoken_reference(tmp_path, monkeypatch)
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        text = f.read()[:200_000]
    samples = [text, "Hello world", " <|endoftext|> is ordinary text here", "naïve café 東京 🙂\n\n\t  x", ""]
    for s in samples:
        assert ours.encode_ordinary(s) == ref.encode_ordinary(s)
    assert ours.encode("Hello world") == [15496, 995]
    assert ours.eot_token == tokenizer.EOT_ID == 50256 and ours.n_vocab == tokenizer.VOCAB_SIZE == 50257


def test_corrupt_bpe_file_is_named(tmp_path):
    bad = tmp_path / "bpe"
    shutil.copytree(tokenizer.BPE_DIR, bad)
    with open(bad / "vocab.bpe", "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match=r"vocab\.bpe.*corrupt"):
        tokenizer.gpt2_encoding(str(bad))
    shutil.copy(os.path.join(tokenizer.BPE_DIR, "vocab.bpe"), bad / "vocab.bpe")
    os.remove(bad / "encoder.json")
    with pytest.raises(FileNotFoundError, match=r"encoder\.json"):
        tokenizer.gpt2_encoding(str(bad))
