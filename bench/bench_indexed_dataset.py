"""Start-up of the train data: train_gpt2.build_data (the real path) against megatron-core 0.16.1's builder call
(its prebuilt C++ helpers), on FineWeb-Edu-shaped data that the bench writes itself: real .idx files with lognormal
document lengths (mean about 1,034 GPT-2 tokens) and sparse .bin files of the right size (zeros that take no disk).

Shapes (the issue's), each scaled by --scale (prefixes, documents and samples alike):
  10bt   14 prefixes,  9.6M documents, the 124M recipe's 19,073 steps x 512 samples of 1,024 tokens
  100bt  140 prefixes, 97M documents, the 774M recipe's 286,102 steps x 512 samples (146M)
Both read the glob of prefixes as the recipes do (split "100,0,0", seed 1234); past one epoch it is blended by token
count (train_gpt2.build_train_data decides; megatron-core gets the same blend list, decided before its clock starts).

Each side runs in a fresh process per measurement; the cold runs build and write the index cache (from an empty one),
the warm runs find it (ours: build_data and the resume digest, data_state; megatron-core: the builder call). Time is
wall clock; memory is the growth of peak RSS (VmHWM) over the RSS after the imports. --cold_runs and --warm_runs per
side, alternating; the fastest run counts. Every index array of both sides is hashed after the clock
stops: the samples agree when every digest does. Ratios are ours / megatron-core's (below 1: ours is better).

    python bench/bench_indexed_dataset.py --shape 10bt --cold_runs 3   # about 5 minutes on 2 cores
    python bench/bench_indexed_dataset.py --shape 100bt --scale 0.34   # a third of 100BT
    python bench/bench_indexed_dataset.py --shape 10bt --scale 0.05    # a quick look
    python bench/bench_indexed_dataset.py --shape 100bt --blend_only 5000000   # the blend index alone, 140 datasets
"""
import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from indexed_dataset import IndexedDatasetBuilder  # noqa: E402

SHAPES = {"10bt": dict(prefixes=14, documents=9_600_000, steps=19_073),
          "100bt": dict(prefixes=140, documents=97_000_000, steps=286_102)}
SEQ_LENGTH, GLOBAL_BATCH, SPLIT, SEED = 1024, 512, "100,0,0", 1234


def write_sparse_prefixes(directory, prefixes, documents, seed=0):
    """`prefixes` prefixes of one-sequence documents with FineWeb-Edu-like lengths (lognormal, mean about 1,034
    tokens); the .bin files are sparse zeros of the right size: the index is real, the tokens cost no disk."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    for p in range(prefixes):
        prefix = os.path.join(directory, f"processed_data_{p}_text_document")
        count = documents // prefixes + (p < documents % prefixes)
        lengths = np.clip(rng.lognormal(6.536, 0.9, count), 16, 100_000).astype(np.int64)
        builder = IndexedDatasetBuilder(prefix + ".bin")
        builder.sequence_lengths.frombytes(lengths.tobytes())
        builder.document_indices.frombytes(np.arange(1, count + 1, dtype=np.int64).tobytes())
        builder.finalize(prefix + ".idx")
        os.truncate(prefix + ".bin", int(lengths.sum()) * 2)
    return os.path.join(directory, "processed_data_*_text_document")


def memory_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def digests(train):
    """sha256 of every index array of a blended or GPT dataset (dtype and bytes), ours or megatron-core's."""
    arrays = {}
    for d, part in enumerate(getattr(train, "datasets", [train])):
        for name in ("document_index", "sample_index", "shuffle_index"):
            arrays[f"{d}.{name}"] = getattr(part, name)
    for name in ("dataset_index", "dataset_sample_index"):
        if hasattr(train, name):
            arrays[name] = getattr(train, name)
    out = {}
    for name, array in arrays.items():
        digest = hashlib.sha256(str(array.dtype).encode() + str(array.shape).encode())
        flat = np.ascontiguousarray(array).reshape(-1)
        for start in range(0, len(flat), 1 << 24):
            digest.update(flat[start:start + (1 << 24)].tobytes())
        out[name] = digest.hexdigest()[:16]
    return out


