"""FineWeb-Edu to Megatron-Core indexed datasets in one command: download, GPT-2 tokenize, write .bin/.idx.

    python prepare_fineweb.py --workers 32                      # HuggingFaceFW/fineweb-edu, sample/10BT
    python prepare_fineweb.py --dataset fineweb --sample 100BT  # HuggingFaceFW/fineweb, sample/100BT
    python prepare_fineweb.py --input 'corpus/*.jsonl.gz' --output-dir data/corpus

The first --val-tokens go to val_text_document (llm.c's val shard), the rest of input i to
processed_data_{i}_text_document; a rerun keeps what summary.json's fingerprints still match. docs/data.md says more."""
import argparse
import collections
import contextlib
import functools
import glob
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import signal
import sys
import time
import zlib

import huggingface_hub
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from atomic_io import LockHeld, WriteError, atomic_path, atomic_write, lock_file
from indexed_dataset import IndexedDataset, IndexedDatasetBuilder, usable_cores
from tokenizer import EOT_ID, SHA256, gpt2_encoding

DATASETS = {"fineweb-edu": "HuggingFaceFW/fineweb-edu", "fineweb": "HuggingFaceFW/fineweb"}
SAMPLE_TOKENS = {"10BT": 10e9, "100BT": 100e9, "350BT": 350e9}  # named by their size in GPT-2 tokens
OUTPUT_BYTES_PER_TOKEN = 2 + 20 / 670  # a uint16 token, and 20 .idx bytes a document of FineWeb's ~670 tokens
HUB_VAL_TOKENS = 100_000_000  # llm.c's and build-nanogpt's val shard: the first 100M tokens
INPUT_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".txt")
CHUNK_BYTES = 1 << 20  # text per task: pickling it is noise next to ~0.2 s of tokenizing; 2 in flight, little RAM
# a text input's task ends after its block's last line (JSONL) or last blank line (text), so documents stay whole
CUT = {"jsonl": re.compile(rb"(?s:.*\n)?"), "txt": re.compile(rb"(?s:.*\n[ \t\r\f\v]*\n)?")}
TEXT_DOCUMENT = re.compile(rb"(?:^[^\S\n]*\S[^\n]*\n?)+", re.MULTILINE)  # a run of lines that are not blank
OUTPUT_FILE = re.compile(r"((?:processed_data_\d+|val)_text_document)\.(?:bin|idx)")  # group 1: the prefix
OUR_FILE = re.compile(rf"{OUTPUT_FILE.pattern}|summary\.json")
TEMPORARY_FILE = re.compile(rf"\.({OUR_FILE.pattern})\.\d+\.tmp")  # atomic_io's name for what it is writing
EOT_ARRAY = np.array([EOT_ID], dtype=np.uint32)
FORMAT = 2  # bump when a change here changes the bytes written, so that outputs of the old code are redone


def output_prefix(output_dir, index):
    return os.path.join(output_dir, f"processed_data_{index}_text_document")


def download(dataset, sample, data_dir):
    """The parquet files of `sample/{sample}` of the dataset, fetched into the hub cache `data_dir`; sorted paths."""
    repo_id, pattern = DATASETS[dataset], f"sample/{sample}/*.parquet"
    with reraised(data_dir, f"no complete copy of {repo_id} {pattern} in this hub cache, and the hub cannot be reached",
                  FileNotFoundError):  # huggingface_hub's LocalEntryNotFoundError: offline and not (fully) cached
        snapshot = huggingface_hub.snapshot_download(repo_id, repo_type="dataset", allow_patterns=pattern,
                                                     cache_dir=data_dir)
    files = sorted(glob.glob(os.path.join(snapshot, pattern)))
    if not files:
        raise FileNotFoundError(f"{snapshot}: no files match {pattern}")
    return files


