"""GPT-2 BPE through tiktoken, built from the BPE files shipped in data/gpt2_bpe/.

tiktoken.get_encoding("gpt2") downloads these two files on first use; cluster compute nodes often have no internet,
so we build the identical encoding from the copies in this repository (checked against the same sha256 sums tiktoken
uses). `encode_ordinary` treats "<|endoftext|>" in text as ordinary text; EOT is id 50256.
"""
import hashlib
import os
from functools import lru_cache

BPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2_bpe")
SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
EOT_ID = 50256
VOCAB_SIZE = 50257


@lru_cache(maxsize=None)
def gpt2_encoding(bpe_dir=BPE_DIR):
    """The tiktoken "gpt2" encoding, built offline from `bpe_dir` after checking both files' sha256."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    for name, expected in SHA256.items():
        path = os.path.join(bpe_dir, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: GPT-2 BPE file missing (it ships in data/gpt2_bpe/ of this repository)")
        with open(path, "rb") as f:
            actual = hashlib.sha256(f.read()).hexdigest()
        if actual != expected:
            raise ValueError(f"{path}: sha256 {actual} is not the GPT-2 BPE file's {expected}; the file is corrupt")
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(bpe_dir, "vocab.bpe"), encoder_json_file=os.path.join(bpe_dir, "encoder.json"))
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )
