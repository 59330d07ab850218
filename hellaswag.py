"""HellaSwag in llm.c's completion style: acc_norm picks the ending whose tokens have the lowest mean cross-entropy.

    python hellaswag.py --model gpt2                  # OpenAI's checkpoint from the Hugging Face hub
    python hellaswag.py --model out --limit 1000      # a training run (latest checkpoint) or an HF directory
"""
import argparse
import http.client
import json
import os
import sys
import urllib.request
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from atomic_io import atomic_write
from model import load_model
from tokenizer import VOCAB_SIZE, gpt2_encoding

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hellaswag")  # unless $HELLASWAG_CACHE names another
Rendered = namedtuple("Rendered", "context endings label")  # one example as tokens; endings with their leading space
FIELDS = {"ctx": ("a string", lambda v: type(v) is str),  # what an example holds: json.loads makes exact types
          "endings": ("a list of 4 strings", lambda v: type(v) is list and [type(e) for e in v] == [str] * 4),
          "label": ("an integer 0-3", lambda v: type(v) is int and 0 <= v <= 3)}


def read_jsonl(path, text=None):
    """Every example of a HellaSwag jsonl file (or of its `text`); a bad line raises ValueError naming file and line."""
    if text is None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: HellaSwag file not found")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    examples = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_number}"
        try:
            example = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(example, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(example).__name__}")
        for field, (rule, valid) in FIELDS.items():
            if not valid(value := example.get(field)):
                raise ValueError(f"{where}: {field!r} must be {rule}, got {value!r:.60}")
        examples.append(example)
    if not examples:
        raise ValueError(f"{path}: no HellaSwag examples in the file")
    return examples


def load_examples(path=None):
    """The examples of a local HellaSwag jsonl file, or (path None) of the validation set, downloaded once, cached."""
    cached = os.path.join(os.environ.get("HELLASWAG_CACHE") or CACHE_DIR, "hellaswag_val.jsonl")
    if path is not None or os.path.isfile(cached):
        return read_jsonl(cached if path is None else path)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as response:
            data = response.read()  # a body cut short of its Content-Length raises IncompleteRead
    except (OSError, http.client.HTTPException) as e:  # no network or name resolution, a timeout, a reset
        raise FileNotFoundError(f"{cached} is not cached and downloading {HELLASWAG_URL} failed "
                                f"({getattr(e, 'reason', e)}); without network, pass a local hellaswag_val.jsonl as "
                                f"--data PATH (train_gpt2: hellaswag=PATH) or copy it to {cached}") from None
    examples = read_jsonl(HELLASWAG_URL, data.decode("utf-8"))  # a corrupt download fails here and is not cached
    with atomic_write(cached) as f:
        f.write(data)
    return examples


def render_all(examples):
    """Every example as a Rendered, which evaluate() takes in place of the dicts: a run tokenizes the set once."""
    enc = gpt2_encoding()
    return [Rendered(enc.encode_ordinary(ex["ctx"]), [enc.encode_ordinary(" " + e) for e in ex["endings"]], ex["label"])
            for ex in examples]  # each ending gets the space it has after the context


def to_device(values, device):
    """A long tensor of `values` on `device`; to a GPU from pinned memory without waiting for the copy."""
    tensor = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def row_length(example, block_size):
    """The tokens in the longest of an example's 4 rows (context + ending, cut to block_size)."""
    return min(len(example.context) + max(map(len, example.endings)), block_size)