def check_disk_space(dataset, sample, data_dir, output_dir):
    """Fail before the download if the parquet files not yet cached plus the outputs not yet written do not fit."""
    repo_id = DATASETS[dataset]
    try:
        entries = list(huggingface_hub.HfApi().list_repo_tree(repo_id, f"sample/{sample}", repo_type="dataset"))
    except Exception as e:  # offline, or no such sample: the download will say so, or find everything cached
        print(f"could not list {repo_id} sample/{sample} on the hub ({e}); checking the space for the outputs only")
        entries = None
    fetch = 0  # bytes of parquet not in the hub cache yet
    for entry in entries or ():
        if not entry.path.endswith(".parquet"):
            continue
        cached = huggingface_hub.try_to_load_from_cache(repo_id, entry.path, cache_dir=data_dir, repo_type="dataset")
        if not isinstance(cached, str):  # a path when cached, else None or a "not on the hub" marker
            fetch += entry.size
    for directory in (data_dir, output_dir):  # made now (the run would make them) to learn their filesystems
        os.makedirs(directory, exist_ok=True)
    written = sum(entry.stat().st_size for entry in os.scandir(output_dir) if OUTPUT_FILE.fullmatch(entry.name))
    needs = {data_dir: fetch, output_dir: max(SAMPLE_TOKENS[sample] * OUTPUT_BYTES_PER_TOKEN - written, 0)}
    download = "" if entries is None else f"{fetch / 1e9:,.1f} GB of parquet to download into {data_dir}, "
    print(f"{repo_id} sample/{sample}: {download}about {needs[output_dir] / 1e9:,.1f} GB of outputs to write in "
          f"{output_dir}")
    for directory in needs:  # directories on one filesystem add up
        need = sum(size for other, size in needs.items() if os.stat(other).st_dev == os.stat(directory).st_dev)
        space = shutil.disk_usage(directory).free
        if need > space:
            raise OSError(f"{directory}: needs about {need / 1e9:,.1f} GB but only {space / 1e9:,.1f} GB is free "
                          f"(download and outputs); make room, move --data-dir/--output-dir or --skip-space-check")


def find_inputs(pattern, output_dir=None):
    """The files matching `pattern` (a path or a glob, ** allowed), sorted, but for our own outputs in output_dir."""
    ours = output_dir and os.path.realpath(output_dir)
    files = []
    for path in sorted(glob.glob(pattern, recursive=True)):
        if not os.path.isfile(path):
            continue
        if OUR_FILE.fullmatch(os.path.basename(path)) and os.path.realpath(os.path.dirname(path)) == ours:
            continue  # e.g. --input 'data/**' with the outputs in data/megatron_gpt2
        files.append(path)
    if not files:
        raise FileNotFoundError(f"--input {pattern!r} matches no file")
    return files


@contextlib.contextmanager
def locked(output_dir):
    """Hold an exclusive flock on output_dir/.prepare.lock for the block: a second run there stops at once."""
    path = os.path.join(output_dir, ".prepare.lock")
    try:
        fd = lock_file(path)
    except LockHeld as e:
        raise OSError(f"{path}: held by another prepare_fineweb.py run ({e.holder}) writing into {output_dir}; "
                      f"wait for it to end or stop it") from None
    try:
        yield fd
    finally:
        os.remove(path)  # before the unlock: a run that opened it meanwhile sees it gone
        os.close(fd)


