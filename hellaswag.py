"""HellaSwag in llm.c's completion style: the model picks the ending it finds least surprising.

Each example is a context and four endings. Every ending is appended to the context (context tokens = encode(ctx),
ending tokens = encode(" " + ending)) and scored by the cross-entropy of its own tokens; `acc_norm`, the number llm.c
logs as `eval:`, picks the ending with the lowest average per-token loss, `acc` the lowest sum. OpenAI's GPT-2 124M
scores 0.2945-0.2955 acc_norm on the 10,042 validation examples, GPT-3 Small (125M) 0.337.

    python hellaswag.py --model gpt2                  # OpenAI's checkpoint from the Hugging Face hub
    python hellaswag.py --model out --limit 1000      # a training run (latest checkpoint) or an HF directory

The validation file is downloaded once from the HellaSwag repository into $HELLASWAG_CACHE (default
~/.cache/hellaswag) and reused; `--data PATH` reads a local copy instead.
"""
import argparse
import json
import math
import os
import sys
import urllib.error
import urllib.request
from typing import NamedTuple

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
            endings = example.get("endings")
            if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
                raise ValueError(f"{where}: 'endings' must be a list of 4 strings")
            label = example.get("label")
            if type(label) is not int or not 0 <= label <= 3:
                raise ValueError(f"{where}: 'label' must be an integer 0-3, got {label!r}")
            examples.append(example)
    if not examples:
        raise ValueError(f"{path}: no HellaSwag examples in the file")
    return examples


def fetch(url, path):
    """Write the body of `url` to `path`; a response shorter than its Content-Length raises ConnectionError."""
    with open(path, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
        expected = int(response.headers["Content-Length"]) if response.headers.get("Content-Length") else None
        with tqdm(total=expected, unit="B", unit_scale=True, desc=f"downloading {os.path.basename(path)}") as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
    received = os.path.getsize(path)
    if expected is not None and received != expected:
        raise ConnectionError(f"incomplete ({received} of {expected} bytes)")


def download(url, path):
    """Fetch `url` to `path` through a temporary file, so an interrupted download never looks like a cached one.

    No network (or a failed transfer) raises FileNotFoundError: one line naming the URL, the file it was meant to fill
    and the two ways round it; FileNotFoundError because what the caller lacks is that file.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def fetch_and_check(tmp_path):  # a temporary name per process: ranks downloading at once never share a file
        try:
            fetch(url, tmp_path)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", None) or e
            raise FileNotFoundError(
                f"{path} is not cached and downloading {url} failed ({reason}); without network, pass a local copy "
                f"of hellaswag_val.jsonl (hellaswag.py --data PATH, or its path as train_gpt2's hellaswag=) or copy "
                f"it to {path}") from None
        read_jsonl(tmp_path)  # a corrupt download must fail here, not poison the cache

    atomic_save(path, fetch_and_check)


def load_examples(path=None):
    """The examples of a local HellaSwag jsonl file, or (path None) of the validation set, downloaded once, cached."""
    if path is None:
        path = os.path.join(cache_dir(), "hellaswag_val.jsonl")
        if not os.path.isfile(path):
            download(HELLASWAG_URL, path)
    return read_jsonl(path)


class Rendered(NamedTuple):
    """One example as tokens: the context, its 4 endings (each with its leading space) and the label."""
    context: list
    endings: list
    label: int


def render_example(example, enc):
    """(context tokens, [tokens of each of the 4 endings]); an ending gets the space it has after the context."""
    context = enc.encode_ordinary(example["ctx"])
    endings = [enc.encode_ordinary(" " + ending) for ending in example["endings"]]
    return context, endings


def render_all(examples):
    """Every example tokenized, once: a list of Rendered that evaluate() takes in place of the examples, so a training
    run that scores HellaSwag at every evaluation tokenizes the set only at the start."""
    enc = gpt2_encoding()
    return [Rendered(*render_example(example, enc), example["label"]) for example in examples]


def pack(rendered, block_size):
    """The rows of some rendered examples (4 per example, in order) as one right-padded batch, and where their ending
    tokens are: (tokens (R, T), row and position of every logit that predicts an ending token, that token, the number
    of scored tokens per row), all CPU tensors.

    A row longer than block_size keeps its last block_size tokens, i.e. the context is cut from the left; an ending
    token is scored only when the token before it is in the window. Padding is harmless: attention is causal.
    """
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
    """model(tokens)'s logits (B, T, vocab), under autocast when a dtype is given; a (logits, loss) pair is unpacked."""
    with torch.autocast(torch.device(tokens.device).type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(tokens)
    return out[0] if isinstance(out, tuple) else out


def scored_losses(model, batch, *, device, autocast_dtype=None):
    """Sum and mean cross-entropy of every row of a pack()ed batch, float32 tensors (R/4, 4) left on `device`.

    Only the logits of ending positions are gathered (indexing never copies the whole (R, T, vocab) tensor), and the
    log-softmax runs on them in float32 whatever the autocast dtype."""
    tokens, row_of, position, target, scored = (t.to(device, non_blocking=True) for t in batch)
    logits = forward_logits(model, tokens, autocast_dtype)
    token_losses = F.cross_entropy(logits[row_of, position].float(), target, reduction="none")
    sums = torch.zeros(len(tokens), device=tokens.device).index_add_(0, row_of, token_losses)
    return sums.view(-1, 4), (sums / scored.clamp(min=1)).view(-1, 4)


@torch.no_grad()
def ending_losses(model, rendered, *, device, autocast_dtype=None):
    """Sum and mean cross-entropy of each ending of each Rendered example: two float32 CPU tensors (N, 4), one
    forward."""
    sums, means = scored_losses(model, pack(rendered, model.config.block_size), device=device,
                                autocast_dtype=autocast_dtype)
    return sums.cpu(), means.cpu()


@torch.no_grad()
def evaluate(model, examples, *, device, rank=0, world_size=1, autocast_dtype=None, limit=None, batch_size=4,
             progress=False):
    """HellaSwag accuracy of `model` on `examples` (the first `limit` of them when given).

    `examples` is render_all()'s list (tokenized once per run) or load_examples()'s dicts (tokenized at every call).
    Rank r scores examples i % world_size == r, `batch_size` examples (4 * batch_size rows) per forward; every rank
    runs the same number of forwards, and with world_size > 1 the counts are summed over ranks with all_reduce, so
    every rank returns the totals: dict(acc_norm, acc, correct_norm, correct, total).
    """
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"HellaSwag needs the GPT-2 vocabulary ({VOCAB_SIZE} tokens); this model has "
                         f"{model.config.vocab_size}")
    examples = examples[:limit] if limit is not None else examples
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
    batches = range(num_batches)
    if progress and rank == 0:
        batches = tqdm(batches, desc="hellaswag", unit="batch")
    for b in batches:
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        if not chunk:
            forward_logits(model, torch.zeros(1, 1, dtype=torch.long, device=device), autocast_dtype)
            continue
        sums, means = scored_losses(model, pack(chunk, model.config.block_size), device=device,
                                    autocast_dtype=autocast_dtype)
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
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")

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
