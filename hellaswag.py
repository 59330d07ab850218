"""HellaSwag in llm.c's completion style: acc_norm picks the ending whose tokens have the lowest
mean cross-entropy, acc the lowest sum. --model is a hub name, an HF directory or a training run."""
import argparse
import json
import os
import pathlib
import sys
import urllib.request
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from atomic_io import atomic_write
from checkpoint import load_model
from tokenizer import VOCAB_SIZE, gpt2_encoding

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hellaswag")  # or $HELLASWAG_CACHE
Rendered = namedtuple("Rendered", "context endings label")  # one example as token lists
STOP_CHECK_EVERY = 4  # batches between two stop checks: each is a collective and a host sync


def read_jsonl(path, data):
    """The examples in `data`, the bytes of jsonl file `path`; errors name the file and the line."""
    examples = []
    for line_number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_number}"
        try:
            ex = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:  # a ValueError too: named apart, as it needs another fix
            raise ValueError(f"{where}: not UTF-8 ({e})") from None
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        endings = isinstance(ex, dict) and ex.get("endings")
        four_strings = isinstance(endings, list) and [type(e) for e in endings] == [str] * 4
        if not (four_strings and isinstance(ex.get("ctx"), str) and ex.get("label") in range(4)):
            raise ValueError(f"{where}: expected an object with 'ctx' (a string), 'endings' "
                             f"(4 strings) and 'label' (0-3)")
        examples.append(ex)
    if not examples:
        raise ValueError(f"{path}: no HellaSwag examples in the file")
    return examples


def load_examples(path=None):
    """The examples of a local HellaSwag jsonl file, or of the validation set, downloaded once."""
    cached = os.path.join(os.environ.get("HELLASWAG_CACHE") or CACHE_DIR, "hellaswag_val.jsonl")
    if path is not None or os.path.isfile(cached):
        return read_jsonl(path or cached, pathlib.Path(path or cached).read_bytes())
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as response:
            data = response.read()
    except Exception as e:  # no network, a timeout, a connection reset or cut short
        raise FileNotFoundError(f"{cached} is not cached and downloading {HELLASWAG_URL} failed "
                                f"({e}); offline, pass a local hellaswag_val.jsonl as --data PATH "
                                f"(train_gpt2: hellaswag=PATH) or copy it to {cached}") from None
    examples = read_jsonl(HELLASWAG_URL, data)  # a corrupt download fails here, before it is cached
    with atomic_write(cached) as f:
        f.write(data)
    return examples


def render_all(examples):
    """Every example as a Rendered: a training run tokenizes the set once, then evaluates it."""
    enc = gpt2_encoding()
    rendered = []
    for ex in examples:  # each ending gets the space it has after the context
        endings = [enc.encode_ordinary(" " + ending) for ending in ex["endings"]]
        rendered.append(Rendered(enc.encode_ordinary(ex["ctx"]), endings, ex["label"]))
    return rendered


def row_length(example, block_size):
    """The tokens in the longest of an example's 4 rows (context + ending, cut to block_size)."""
    return min(len(example.context) + max(map(len, example.endings)), block_size)