def start_worker(lock_fd):
    """Leave Ctrl-C to the parent and the lock too: the orphaned workers of a killed run must not hold it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.close(lock_fd)


@contextlib.contextmanager
def reraised(where, what, *errors):
    """Turn `errors` raised in the block into one line: a ValueError naming `where` and saying `what` went wrong."""
    try:
        yield
    except errors as e:
        raise ValueError(f"{where}: {what} ({e})") from e


def open_parquet(path, text_key):
    with reraised(path, "not a readable parquet file", pa.ArrowException, OSError):
        parquet = pq.ParquetFile(path, pre_buffer=False)  # pre_buffer: iter_batches would read the whole file ahead
    names = parquet.schema_arrow.names
    if text_key not in names:
        raise ValueError(f"{path}: no column {text_key!r} (columns: {', '.join(names)}); choose one with --text-key")
    kind = parquet.schema_arrow.field(text_key).type
    if kind not in ("string", "large_string", "binary", "large_binary"):
        raise ValueError(f"{path}: column {text_key!r} holds {kind}, not text")
    return parquet


def read_tasks(path, text_key, chunk_bytes):
    """Yield (task, byte position reached) for tasks of about chunk_bytes of whole documents, then (None, file size)."""
    if path.endswith(".parquet"):
        parquet = open_parquet(path, text_key)
        metadata, size = parquet.metadata, os.path.getsize(path)
        leaf = [column.path for column in metadata.schema].index(text_key)
        rows, total_rows = 0, max(metadata.num_rows, 1)  # progress: the share of rows read
        with parquet, reraised(path, "unreadable parquet data", pa.ArrowException):
            for group in range(metadata.num_row_groups):
                group_rows = metadata.row_group(group).num_rows
                text_bytes = metadata.row_group(group).column(leaf).total_uncompressed_size
                if text_bytes <= 16 * chunk_bytes:  # a row group of up to 16 chunks is one task: a worker reads it
                    rows += group_rows
                    yield (path, "parquet", text_key, 0, group), size * rows // total_rows
                    continue
                # a bigger one is read here, in batches of about chunk_bytes of text, each a task
                batch_rows = max(1, group_rows * chunk_bytes // text_bytes)
                for batch in parquet.iter_batches(batch_rows, [group], [text_key]):
                    texts = batch.column(0)
                    rows += len(texts)
                    yield (path, "parquet", text_key, 0, texts), size * rows // total_rows
    else:
        kind = "txt" if path.endswith(".txt") else "jsonl"
        with open(path, "rb") as raw, reraised(path, "unreadable", OSError, EOFError, zlib.error):
            stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            rest, first_line = b"", 1  # rest: the start of a document the next block continues
            while True:
                # reading at least as much as is left over keeps a giant line from being copied over and over
                block = stream.read(max(chunk_bytes, len(rest)))
                if not block:
                    break
                block = rest + block
                end = CUT[kind].match(block).end()  # just after the block's last whole document, 0 if none
                if end:
                    yield (path, kind, text_key, first_line, block[:end]), raw.tell()
                    first_line += block.count(b"\n", 0, end)
                rest = block[end:]
            yield (path, kind, text_key, first_line, rest), raw.tell()
    yield None, os.path.getsize(path)


@functools.lru_cache(maxsize=1)
def parquet_file(path):
    """The parquet file of a worker's last task, kept open: its next task is most often in the same file."""
    return pq.ParquetFile(path, pre_buffer=False)


def encode_task(task):
    """Tokenize one task in a worker: (uint16 tokens with EOT after each document, int64 document lengths, counts)."""
    path, kind, text_key, first_line, payload = task
    if isinstance(payload, int):  # a row group's number
        with reraised(path, f"unreadable parquet data in row group {payload}", pa.ArrowException):
            payload = parquet_file(path).read_row_group(payload, columns=[text_key]).column(0)
    if kind == "jsonl":
        raws = payload.split(b"\n")
    elif kind == "txt":  # a document is a run of lines that are not blank, without its final line break
        raws = [document.rstrip(b"\r\n") for document in TEXT_DOCUMENT.findall(payload)]
    else:  # parquet texts as bytes, so that invalid UTF-8 is replaced and counted as in the other kinds
        raws = payload.cast(pa.large_binary()).fill_null(b"").to_pylist()
    encoding, pieces, lengths = gpt2_encoding(), [np.empty(0, np.uint32)], []  # np.concatenate needs one array
    counts = collections.Counter(empty_skipped=0, invalid_utf8=0)
    for number, raw in enumerate(raws, first_line):  # number: of the line, in a JSONL file
        if kind == "jsonl" and not raw.strip():  # blank lines between records are not records
            continue
        text = raw.decode(errors="replace")  # invalid UTF-8 becomes U+FFFD instead of stopping the run
        invalid = "\ufffd" in text and text.encode() != raw
        if kind == "jsonl":
            where = f"{path}, line {number}"
            with reraised(where, "not valid JSON", ValueError):
                record = json.loads(text)
            if not isinstance(record, dict) or text_key not in record:
                found = f"keys: {', '.join(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
                raise ValueError(f"{where}: no key {text_key!r} ({found}); pick one with --text-key")
            text = record[text_key]
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{where}: the {text_key!r} value is {type(text).__name__}, not a string")
        if not text:
            counts["empty_skipped"] += 1
            continue
        try:  # encode_to_numpy, no special token allowed or disallowed: encode_ordinary without a Python list
            tokens = encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (a JSON "\ud800"): replaced, as encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            tokens, invalid = encoding.encode_to_numpy(text, disallowed_special=()), True
        counts["invalid_utf8"] += invalid
        pieces += (tokens, EOT_ARRAY)
        lengths.append(len(tokens) + 1)
    return np.concatenate(pieces).astype(np.uint16), np.array(lengths, dtype=np.int64), counts