def worker(side, data, cache, steps):
    """Build (cold) or load (warm) the train data in this process; print one JSON line."""
    num_samples = steps * GLOBAL_BATCH
    if side == "ours":
        import train_gpt2

        def start():
            cfg = train_gpt2.load_config([f"--data_paths={data}", f"--split={SPLIT}", f"--seed={SEED}",
                                          f"--seq_length={SEQ_LENGTH}", f"--global_batch_size={GLOBAL_BATCH}",
                                          f"--local_batch_size={GLOBAL_BATCH}", f"--max_steps={steps}",
                                          f"--index_mapping_dir={cache}", f"--out_dir={cache}.out", "--val_tokens=0"])
            train, _ = train_gpt2.build_data(cfg, lambda text, **metrics: print(text, file=sys.stderr))
            train_gpt2.data_state(train)  # what a resume compares: part of every start
            return train
    else:
        import logging
        import warnings

        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        import torch.distributed as dist
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.utils import get_blend_from_list

        from indexed_dataset import one_epoch_samples, resolve_blend, token_weighted_blend

        class Tokenizer:
            vocab_size, eod, unique_identifiers = 50257, 50256, {"class": "GPT2"}

        # megatron-core 0.16.1 needs a process group to cache a BlendedDataset
        dist.init_process_group("gloo", init_method=f"file://{cache}.pg-{os.getpid()}", rank=0, world_size=1)
        # the blend list that build_data would use, decided before the clock starts: only the builder call is timed
        prefixes = resolve_blend(data)[0]
        past_one_epoch = num_samples > one_epoch_samples(data, seq_length=SEQ_LENGTH, split=SPLIT)
        blend = get_blend_from_list(token_weighted_blend(data) if past_one_epoch else prefixes)
        config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ_LENGTH, blend=blend, split=SPLIT,
                                  path_to_cache=cache, tokenizer=Tokenizer(), reset_position_ids=False,
                                  reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)

        def start():
            return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()[0]

    rss_before = memory_kib("VmRSS")
    t0 = time.perf_counter()
    train = start()
    seconds = time.perf_counter() - t0
    memory_mib = (memory_kib("VmHWM") - rss_before) / 1024
    print(json.dumps(dict(seconds=seconds, memory_mib=memory_mib, samples=len(train), digests=digests(train))))


def blend_only(num_datasets, size, runs=3):
    """The blend index alone: indexed_dataset.blending_indices against megatron-core's C++ build_blending_indices,
    in this process, alternating, best of `runs`; weights as token counts of FineWeb-Edu files are (1 +- 1%)."""
    import warnings

    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers

    from indexed_dataset import blending_indices, usable_cores

    weights = 1 + 0.01 * np.random.default_rng(0).random(num_datasets)
    weights /= weights.sum()
    best = {"megatron": float("inf"), "ours": float("inf")}
    for run in range(runs):
        for side in ("megatron", "ours") if run % 2 == 0 else ("ours", "megatron"):
            t0 = time.perf_counter()
            if side == "ours":
                ours = blending_indices(weights.tolist(), size)
            else:
                theirs = np.zeros(size, np.int16), np.zeros(size, np.int64)
                helpers.build_blending_indices(*theirs, weights, num_datasets, size, False)
            best[side] = min(best[side], time.perf_counter() - t0)
    agree = all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    print(f"blend index of {size:,} samples over {num_datasets} datasets, best of {runs}: megatron-core "
          f"{best['megatron']:.2f} s, ours {best['ours']:.2f} s ({best['ours'] / best['megatron']:.2f}x, "
          f"{usable_cores()} cores); the same arrays: {'yes' if agree else 'NO'}")
    if not agree:
        sys.exit(1)


