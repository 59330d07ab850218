"""HellaSwag in llm.c's completion style: the model picks the ending it finds least surprising.

    python hellaswag.py --model gpt2                  # OpenAI's checkpoint from the Hugging Face hub
    python hellaswag.py --model out --limit 1000      # a training run (latest checkpoint) or an HF directory

Each ending (" " + ending) is scored by the cross-entropy of its own tokens after the context: acc_norm (llm.c's
`eval:`) picks the lowest mean, acc the lowest sum. The validation set is cached in $HELLASWAG_CACHE.
"""
import argparse
import json
import math
import os
import sys
import urllib.error
import urllib.request
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from atomic_io import atomic_save
from model import load_model
from tokenizer import VOCAB_SIZE, gpt2_encoding

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"


def cache_dir():
    return os.environ.get("HELLASWAG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hellaswag")


def read_jsonl(path):
    """Every example of a HellaSwag jsonl file, each line checked; a bad line raises ValueError naming file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: HellaSwag file not found")
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(example, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(example).__name__}")
            if not isinstance(example.get("ctx"), str):
                raise ValueError(f"{where}: 'ctx' must be a string")
            endings, label = example.get("endings"), example.get("label")
            if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
                raise ValueError(f"{where}: 'endings' must be a list of 4 strings")
            if type(label) is not int or not 0 <= label <= 3:
                raise ValueError(f"{where}: 'label' must be an integer 0-3, got {label!r}")
            examples.append(example)
    if not examples:
        raise ValueError(f"{path}: no HellaSwag examples in the file")
    return examples


def fetch(url, tmp_path, path):
    """Download `url` to `tmp_path`; a failed transfer raises FileNotFoundError: the caller lacks the file `path`."""
    try:
        with open(tmp_path, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            expected = int(response.headers["Content-Length"]) if response.headers.get("Content-Length") else None
            with tqdm(total=expected, unit="B", unit_scale=True, desc=f"downloading {os.path.basename(path)}") as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
        if expected is not None and os.path.getsize(tmp_path) != expected:
            raise ConnectionError(f"incomplete ({os.path.getsize(tmp_path)} of {expected} bytes)")
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise FileNotFoundError(f"{path} is not cached and downloading {url} failed ({getattr(e, 'reason', e)}); "
                                f"without network, pass a local hellaswag_val.jsonl as --data PATH (train_gpt2: "
                                f"hellaswag=PATH) or copy it to {path}") from None
    read_jsonl(tmp_path)  # a corrupt download fails here, before it is published to the cache


def load_examples(path=None):
    """The examples of a local HellaSwag jsonl file, or (path None) of the validation set, downloaded once, cached."""
    if path is None:
        path = os.path.join(cache_dir(), "hellaswag_val.jsonl")
        if not os.path.isfile(path):
            os.makedirs(cache_dir(), exist_ok=True)
            atomic_save(path, lambda tmp_path: fetch(HELLASWAG_URL, tmp_path, path))  # never a half cached file
    return read_jsonl(path)


Rendered = namedtuple("Rendered", "context endings label")  # one example as tokens; endings with their leading space


def render_example(example, enc):
    """(context tokens, [tokens of each of the 4 endings]); an ending gets the space it has after the context."""
    return enc.encode_ordinary(example["ctx"]), [enc.encode_ordinary(" " + ending) for ending in example["endings"]]


def render_all(examples):
    """Every example as a Rendered, which evaluate() takes in place of the dicts: a run tokenizes the set once."""
    enc = gpt2_encoding()
    return [Rendered(*render_example(example, enc), example["label"]) for example in examples]


def pack(rendered, block_size):
    """Rendered examples as one right-padded batch of 4 rows each: (tokens (R, T), row and position of each logit that
    predicts an ending token, that token, scored tokens per row). Rows keep their last block_size tokens."""
    rows, row_of, position, target, scored = [], [], [], [], []
    for example in rendered:
        for ending in example.endings:
            row = (example.context + ending)[-block_size:]
            n = min(len(ending), len(row) - 1)
            # the logit at position t predicts token t + 1: the last n tokens are predicted from the n before them
            row_of += [len(rows)] * n
            position += range(len(row) - 1 - n, len(row) - 1)
            target += row[len(row) - n:]
            scored.append(n)
            rows.append(row)
    width = max(len(row) for row in rows)
    tokens = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    return tokens, *(torch.tensor(v, dtype=torch.long) for v in (row_of, position, target, scored))


def forward_logits(model, tokens, autocast_dtype):
    """model(tokens)'s logits, under autocast when a dtype is given; a (logits, loss) pair is unpacked."""
    with torch.autocast(torch.device(tokens.device).type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(tokens)
    return out[0] if isinstance(out, tuple) else out


def scored_losses(model, rendered, *, device, autocast_dtype=None):
    """Sum and mean cross-entropy of each ending, float32 (N, 4) on `device`; only the ending positions' logits are
    gathered and log-softmaxed (in float32), never the whole (R, T, vocab) tensor."""
    batch = pack(rendered, model.config.block_size)
    tokens, row_of, position, target, scored = (t.to(device, non_blocking=True) for t in batch)
    logits = forward_logits(model, tokens, autocast_dtype)
    token_losses = F.cross_entropy(logits[row_of, position].float(), target, reduction="none")
    sums = torch.zeros(len(tokens), device=tokens.device).index_add_(0, row_of, token_losses)
    return sums.view(-1, 4), (sums / scored.clamp(min=1)).view(-1, 4)


@torch.no_grad()
def ending_losses(model, rendered, *, device, autocast_dtype=None):
    """Sum and mean cross-entropy of each ending of each Rendered example, (N, 4) CPU tensors, in one forward."""
    return tuple(t.cpu() for t in scored_losses(model, rendered, device=device, autocast_dtype=autocast_dtype))


@torch.no_grad()
def evaluate(model, examples, *, device, rank=0, world_size=1, autocast_dtype=None, limit=None, batch_size=4,
             progress=False):
    """HellaSwag accuracy on render_all()'s list or load_examples()'s dicts (the first `limit`): rank r scores examples
    i % world_size == r, `batch_size` per forward; every rank returns the all_reduced dict(acc_norm, acc, counts)."""
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"HellaSwag needs the GPT-2 vocabulary ({VOCAB_SIZE} tokens), not {model.config.vocab_size}")
    examples = examples[:limit]
    if not examples:
        raise ValueError("HellaSwag: no examples to evaluate")
    rendered = examples if isinstance(examples[0], Rendered) else render_all(examples)
    # similar lengths in one batch waste less compute on padding; the order does not change the counts
    mine = sorted(rendered[rank::world_size], key=lambda ex: len(ex.context) + max(len(e) for e in ex.endings))
    # every rank runs the same number of forwards: a sharded (FSDP) model gathers its weights collectively in each one
    num_batches = math.ceil(math.ceil(len(rendered) / world_size) / batch_size)
    was_training = model.training
    model.eval()
    correct = torch.zeros(2, dtype=torch.long, device=device)  # (by mean, by sum); on device: no sync per batch
    for b in tqdm(range(num_batches), desc="hellaswag", unit="batch", disable=not (progress and rank == 0)):
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        if not chunk:
            forward_logits(model, torch.zeros(1, 1, dtype=torch.long, device=device), autocast_dtype)
            continue
        sums, means = scored_losses(model, chunk, device=device, autocast_dtype=autocast_dtype)
        labels = torch.tensor([ex.label for ex in chunk]).to(device, non_blocking=True)
        correct += torch.stack([(means.argmin(dim=1) == labels).sum(), (sums.argmin(dim=1) == labels).sum()])
    model.train(was_training)
    counts = torch.cat([correct, torch.tensor([len(mine)], device=device)])
    if world_size > 1:
        dist.all_reduce(counts)
    correct_norm, correct, total = counts.tolist()
    return dict(acc_norm=correct_norm / total, acc=correct / total, correct_norm=correct_norm, correct=correct,
                total=total)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="gpt2 (or another hub name), an HF GPT-2 directory, a training out_dir or checkpoint")
    parser.add_argument("--data", default=None, help="local hellaswag jsonl (default: download the validation set)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    parser.add_argument("--batch-size", type=int, default=4, help="examples per forward")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="autocast dtype (float32 = no autocast)")
    args = parser.parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.batch_size < 1:
        parser.error("--limit and --batch-size must be at least 1")
    try:
        examples = load_examples(args.data)
        model = load_model(args.model).to(args.device)
        autocast_dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
        result = evaluate(model, examples, device=args.device, autocast_dtype=autocast_dtype, limit=args.limit,
                          batch_size=args.batch_size, progress=True)
    except (FileNotFoundError, ValueError, OSError) as e:
        sys.exit(f"hellaswag.py: error: {e}")
    print(f"hellaswag {args.model}: acc_norm {result['acc_norm']:.4f} ({result['correct_norm']}/{result['total']}), "
          f"acc {result['acc']:.4f} ({result['correct']}/{result['total']})")
    return result


if __name__ == "__main__":
    main()
