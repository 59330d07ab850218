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
import urllib.request

import torch
import torch.nn.functional as F

from checkpoint import load_model
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


def download(url, path):
    """Fetch `url` to `path` through a temporary file, so an interrupted download never looks like a cached one."""
    from tqdm import tqdm

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp_path = f"{path}.{os.getpid()}.tmp"  # per process: ranks downloading at once never share a file
    try:
        with open(tmp_path, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            expected = int(response.headers["Content-Length"]) if response.headers.get("Content-Length") else None
            with tqdm(total=expected, unit="B", unit_scale=True, desc=f"downloading {os.path.basename(path)}") as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
        received = os.path.getsize(tmp_path)
        if expected is not None and received != expected:
            raise OSError(f"{url}: download incomplete ({received} of {expected} bytes)")
        read_jsonl(tmp_path)  # a corrupt download must fail here, not poison the cache
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def load_examples(path=None):
    """The examples of a local HellaSwag jsonl file, or (path None) of the validation set, downloaded once, cached."""
    if path is None:
        path = os.path.join(cache_dir(), "hellaswag_val.jsonl")
        if not os.path.isfile(path):
            download(HELLASWAG_URL, path)
    return read_jsonl(path)


def render_example(example, enc):
    """(context tokens, [tokens of each of the 4 endings]); an ending gets the space it has after the context."""
    context = enc.encode_ordinary(example["ctx"])
    endings = [enc.encode_ordinary(" " + ending) for ending in example["endings"]]
    return context, endings


def ending_losses(model, rendered, *, device, autocast_dtype=None):
    """Sum and mean cross-entropy of each ending of each rendered example: two float32 tensors (N, 4), one forward.

    Rows are right-padded: attention is causal, so padding never changes the logits of the real tokens. A row longer
    than the model's context keeps its last block_size tokens, i.e. the context is cut from the left; an ending token
    is scored only when the token before it is in the window.
    """
    block_size = model.config.block_size
    rows, masks = [], []
    for context, endings in rendered:
        for ending in endings:
            rows.append((context + ending)[-block_size:])
            masks.append(([0] * len(context) + [1] * len(ending))[-block_size:])
    width = max(len(row) for row in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        tokens[i, :len(row)] = torch.tensor(row)
        scored[i, :len(mask)] = torch.tensor(mask, dtype=torch.bool)
    tokens, scored = tokens.to(device), scored.to(device)

    device_type = torch.device(device).type
    with torch.autocast(device_type=device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits, _ = model(tokens)
    # position t predicts token t+1; only ending positions matter, so the cross-entropy sees just those rows of logits
    target_mask = scored[:, 1:]
    token_losses = F.cross_entropy(logits[:, :-1][target_mask].float(), tokens[:, 1:][target_mask], reduction="none")
    row_of_token = torch.arange(len(rows), device=tokens.device)[:, None].expand_as(target_mask)[target_mask]
    sums = torch.zeros(len(rows), device=tokens.device).index_add_(0, row_of_token, token_losses)
    counts = target_mask.sum(dim=1).clamp(min=1)
    return sums.view(-1, 4).cpu(), (sums / counts).view(-1, 4).cpu()


@torch.no_grad()
def evaluate(model, examples, *, device, rank=0, world_size=1, autocast_dtype=None, limit=None, batch_size=4,
             progress=False):
    """HellaSwag accuracy of `model` on `examples` (the first `limit` of them when given).

    Rank r scores examples i % world_size == r, `batch_size` examples (4 * batch_size rows) per forward; with
    world_size > 1 the counts are summed over ranks with all_reduce, so every rank returns the totals:
    dict(acc_norm, acc, correct_norm, correct, total).
    """
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"HellaSwag needs the GPT-2 vocabulary ({VOCAB_SIZE} tokens); this model has "
                         f"{model.config.vocab_size}")
    examples = examples[:limit] if limit is not None else examples
    if not examples:
        raise ValueError("HellaSwag: no examples to evaluate")
    enc = gpt2_encoding()
    mine = [(render_example(ex, enc), ex["label"]) for ex in examples[rank::world_size]]
    # similar lengths in one batch waste less compute on padding; the order does not change the counts
    mine.sort(key=lambda item: len(item[0][0]) + max(len(e) for e in item[0][1]))
    # every rank runs the same number of forwards: a sharded (FSDP) model gathers its weights collectively in each one
    num_batches = math.ceil(math.ceil(len(examples) / world_size) / batch_size)

    was_training = model.training
    model.eval()
    correct_norm = correct = 0
    batches = range(num_batches)
    if progress and rank == 0:
        from tqdm import tqdm
        batches = tqdm(batches, desc="hellaswag", unit="batch")
    for b in batches:
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        if not chunk:
            model(torch.zeros(1, 1, dtype=torch.long, device=device))
            continue
        sums, means = ending_losses(model, [rendered for rendered, _ in chunk], device=device,
                                    autocast_dtype=autocast_dtype)
        labels = torch.tensor([label for _, label in chunk])
        correct_norm += (means.argmin(dim=1) == labels).sum().item()
        correct += (sums.argmin(dim=1) == labels).sum().item()
    model.train(was_training)

    counts = torch.tensor([correct_norm, correct, len(mine)], dtype=torch.long, device=device)
    if world_size > 1:
        import torch.distributed as dist
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