def run_worker(side, data, cache, steps):
    command = [sys.executable, os.path.abspath(__file__), "--worker", side, data, cache, str(steps)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if result.returncode:
        sys.exit(f"{side} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="10bt")
    parser.add_argument("--scale", type=float, default=1.0, help="scale prefixes, documents and samples (e.g. 0.34)")
    parser.add_argument("--cold_runs", type=int, default=1, help="cold runs per side (each from an empty cache)")
    parser.add_argument("--warm_runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the data and caches (default: a temp dir)")
    parser.add_argument("--blend_only", type=int, metavar="SAMPLES", help="time only the blend index of SAMPLES "
                        "samples over the shape's prefixes (ours against megatron-core's C++), in this process")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, data, cache, steps = args.worker
        worker(side, data, cache, int(steps))
        return
    if args.blend_only:
        blend_only(max(2, round(SHAPES[args.shape]["prefixes"] * args.scale)), args.blend_only)
        return

    shape = SHAPES[args.shape]
    prefixes = max(2, round(shape["prefixes"] * args.scale))  # a glob of one prefix is no blend
    documents, steps = round(shape["documents"] * args.scale), max(1, round(shape["steps"] * args.scale))
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        t0 = time.perf_counter()
        data = write_sparse_prefixes(os.path.join(directory, "data"), prefixes, documents)
        print(f"{args.shape} x {args.scale:g}: {prefixes} prefixes, {documents:,} documents (written in "
              f"{time.perf_counter() - t0:.0f}s), {steps:,} steps x {GLOBAL_BATCH} = {steps * GLOBAL_BATCH:,} samples "
              f"of {SEQ_LENGTH} tokens, split {SPLIT!r}", flush=True)
        results = {}
        sides = ("megatron", "ours")
        for phase, runs in (("cold", args.cold_runs), ("warm", args.warm_runs)):
            for run in range(runs):  # alternating, so both sides see the same machine load
                for side in sides if run % 2 == 0 else sides[::-1]:
                    cache = os.path.join(directory, f"cache_{side}")
                    if phase == "cold":
                        shutil.rmtree(cache, ignore_errors=True)
                    result = run_worker(side, data, cache, steps)
                    print(f"  {side:8} {phase} {run}: {result['seconds']:.2f}s, peak RSS growth "
                          f"{result['memory_mib']:,.0f} MiB, {result['samples']:,} samples", flush=True)
                    best = results.get((side, phase))
                    if best is None or result["seconds"] < best["seconds"]:
                        results[side, phase] = result
        cache_sizes = {side: sum(os.path.getsize(p) for p in glob.glob(os.path.join(directory, f"cache_{side}", "*")))
                       for side in sides}

    ours, theirs = results["ours", "cold"]["digests"], results["megatron", "cold"]["digests"]
    agree = ours == theirs and all(results[side, "warm"]["digests"] == results[side, "cold"]["digests"]
                                   for side in sides)
    print(f"\n{'':28}{'megatron-core':>14}{'ours':>10}{'ours/theirs':>13}")
    for label, phase, key in (("cold start (s)", "cold", "seconds"), ("cold peak RSS growth (MiB)", "cold", "memory_mib"),
                              ("warm start (s)", "warm", "seconds"), ("warm peak RSS growth (MiB)", "warm", "memory_mib")):
        a, b = results["megatron", phase][key], results["ours", phase][key]
        print(f"{label:28}{a:>14,.2f}{b:>10,.2f}{b / max(a, 1e-9):>12.2f}x")
    print(f"{'index cache on disk (MB)':28}{cache_sizes['megatron'] / 1e6:>14,.0f}{cache_sizes['ours'] / 1e6:>10,.0f}")
    print(f"samples agree (every index array, {len(ours)} of them): {'yes' if agree else 'NO'}")
    if not agree:
        print("differing arrays:", sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)))
        sys.exit(1)


if __name__ == "__main__":
    main()