def all_tasks(todo, text_key, chunk_bytes):
    """Yield (index, task, byte position reached) for the inputs `todo` {index: path} in order; task None at an end."""
    for index, path in todo.items():
        for task, position in read_tasks(path, text_key, chunk_bytes):
            yield index, task, position


def document_stream(pool, todo, text_key, chunk_bytes, workers, counts, bar):
    """Yield (index, tokens) for each document of the inputs `todo` {index: path} in order, (index, None) after each."""
    tasks = all_tasks(todo, text_key, chunk_bytes)
    pending = collections.deque()  # (index, position, the task's AsyncResult, or None at the end of an input)

    def send_next_task():
        item = next(tasks, None)
        if item is not None:
            index, task, position = item
            pending.append((index, position, None if task is None else pool.apply_async(encode_task, (task,))))

    # 2 tasks a worker in flight, so none waits; Pool.imap would read every input ahead into memory
    for _ in range(2 * workers):
        send_next_task()
    documents = tokens = file_position = 0
    while pending:
        index, position, result = pending.popleft()
        send_next_task()  # the next task, read and sent while this one is collected
        bar.update(position - file_position)
        if result is None:  # the end of input `index`
            file_position = 0
            yield index, None
            continue
        file_position = position
        task_tokens, lengths, task_counts = result.get()
        counts[index].update(task_counts, input_documents=len(lengths))
        documents += len(lengths)
        tokens += len(task_tokens)
        elapsed = max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix_str(f"{documents / elapsed:,.0f} docs/s, {tokens / elapsed / 1e6:,.2f}M tokens/s", False)
        for document in np.split(task_tokens, np.cumsum(lengths)[:-1]):
            if len(document):  # a task without documents splits into one empty array
                yield index, document


def documents_of_one_input(stream):
    """The documents `stream` yields up to the end of the input they come from; its end marker is taken too."""
    for _, document in stream:
        if document is None:
            return
        yield document


def val_documents(stream, val_tokens, seen):
    """The first documents of `stream` until they hold val_tokens tokens; `seen` gets the input of each item taken."""
    tokens = 0
    for index, document in stream:
        seen.append(index)
        if document is not None:
            yield document
            tokens += len(document)
            if tokens >= val_tokens:
                return


def kept_outputs(inputs, output_dir, options):
    """Each output's fingerprint, and (val entry or None, {index: entry}, summary) of an earlier run that still hold."""
    # a fingerprint hashes the options and the output's input; with a val split it hashes inputs 0 to its own, since
    # they decide which of its documents val took
    digest, fingerprints = hashlib.sha256(json.dumps(options, sort_keys=True).encode()), []
    options_only = digest.copy()
    for path in inputs:
        if not options["val_tokens"]:
            digest = options_only.copy()
        # size, mtime and the first and last MiB: a full hash would reread a terabyte; a parquet footer is at its end
        with open(path, "rb") as f:
            stat, head = os.stat(path), f.read(1 << 20)
            f.seek(max(stat.st_size - (1 << 20), 0))
            ends = hashlib.sha256(head + f.read(1 << 20)).hexdigest()
        digest.update(f"{stat.st_size}:{stat.st_mtime_ns}:{ends}".encode())
        fingerprints.append(digest.hexdigest())

    def finished(prefix, entry):  # whether the dataset at `prefix` is the complete one summary.json's entry describes
        if entry["output"] is None:  # every document of the input went to val, or it had none
            return entry["documents"] == 0
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # IndexedDataset checks the .bin's size
            dataset = IndexedDataset(prefix)  # an empty one (older code) is redone too
            return dataset.num_documents == entry["documents"] > 0 and dataset.num_tokens == entry["tokens"]

    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, IndexError):  # a damaged summary keeps nothing
        earlier = json.loads(pathlib.Path(output_dir, "summary.json").read_text())
        files = {entry["index"]: dict(entry, kept=True) for entry in earlier["files"]
                 if entry["index"] < len(inputs) and entry["fingerprint"] == fingerprints[entry["index"]]
                 and finished(output_prefix(output_dir, entry["index"]), entry)}
        val, last = (earlier["val"], earlier["val"]["last_input"]) if options["val_tokens"] else (None, -1)
        # val is kept only with the outputs of every input it draws from, as theirs start at its end
        if val is None or (val["fingerprint"] == fingerprints[last] and all(index in files for index in range(last + 1))
                           and finished(os.path.join(output_dir, "val_text_document"), val)):
            return fingerprints, val and dict(val, kept=True), files, earlier
    return fingerprints, None, {}, {}


