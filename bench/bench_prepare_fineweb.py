"""prepare_fineweb.py throughput against the tokenizer-only limit and against the Megatron-LM / NeMo AutoModel pipeline.

    python bench/bench_prepare_fineweb.py                    # 32 MB of text, one process per CPU
    python bench/bench_prepare_fineweb.py --mb 512 --workers 32

The text is a parquet file of FineWeb-sized documents (log-normal lengths, median 3 kB) cut from tinyshakespeare at
random offsets. Each contender runs in its own subprocess, so its peak RSS is its own, with the same number of workers:
  ours   prepare_fineweb.prepare end to end: read the parquet, tokenize in --workers processes, write .bin/.idx;
  limit  tiktoken encode_ordinary_batch(num_threads=--workers) of the same documents already in memory, nothing else;
  peer   what tools/preprocess_data.py (Megatron-LM) and preprocess_megatron_dataset.py (NeMo AutoModel) do:
         transformers GPT2TokenizerFast from the same BPE files, one document per call in a multiprocessing.Pool of
         --workers (imap, chunksize 32), documents already in memory and nothing written.
ours and limit take the best of --repeat runs, interleaved; the peer, several times slower, runs once. Wall time is the
figure of merit (goals: ours at least 0.85x the limit and at least 2x the peer); CPU time (the process and its
workers) is printed too, as it hardly moves when other programs share the machine.
"""
import argparse
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_documents(path, megabytes, seed=0):
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        text = f.read()
    rng = np.random.default_rng(seed)
    documents, total = [], 0
    while total < megabytes * 1e6:
        length = int(np.clip(rng.lognormal(np.log(3000), 0.8), 100, 100_000))
        start = int(rng.integers(0, len(text) - length))
        documents.append(text[start:start + length])
        total += length
    pq.write_table(pa.table({"text": documents}), path, row_group_size=1000)
    return len(documents), total


def load_documents(path):
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


# Each contender does its setup, then returns the measured work: a function returning the number of tokens, counting
# one EOT per document as ours writes.


def ours(path, workers, workdir):
    import prepare_fineweb

    return lambda: prepare_fineweb.prepare([path], os.path.join(workdir, "out"), workers=workers)["tokens"]


def limit(path, workers, workdir):
    from tokenizer import gpt2_encoding

    documents, encoding = load_documents(path), gpt2_encoding()

    def work():
        token_lists = encoding.encode_ordinary_batch(documents, num_threads=workers)
        return sum(map(len, token_lists)) + len(token_lists)
    return work


def init_hf_tokenizer(tokenizer_dir):
    from transformers import GPT2TokenizerFast

    global hf_tokenizer
    hf_tokenizer = GPT2TokenizerFast.from_pretrained(tokenizer_dir, model_max_length=10**9)


def hf_encode(text):
    return hf_tokenizer(text).input_ids


def peer(path, workers, workdir):
    documents = load_documents(path)
    # the shipped BPE files under the names of a Hugging Face GPT-2 tokenizer directory
    shutil.copy(os.path.join(ROOT, "data", "gpt2_bpe", "encoder.json"), os.path.join(workdir, "vocab.json"))
    shutil.copy(os.path.join(ROOT, "data", "gpt2_bpe", "vocab.bpe"), os.path.join(workdir, "merges.txt"))

    def work():
        with multiprocessing.Pool(workers, initializer=init_hf_tokenizer, initargs=(workdir,)) as pool:
            token_lists = list(pool.imap(hf_encode, documents, chunksize=32))
        return sum(map(len, token_lists)) + len(token_lists)
    return work


CONTENDERS = {"ours": ours, "limit": limit, "peer": peer}


def cpu_seconds():
    """CPU time of this process and of its ended child processes (pool workers count once their pool is closed)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_contender(name, path, workers):
    with tempfile.TemporaryDirectory() as workdir:
        work = CONTENDERS[name](path, workers, workdir)
        wall, cpu = time.perf_counter(), cpu_seconds()
        tokens = work()
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    print(json.dumps({"seconds": wall, "cpu_seconds": cpu, "tokens": tokens,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def measure(name, path, workers):
    """Run one contender in a fresh interpreter; its wall and CPU seconds, tokens and peak RSS (MB)."""
    command = [sys.executable, os.path.abspath(__file__), "--contender", name, "--data", path,
               "--workers", str(workers)]
    environment = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=32, help="megabytes of text")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeat", type=int, default=3, help="runs of ours and of the limit; the best counts")
    parser.add_argument("--contender", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        return run_contender(args.contender, args.data, args.workers)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "documents.parquet")
        n_documents, n_bytes = write_documents(path, args.mb)
        print(f"{n_documents:,} documents, {n_bytes / 1e6:.1f} MB of text, parquet {os.path.getsize(path) / 1e6:.1f} "
              f"MB, {args.workers} workers")
        runs = {"ours": [], "limit": []}
        for _ in range(args.repeat):
            for name in runs:
                runs[name].append(measure(name, path, args.workers))
        best = {name: min(results, key=lambda r: r["seconds"]) for name, results in runs.items()}
        best["peer"] = measure("peer", path, args.workers)

    tokens = best["ours"]["tokens"]
    for name, r in best.items():
        note = "" if r["tokens"] == tokens else f"  (token count {r['tokens']:,} differs from ours)"
        print(f"{name:>5}: {r['seconds']:6.2f} s  {tokens / r['seconds'] / 1e6:5.2f}M tokens/s  "
              f"{n_bytes / r['seconds'] / 1e6:5.1f} MB/s  CPU {r['cpu_seconds']:6.2f} s  "
              f"peak RSS {r['rss_mb']:4.0f} MB (largest worker {r['worker_rss_mb']:.0f} MB){note}")
    for name, goal in (("limit", 0.85), ("peer", 2)):
        print(f"ours / {name}: {best[name]['seconds'] / best['ours']['seconds']:.2f}x wall (goal >= {goal}), "
              f"{best[name]['cpu_seconds'] / best['ours']['cpu_seconds']:.2f}x CPU")


if __name__ == "__main__":
    main()
