"""Inspecting and checking Megatron indexed datasets: token ranges, and the info / verify / verify-cache command line.

    python dataset_tools.py info   'data/processed_data_*_text_document'    # documents, sequences, tokens, dtype
    python dataset_tools.py verify 'data/processed_data_*_text_document' --vocab-size 50257   # read every token
    python dataset_tools.py verify-cache data/processed_data_0_text_document/cache/GPTDataset_indices

Opening a dataset (indexed_dataset.IndexedDataset) already checks its index against itself and the .bin's size;
what is left for here is what needs every token (their range) or every cached byte (the index cache's checksums).
A dataset's token range is computed once and kept beside it in `<prefix>.stats.json`, keyed by the .bin's and the
.idx's size and mtime, so a training run can check it against the model's vocabulary at every start for free.
"""
import argparse
import glob
import hashlib
import json
import os
import sys

import numpy as np
from tqdm import tqdm

from atomic_io import atomic_write
from indexed_dataset import IndexedDataset, resolve_blend

TOKENS_PER_STEP = 1 << 26  # tokens read at a time by the range pass: bounds its memory


def token_range(dataset, cache_dir=None):
    """(smallest, largest) token id of a dataset (an IndexedDataset or a prefix), or (None, None) if it has no
    tokens. Computed in one chunked pass over the .bin and kept in `<prefix>.stats.json`; where the dataset's
    directory is read-only, in `cache_dir` (when given), else computed every time."""
    prefix = dataset.path_prefix if isinstance(dataset, IndexedDataset) else dataset
    try:
        key = {name: [os.stat(prefix + suffix).st_size, os.stat(prefix + suffix).st_mtime_ns]
               for name, suffix in (("bin", ".bin"), ("idx", ".idx"))}
    except OSError:  # missing files: opening the dataset names them
        key = None
    path = _stats_path(prefix, cache_dir)
    try:
        with open(path) as f:
            stats = json.load(f)
        if stats["key"] == key:
            return stats["min"], stats["max"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, unreadable or stale: compute it
    # only a cache miss opens the dataset (and checks its index): a warm start reads two stat()s and a small file
    ds = dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(prefix)
    low, high = _scan_range(ds)
    if path is not None and key is not None:
        try:
            with atomic_write(path, "w") as f:
                json.dump({"key": key, "min": low, "max": high}, f)
        except OSError:
            pass  # a cache we cannot write costs only the pass next time
    return low, high


def max_token_id(dataset, cache_dir=None):
    """The largest token id of a dataset (an IndexedDataset or a prefix); None if it has no tokens."""
    return token_range(dataset, cache_dir)[1]


def check_token_range(paths, vocab_size, cache_dir=None):
    """Raise ValueError naming the .bin if any dataset of `paths` (a prefix, a glob, a blend list, or a list of
    IndexedDatasets) holds a token id outside [0, vocab_size). Cheap after the first call (token_range)."""
    if isinstance(paths, (list, tuple)) and paths and all(isinstance(p, IndexedDataset) for p in paths):
        datasets = list(paths)
    else:
        datasets = resolve_blend(paths)[0]
    for dataset in datasets:
        low, high = token_range(dataset, cache_dir)
        name = (dataset.path_prefix if isinstance(dataset, IndexedDataset) else dataset) + ".bin"
        if high is not None and high >= vocab_size:
            raise ValueError(f"token id {high} in {name} is outside the model's vocabulary (vocab_size {vocab_size})")
        if low is not None and low < 0:
            raise ValueError(f"token id {low} in {name} is negative: outside the model's vocabulary "
                             f"(vocab_size {vocab_size})")


def _stats_path(path_prefix, cache_dir):
    directory = os.path.dirname(os.path.abspath(path_prefix))
    if os.access(directory, os.W_OK | os.X_OK):
        return path_prefix + ".stats.json"
    if cache_dir is None:
        return None
    os.makedirs(cache_dir, exist_ok=True)
    digest = hashlib.sha256(os.path.abspath(path_prefix).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{os.path.basename(path_prefix)}-{digest}.stats.json")


def _scan_range(ds):
    tokens, low, high = ds.tokens, None, None
    with tqdm(total=len(tokens), unit="tok", unit_scale=True, desc=os.path.basename(ds.path_prefix), file=sys.stderr,
              disable=len(tokens) < 10 * TOKENS_PER_STEP) as progress:
        for start in range(0, len(tokens), TOKENS_PER_STEP):
            part = tokens[start:start + TOKENS_PER_STEP]
            low = int(part.min()) if low is None else min(low, int(part.min()))
            high = int(part.max()) if high is None else max(high, int(part.max()))
            progress.update(len(part))
    return low, high


# ----------------------------------------------------------------------------------------------------------------------
# Command line


def info(paths):
    """One line per prefix (and a total): documents, sequences, tokens, dtype, file sizes."""
    prefixes = _cli_prefixes(paths)
    totals = np.zeros(3, dtype=np.int64)
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        lengths = ds.sequence_lengths
        counts = np.array([ds.num_documents, len(ds), ds.num_tokens])
        totals += counts
        spread = (f", sequence length min {lengths.min():,} mean {lengths.mean():,.1f} max {lengths.max():,}"
                  if len(lengths) else "")
        print(f"{prefix}: {counts[0]:,} documents, {counts[1]:,} sequences, {counts[2]:,} tokens ({ds.dtype}); "
              f".bin {os.path.getsize(prefix + '.bin'):,} bytes, .idx {os.path.getsize(prefix + '.idx'):,} bytes"
              + spread)
    if len(prefixes) > 1:
        print(f"total of {len(prefixes)} prefixes: {totals[0]:,} documents, {totals[1]:,} sequences, "
              f"{totals[2]:,} tokens")


def verify(paths, vocab_size=None):
    """Check every prefix end to end: opening it (the index against itself and the .bin's size), then every token
    (below `vocab_size` when given). Returns the list of problems (empty if all is well)."""
    problems = []
    for prefix in _cli_prefixes(paths):
        try:
            ds = IndexedDataset(prefix)
        except (ValueError, FileNotFoundError) as error:
            problems.append(str(error))
            continue
        low, high = _scan_range(ds)  # read afresh: verifying trusts no cache
        ok = vocab_size is None or high is None or (high < vocab_size and low >= 0)
        if not ok:
            problems.append(f"{prefix}.bin: token ids span [{low}, {high}], outside the vocabulary [0, {vocab_size})")
        print(f"{prefix}: {'ok' if ok else 'PROBLEMS'}: {ds.num_documents:,} documents, "
              f"{len(ds):,} sequences, {ds.num_tokens:,} tokens, ids in [{low}, {high}]")
    return problems


def verify_cache(cache_dir):
    """Check every entry of an index cache directory byte for byte against the sha256 its description recorded
    (loading checks only sizes, shapes and keys). Returns the list of problems; a damaged entry should be deleted,
    and is then rebuilt by the next run."""
    descriptions = sorted(glob.glob(os.path.join(cache_dir, "*.json")))
    if not descriptions:
        raise FileNotFoundError(f"{cache_dir}: no index cache entries (*.json) here")
    problems = []
    for path in descriptions:
        try:
            with open(path) as f:
                arrays = json.load(f)["arrays"]
            for name, expected in arrays.items():
                array_path = path[:-len(".json")] + f"-{name}.npy"
                values = np.load(array_path, mmap_mode="r")
                if hashlib.sha256(np.ascontiguousarray(values)).hexdigest() != expected["sha256"]:
                    problems.append(f"{array_path}: its contents differ from when it was written")
        except (OSError, ValueError, KeyError, TypeError) as error:
            problems.append(f"{path}: unreadable entry ({type(error).__name__}: {error})")
    print(f"{cache_dir}: {len(descriptions)} entries checked")
    return problems


def _cli_prefixes(paths):
    """Prefixes from the command line: one prefix or quoted glob, or the files an unquoted glob expanded to."""
    if len(paths) == 1:
        path = paths[0]
        return resolve_blend(path[:-4] if path.endswith((".bin", ".idx")) else path)[0]
    return sorted({p[:-4] if p.endswith((".bin", ".idx")) else p for p in paths})


def main(argv=None):
    parser = argparse.ArgumentParser(description="Inspect Megatron indexed datasets (<prefix>.bin + <prefix>.idx).")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="documents, sequences, tokens, dtype and sizes").add_argument(
        "paths", metavar="PREFIX_OR_GLOB", nargs="+")
    verify_parser = commands.add_parser("verify", help="check the index and read every token")
    verify_parser.add_argument("paths", metavar="PREFIX_OR_GLOB", nargs="+")
    verify_parser.add_argument("--vocab-size", type=int, default=None, help="fail on token ids >= this")
    commands.add_parser("verify-cache", help="check an index cache directory's checksums").add_argument("cache_dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            info(args.paths)
            return 0
        problems = verify(args.paths, args.vocab_size) if args.command == "verify" else verify_cache(args.cache_dir)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