def write_output(prefix, documents):
    """Write the token arrays `documents` as prefix.bin/.idx, each file published whole; say so, return its entry."""
    for suffix in (".idx", ".bin"):  # the old pair goes first, so no half of it can pass for part of the new one
        pathlib.Path(prefix + suffix).unlink(missing_ok=True)
    entry = dict(output=None, documents=0, tokens=0, output_bytes=0, kept=False)
    first = next(documents, None)
    if first is None:  # no files: megatron-core cannot map an empty .bin
        return entry
    with atomic_path(prefix + ".bin") as path:
        builder = IndexedDatasetBuilder(path, dtype=np.uint16)
        for document in itertools.chain([first], documents):
            builder.add_document(document)
        builder.finalize(prefix + ".idx")  # published whole, before the .bin it closes
    entry.update(output=prefix, documents=len(builder.sequence_lengths), tokens=os.path.getsize(prefix + ".bin") // 2)
    tqdm.write(f"{prefix}: {entry['documents']:,} documents, {entry['tokens']:,} tokens")
    return dict(entry, output_bytes=2 * entry["tokens"])


def prepare(inputs, output_dir, *, text_key="text", workers=1, chunk_bytes=CHUNK_BYTES, val_tokens=0):
    """Tokenize `inputs` into output_dir, keeping what an earlier run finished; print and return the summary."""
    start = time.time()
    os.makedirs(output_dir, exist_ok=True)
    with locked(output_dir) as lock:
        for name in os.listdir(output_dir):  # what a killed run was writing (a live one would hold the lock)
            if TEMPORARY_FILE.fullmatch(name):
                os.remove(os.path.join(output_dir, name))
        options = {"format": FORMAT, "tokenizer": "gpt2 (tiktoken encode_ordinary) + EOT 50256", "bpe_sha256": SHA256,
                   "text_key": text_key, "dtype": "uint16", "val_tokens": val_tokens}
        fingerprints, val, files, earlier = kept_outputs(inputs, output_dir, options)
        todo = {index: path for index, path in enumerate(inputs) if index not in files}
        if not todo and earlier.get("finished") and len(earlier["files"]) == len(inputs):  # no outputs of other inputs
            print(f"{output_dir}: already complete ({earlier['documents']:,} documents, {earlier['tokens']:,} "
                  f"tokens); nothing to do")
            return dict(earlier, val=val, files=[files[index] for index in sorted(files)])
        for index, entry in sorted(files.items()):
            print(f"{entry['output'] or inputs[index]}: finished by an earlier run, kept")
        for path in todo.values():  # fail before any work starts if a file cannot be read at all
            if not path.endswith(INPUT_SUFFIXES):
                raise ValueError(f"{path}: unsupported input type; expected one of {', '.join(INPUT_SUFFIXES)}")
            (open_parquet(path, text_key) if path.endswith(".parquet") else open(path, "rb")).close()
        counts = {index: collections.Counter(empty_skipped=0, invalid_utf8=0, input_documents=0) for index in todo}

        def save(finished):
            entries = [files[index] for index in sorted(files)]
            outputs = entries + ([val] if val else [])
            seconds = time.time() - start
            summary = {key: sum(entry.get(key, 0) for entry in outputs) for key in
                       ("documents", "tokens", "empty_skipped", "invalid_utf8", "input_bytes", "output_bytes")}
            tokenized = sum(entry["tokens"] for entry in outputs if not entry["kept"])
            summary.update(finished=finished, seconds=round(seconds, 3), workers=workers, options=options, val=val,
                           tokens_per_second=round(tokenized / max(seconds, 1e-9)), files=entries)
            with atomic_write(os.path.join(output_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            return summary

        bar = tqdm(total=sum(os.path.getsize(path) for path in todo.values()), unit="B", unit_scale=True,
                   desc=f"tokenizing {len(todo)} files", mininterval=1, dynamic_ncols=True, disable=not todo)
        with multiprocessing.Pool(workers, start_worker, (lock,)) as pool, bar:
            stream = document_stream(pool, todo, text_key, chunk_bytes, workers, counts, bar)
            seen = [0]  # the inputs of what val took: those before the last one it reached went to it whole
            if val_tokens and val is None:  # then todo is every input, and the stream starts with input 0
                val = write_output(os.path.join(output_dir, "val_text_document"),
                                   val_documents(stream, val_tokens, seen))
                val.update(last_input=seen[-1], fingerprint=fingerprints[seen[-1]])
            for index, path in todo.items():
                if index < seen[-1]:  # val took every document of it
                    documents = iter(())
                else:  # the rest of its documents, or all of them
                    documents = documents_of_one_input(stream)
                written = write_output(output_prefix(output_dir, index), documents)
                files[index] = dict(index=index, input=path, input_name=os.path.basename(path), **written,
                                    fingerprint=fingerprints[index], **counts[index], input_bytes=os.path.getsize(path))
                save(finished=False)
                if not counts[index]["input_documents"]:
                    tqdm.write(f"{path}: warning: no documents (an empty file, or only empty texts), so no output",
                               file=sys.stderr)
        summary = save(finished=True)
        made = {os.path.basename(entry["output"]) for entry in [val, *files.values()] if entry and entry["output"]}
        for name in sorted(os.listdir(output_dir)):
            match = OUTPUT_FILE.fullmatch(name)
            if match and match[1] not in made:
                os.remove(os.path.join(output_dir, name))
                print(f"{os.path.join(output_dir, name)}: made from an input that is no longer given, removed")
        print(f"{output_dir}: {len(made)} outputs, " + "{documents:,} documents, {tokens:,} tokens, {seconds:,.1f} s; "
              "{empty_skipped:,} empty texts skipped, {invalid_utf8:,} with invalid UTF-8 replaced".format_map(summary))
        return summary


def main(argv=None):
    cpus = usable_cores()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fineweb-edu", help="the dataset to download")
    parser.add_argument("--sample", choices=sorted(SAMPLE_TOKENS), default="10BT", help="which sample/<N> to download")
    parser.add_argument("--data-dir", default="fineweb_edu", help="hub cache directory for the download (reused)")
    parser.add_argument("--input", metavar="GLOB", help="local .parquet, .jsonl(.gz) or .txt files, not the download")
    parser.add_argument("--output-dir", help="where the .bin/.idx files go (default: {data_dir}/megatron_gpt2)")
    parser.add_argument("--text-key", default="text", help="parquet column or JSON field holding the text")
    parser.add_argument("--val-tokens", type=int, help=f"tokens of whole documents for val_text_document (default: "
                                                       f"{HUB_VAL_TOKENS:,} for the hub datasets, 0 with --input)")
    parser.add_argument("--skip-space-check", action="store_true", help="start even if the disks look too full")
    parser.add_argument("--workers", type=int, default=cpus, help="tokenizer processes (default: one per CPU)")
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="text per task sent to a worker")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.chunk_bytes < 1 or (args.val_tokens or 0) < 0:
        parser.error("--workers and --chunk-bytes must be at least 1, --val-tokens at least 0")
    output_dir = args.output_dir or os.path.join(args.data_dir, "megatron_gpt2")
    try:
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ValueError(f"{output_dir}: a file, not a directory; choose another --output-dir")
        if not args.input and not args.skip_space_check:
            check_disk_space(args.dataset, args.sample, args.data_dir, output_dir)
        inputs = find_inputs(args.input, output_dir) if args.input else download(args.dataset, args.sample,
                                                                                 args.data_dir)
        prepare(inputs, output_dir, text_key=args.text_key, workers=args.workers, chunk_bytes=args.chunk_bytes,
                val_tokens=HUB_VAL_TOKENS if args.val_tokens is None and not args.input else args.val_tokens or 0)
    except (ValueError, OSError) as e:
        if getattr(e, "filename", None) and not isinstance(e, WriteError):  # a raw OSError (a removal, a directory)
            message = f"{e.filename}: {e.strerror}"  # its file first, not its errno
        else:  # our own one-line errors, and WriteError's "cannot write <file>: <reason>"
            message = str(e)
        sys.exit(f"prepare_fineweb.py: error: {message}")
    except KeyboardInterrupt:
        sys.exit("prepare_fineweb.py: interrupted; run the same command again to resume")


if __name__ == "__main__":
    main()
