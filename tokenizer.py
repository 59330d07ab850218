"""GPT-2's BPE through tiktoken, built offline from the two files tiktoken would download: compute
nodes often have no internet, so data/gpt2_bpe/ ships them, checked against the same sha256 sums.
EOT is id 50256; encode_ordinary treats "<|endoftext|>" in text as ordinary text."""
import hashlib
import json
import os
import pathlib
from functools import lru_cache

from atomic_io import atomic_write

BPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2_bpe")
SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
          "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
EOT, EOT_ID, VOCAB_SIZE = "<|endoftext|>", 50256, 50257


@lru_cache(maxsize=None)
def gpt2_encoding(bpe_dir=BPE_DIR):
    """The tiktoken "gpt2" encoding, built from `bpe_dir` after checking both files' sha256."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    for name, expected in SHA256.items():
        path = os.path.join(bpe_dir, name)  # a missing one is a FileNotFoundError naming it
        actual = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
        if actual != expected:
            raise ValueError(f"{path}: sha256 {actual} is not GPT-2's; the file is corrupt")
    vocab, encoder = os.path.join(bpe_dir, "vocab.bpe"), os.path.join(bpe_dir, "encoder.json")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab, encoder)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: EOT_ID}, explicit_n_vocab=VOCAB_SIZE)


# What transformers saves for the hub's gpt2 tokenizer, defaults spelled out so none is guessed.
# No clean-up of spaces before punctuation, so that decode gives back what tiktoken decodes.
EOT_TOKEN = {"content": EOT, "lstrip": False, "normalized": True, "rstrip": False,
             "single_word": False, "special": True}
SPECIAL_TOKENS = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
HF_TOKENIZER_CONFIG = {
    "tokenizer_class": "GPT2Tokenizer", **SPECIAL_TOKENS, "pad_token": None, "add_bos_token": False,
    "add_prefix_space": False, "errors": "replace", "clean_up_tokenization_spaces": False,
    "added_tokens_decoder": {str(EOT_ID): EOT_TOKEN}}


def write_hf_tokenizer(directory, bpe_dir=BPE_DIR, model_max_length=1024):
    """GPT-2's tokenizer files in `directory` as the hub's gpt2 has them, tokenizer.json included.
    model_max_length is the model's context (n_positions): readers truncate and warn by it."""
    gpt2_encoding(bpe_dir)  # checks both files' sha256 before we copy them
    vocab = pathlib.Path(bpe_dir, "encoder.json").read_bytes()
    merges = pathlib.Path(bpe_dir, "vocab.bpe").read_bytes()
    # The BPE as transformers' GPT2Converter builds it; the merges are vocab.bpe after its header.
    fast = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": EOT_ID, **EOT_TOKEN}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "vocab": json.loads(vocab), "merges": merges.decode("utf-8").split("\n")[1:-1]}}
    config = dict(HF_TOKENIZER_CONFIG, model_max_length=model_max_length)
    os.makedirs(directory, exist_ok=True)
    files = {"vocab.json": vocab, "merges.txt": merges,
             "tokenizer.json": json.dumps(fast, ensure_ascii=False).encode("utf-8"),
             "tokenizer_config.json": json.dumps(config, indent=2).encode() + b"\n",
             "special_tokens_map.json": json.dumps(SPECIAL_TOKENS, indent=2).encode() + b"\n"}
    for name, content in files.items():
        with atomic_write(os.path.join(directory, name)) as f:
            f.write(content)