@torch.no_grad()
def ending_losses(model, rendered, *, device, autocast_dtype=None):
    """Sum and mean float32 cross-entropy (N, 4) of the endings: one forward, 4 rows per example."""
    block_size = model.config.block_size
    width = max(row_length(example, block_size) for example in rendered)
    tokens, row_of, position = [], [], []
    for example in rendered:
        for ending in example.endings:
            row = (example.context + ending)[-block_size:]
            n = min(len(ending), len(row) - 1)
            # The logit at t predicts token t + 1: the last n tokens from the n before them.
            row_of += [len(tokens) // width] * n
            position += range(len(row) - 1 - n, len(row) - 1)
            tokens += row + [0] * (width - len(row))  # on the right: no real token attends to it
    # non_blocking: the host does not wait for the GPU's queued work; it prepares the next batch.
    tokens, row_of, position = [torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
                                for values in (tokens, row_of, position)]
    tokens = tokens.view(-1, width)
    enabled = autocast_dtype is not None
    with torch.autocast(tokens.device.type, dtype=autocast_dtype, enabled=enabled):
        logits = model(tokens, logits_at=(row_of, position))[0]  # only the endings' logits
    targets = tokens[row_of, position + 1]
    # In float32, 4096 rows at a time: a batch's endings can have tens of thousands of logit rows.
    losses = [F.cross_entropy(logits[i:i + 4096].float(), targets[i:i + 4096], reduction="none")
              for i in range(0, len(targets), 4096)]
    sums = torch.zeros(len(tokens), device=tokens.device).index_add_(0, row_of, torch.cat(losses))
    means = sums / torch.bincount(row_of, minlength=len(tokens)).clamp(min=1)
    return sums.view(-1, 4), means.view(-1, 4)


def plan_batches(rendered, block_size, batch_tokens):
    """The examples of each forward: as many as fit batch_tokens (4 rows per example, padded to the
    longest), at least one. Shortest first: similar lengths pad less."""
    batches = [[]]
    for example in sorted(rendered, key=lambda ex: row_length(ex, block_size)):
        # Sorted, so this example's rows are the batch's longest: all its rows are padded to them.
        full = 4 * (len(batches[-1]) + 1) * row_length(example, block_size) > batch_tokens
        if full and batches[-1]:
            batches.append([])
        batches[-1].append(example)
    return [batch for batch in batches if batch]


@torch.no_grad()
def evaluate(model, examples, *, device, rank=0, world_size=1, autocast_dtype=None, limit=None,
             batch_tokens=8192, progress=False, stopped=None):
    """Accuracy on the first `limit` examples (dicts or Rendered), batch_tokens padded tokens per
    forward. Rank r scores examples i % world_size == r; every rank returns the all_reduced dict,
    or None once `stopped()` (a collective) says so."""
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"HellaSwag needs GPT-2's vocabulary, not {model.config.vocab_size}")
    rendered = examples[:limit]
    if not isinstance(rendered[0], Rendered):
        rendered = render_all(rendered)
    # Every rank plans every rank's batches, with no collective, so that all run as many forwards:
    # a sharded (FSDP) forward is collective. A rank out of examples scores a dummy with label -1.
    block_size = model.config.block_size
    plans = [plan_batches(rendered[r::world_size], block_size, batch_tokens)
             for r in range(world_size)]
    num_batches = max(len(plan) for plan in plans)
    mine = plans[rank] + [[]] * (num_batches - len(plans[rank]))
    # Right by mean, right by sum, scored: counted on the device, so no batch waits for the host.
    counts = torch.tensor([0, 0, sum(map(len, mine))], device=device)
    for b in tqdm(range(num_batches), desc="hellaswag", disable=not progress or rank != 0):
        if stopped is not None and b % STOP_CHECK_EVERY == 0 and stopped():
            return None
        batch = mine[b] or rendered[:1]  # a rank out of examples runs a forward all the same
        sums, means = ending_losses(model, batch, device=device, autocast_dtype=autocast_dtype)
        labels = torch.tensor([ex.label for ex in mine[b]] or [-1]).to(device, non_blocking=True)
        counts[:2] += (torch.stack([means, sums]).argmin(dim=2) == labels).sum(dim=1)
    if world_size > 1:
        dist.all_reduce(counts)
    by_mean, by_sum, total = counts.tolist()
    return dict(acc_norm=by_mean / total, acc=by_sum / total, correct_norm=by_mean, correct=by_sum,
                total=total)


def main(argv=None):
    dtypes = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="gpt2, an HF directory, a run or checkpoint")
    parser.add_argument("--data", help="a local jsonl (default: the validation set, downloaded)")
    parser.add_argument("--limit", type=int, help="score only the first N examples")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per forward")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(dtypes), default="float32", help="autocast dtype")
    args = parser.parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.batch_tokens < 1:
        parser.error("--limit and --batch-tokens must be at least 1")
    try:
        examples = load_examples(args.data)
        model = load_model(args.model).to(args.device)
        result = evaluate(model, examples, device=args.device, limit=args.limit, progress=True,
                          batch_tokens=args.batch_tokens, autocast_dtype=dtypes[args.dtype])
    except (ValueError, OSError) as e:
        sys.exit(f"hellaswag.py: error: {e}")
    print(f"hellaswag {args.model}: acc_norm {result['acc_norm']:.4f} ({result['correct_norm']}/"
          f"{result['total']}), acc {result['acc']:.4f} ({result['correct']}/{result['total']})")
    return result


if __name__ == "__main__":
    main()