@torch.no_grad()
def ending_losses(model, rendered, *, device, autocast_dtype=None):
    """Sum and mean float32 cross-entropy (N, 4) of the endings, one forward of 4 right-padded rows per example."""
    block_size = model.config.block_size
    width = max(row_length(example, block_size) for example in rendered)
    tokens, row_of, position = [], [], []
    for example in rendered:
        for ending in example.endings:
            row = (example.context + ending)[-block_size:]
            n = min(len(ending), len(row) - 1)
            # the logit at position t predicts token t + 1: the last n tokens are predicted from the n before them
            row_of += [len(tokens) // width] * n
            position += range(len(row) - 1 - n, len(row) - 1)
            tokens += row + [0] * (width - len(row))  # right-padded: no real token attends to the padding
    tokens = to_device(tokens, device).view(-1, width)
    row_of, position = to_device(row_of, device), to_device(position, device)
    with torch.autocast(tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(tokens, logits_at=(row_of, position))[0]  # the endings' logits only, not every position's
    targets = tokens[row_of, position + 1]
    # in fp32, a few thousand rows at a time: a micro-batch's endings can have tens of thousands of logit rows
    token_losses = torch.cat([F.cross_entropy(logits[i:i + 4096].float(), targets[i:i + 4096], reduction="none")
                              for i in range(0, len(targets), 4096)])
    sums = torch.zeros(len(tokens), device=tokens.device).index_add_(0, row_of, token_losses)
    return sums.view(-1, 4), (sums / torch.bincount(row_of, minlength=len(tokens)).clamp(min=1)).view(-1, 4)


def plan_batches(rendered, block_size, batch_size=None, batch_tokens=None):
    """The examples of each forward: batch_size examples each, or as many as fit batch_tokens (4 rows per example,
    padded to the longest), at least one. Shortest first: similar lengths in one batch waste less on padding."""
    batches = []
    for example in sorted(rendered, key=lambda ex: row_length(ex, block_size)):
        # sorted, so this example's rows are the batch's longest: all its rows are padded to their length
        if batches and (len(batches[-1]) < batch_size if batch_size else
                        4 * (len(batches[-1]) + 1) * row_length(example, block_size) <= batch_tokens):
            batches[-1].append(example)
        else:
            batches.append([example])
    return batches


STOP_CHECK_EVERY = 4  # batches between two stop checks: each is a collective and a host sync


@torch.no_grad()
def evaluate(model, examples, *, device, rank=0, world_size=1, autocast_dtype=None, limit=None, batch_size=None,
             batch_tokens=8192, progress=False, stopped=None):
    """Accuracy on the first `limit` of render_all()'s or load_examples()'s list, batch_size examples per forward or
    (batch_size None) as many as batch_tokens padded tokens hold; rank r scores examples i % world_size == r, every
    rank returns the all_reduced dict, or None once `stopped()` (a collective, asked every few batches) says so."""
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"HellaSwag needs the GPT-2 vocabulary ({VOCAB_SIZE} tokens), not {model.config.vocab_size}")
    rendered = examples[:limit] if isinstance(examples[0], Rendered) else render_all(examples[:limit])
    block_size = model.config.block_size
    # every rank plans every rank's batches (no collective): all run as many forwards (a sharded one is collective)
    num_batches = max(len(plan_batches(rendered[r::world_size], block_size, batch_size, batch_tokens))
                      for r in range(world_size))
    mine = plan_batches(rendered[rank::world_size], block_size, batch_size, batch_tokens)
    counts = torch.tensor([0, 0, sum(map(len, mine))], device=device)  # right by mean, by sum; scored. No host sync
    for b in tqdm(range(num_batches), desc="hellaswag", unit="batch", disable=not (progress and rank == 0)):
        if stopped is not None and b % STOP_CHECK_EVERY == 0 and stopped():
            return None
        chunk = mine[b] if b < len(mine) else []
        # a rank out of examples runs a forward anyway (FSDP gathers weights collectively); label -1 counts nothing
        sums, means = ending_losses(model, chunk or rendered[:1], device=device, autocast_dtype=autocast_dtype)
        labels = to_device([ex.label for ex in chunk] or [-1], device)
        counts[:2] += (torch.stack([means, sums]).argmin(dim=2) == labels).sum(dim=1)
    if world_size > 1:
        dist.all_reduce(counts)
    by_mean, by_sum, total = counts.tolist()
    return dict(acc_norm=by_mean / total, acc=by_sum / total, correct_norm=by_mean, correct=by_sum, total=total)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a hub name (gpt2), an HF GPT-2 directory, a run or checkpoint")
    parser.add_argument("--data", help="a local jsonl (default: the validation set, cached in $HELLASWAG_CACHE)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    parser.add_argument("--batch-tokens", type=int, default=8192,
                        help="padded tokens per forward (4 rows per example; at least one example)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="autocast dtype")
    args = parser.parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.batch_tokens < 1:
        parser.error("--limit and --batch-tokens must be at least 1")
    try:
        examples = load_examples(args.data)
        model = load_model(args.model).to(args.device)
        result = evaluate(model, examples, device=args.device, limit=args.limit, batch_tokens=args.batch_tokens,
                          autocast_dtype=None if args.dtype == "float32" else getattr(torch, args.dtype), progress=True)
    except (ValueError, OSError) as e:
        sys.exit(f"hellaswag.py: error: {e}")
    print(f"hellaswag {args.model}: acc_norm {result['acc_norm']:.4f} ({result['correct_norm']}/{result['total']}), "
          f"acc {result['acc']:.4f} ({result['correct']}/{result['total']})")
    return result


if __name__ == "__main__":
    main()
