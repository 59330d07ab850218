"""The shipped BPE files give exactly tiktoken's own "gpt2" encoding, offline, and the Hugging Face tokenizer files
written from them load in transformers (slow and fast, with and without tokenizer.json) and encode the same."""
import json
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
    with pytest.raises(ValueError, match=r"vocab\.bpe.*corrupt"):
        tokenizer.write_hf_tokenizer(str(tmp_path / "hf"), bpe_dir=str(bad))
    assert not (tmp_path / "hf").exists()
    shutil.copy(os.path.join(tokenizer.BPE_DIR, "vocab.bpe"), bad / "vocab.bpe")
    os.remove(bad / "encoder.json")
    with pytest.raises(FileNotFoundError, match=r"encoder\.json"):
        tokenizer.gpt2_encoding(str(bad))


def hf_samples():
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        shakespeare = f.read()[:100_000]
    return [shakespeare, "Hello world", "naïve café 東京 🙂 Ünïcödé ½ \u200b", "<|endoftext|>First<|endoftext|> x",
            "a <|endoftext|>\n\n<|endoftext|>", "  lead\n\n\n\t\t  runs   of    space  \r\n \t", " ", ""]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "tokenizer"
    tokenizer.write_hf_tokenizer(str(directory))
    return directory


def test_hf_files(hf_dir):
    assert sorted(os.listdir(hf_dir)) == ["merges.txt", "special_tokens_map.json", "tokenizer.json",
                                          "tokenizer_config.json", "vocab.json"]  # no temporary left behind
    for name, shipped in (("vocab.json", "encoder.json"), ("merges.txt", "vocab.bpe")):
        assert (hf_dir / name).read_bytes() == open(os.path.join(tokenizer.BPE_DIR, shipped), "rb").read()
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "GPT2Tokenizer" and config["model_max_length"] == 1024
    assert config["add_prefix_space"] is False and config["add_bos_token"] is False
    assert json.loads((hf_dir / "special_tokens_map.json").read_text()) == dict.fromkeys(
        ["bos_token", "eos_token", "unk_token"], "<|endoftext|>")


@pytest.mark.slow
@pytest.mark.parametrize("with_tokenizer_json", [True, False])
def test_transformers_encodes_like_tiktoken(hf_dir, tmp_path, with_tokenizer_json):
    """Every way transformers loads the directory: "<|endoftext|>" in text is the special token (tiktoken's
    allowed_special), or ordinary text with split_special_tokens; decode gives the text back."""
    from transformers import AutoTokenizer, GPT2Tokenizer, GPT2TokenizerFast

    if not with_tokenizer_json:  # transformers builds the fast tokenizer from vocab.json and merges.txt
        hf_dir = shutil.copytree(hf_dir, tmp_path / "no_tokenizer_json")
        os.remove(hf_dir / "tokenizer.json")
    enc = tokenizer.gpt2_encoding()
    loaders = [AutoTokenizer.from_pretrained, lambda d: AutoTokenizer.from_pretrained(d, use_fast=False),
               GPT2Tokenizer.from_pretrained, GPT2TokenizerFast.from_pretrained]
    for load in loaders:
        hf = load(str(hf_dir))
        assert len(hf) == tokenizer.VOCAB_SIZE and hf.eos_token_id == hf.bos_token_id == tokenizer.EOT_ID
        assert hf.eos_token == "<|endoftext|>" and hf.model_max_length == 1024
        for text in hf_samples():
            ids = hf(text)["input_ids"]
            assert ids == enc.encode(text, allowed_special="all"), (type(hf).__name__, text[:40])
            assert hf(text, split_special_tokens=True)["input_ids"] == enc.encode_ordinary(text)
            assert hf.decode(ids) == enc.decode(ids) == text
        assert hf("<|endoftext|>")["input_ids"] == [tokenizer.EOT_ID]

