"""FineWeb-Edu to Megatron-Core indexed datasets: download, GPT-2 tokenize, write .bin/.idx files.

    python prepare_fineweb.py --workers 32                      # fineweb-edu, sample/10BT
    python prepare_fineweb.py --dataset fineweb --sample 100BT  # HuggingFaceFW/fineweb
    python prepare_fineweb.py --input 'corpus/*.jsonl.gz' --output-dir data/corpus

The first --val-tokens go to val_text_document (llm.c's val shard), the rest of input i to
processed_data_{i}_text_document. A rerun keeps the outputs whose fingerprints in summary.json still
match, so that a killed run resumes where it stopped. docs/data.md says more."""
import argparse
import collections
import contextlib
import glob
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import re
import signal
import sys
import time
import zlib

import huggingface_hub
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from atomic_io import LockHeld, atomic_path, atomic_write, lock_file, remove_stale_temporaries
from indexed_dataset import IndexedDataset, IndexedDatasetBuilder, usable_cores
from tokenizer import EOT_ID, SHA256, gpt2_encoding

DATASETS = {"fineweb-edu": "HuggingFaceFW/fineweb-edu", "fineweb": "HuggingFaceFW/fineweb"}
SAMPLES = ("10BT", "100BT", "350BT")  # each named by its size in GPT-2 tokens
HUB_VAL_TOKENS = 100_000_000  # llm.c's and build-nanogpt's val shard: the first 100M tokens
INPUT_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".txt")
# Text per task. Pickling 1 MiB to a worker costs little next to the ~0.2 s of tokenizing it, and
# with two tasks in flight per worker the memory held stays small.
CHUNK_BYTES = 1 << 20
# A text task ends after its block's last line (JSONL) or blank line (text): documents stay whole.
CUT = {"jsonl": re.compile(rb"(?s:.*\n)?"), "txt": re.compile(rb"(?s:.*\n[ \t\r\f\v]*\n)?")}
TEXT_DOCUMENT = re.compile(rb"(?:^[^\S\n]*\S[^\n]*\n?)+", re.MULTILINE)  # a run of non-blank lines
OUTPUT_FILE = re.compile(r"((?:processed_data_\d+|val)_text_document)\.(?:bin|idx)")  # [1]: prefix
EOT_ARRAY = np.array([EOT_ID], dtype=np.uint32)
# summary.json's totals over all outputs
SUMMED = ("documents", "tokens", "empty_skipped", "invalid_utf8", "input_bytes", "output_bytes")
FORMAT = 2  # bump it when a change here changes the bytes written: older outputs are then redone


def output_prefix(output_dir, index):
    return os.path.join(output_dir, f"processed_data_{index}_text_document")


@contextlib.contextmanager
def reraised(where, what, *errors):
    """Turn `errors` raised in the block into a one-line ValueError naming `where`."""
    try:
        yield
    except errors as e:
        raise ValueError(f"{where}: {what} ({e})") from e


def download(dataset, sample, data_dir):
    """The parquet files of sample/{sample} of the dataset, fetched into the hub cache data_dir."""
    repo_id, pattern = DATASETS[dataset], f"sample/{sample}/*.parquet"
    # Offline, with no complete copy in the cache, huggingface_hub raises a FileNotFoundError.
    what = f"no complete copy of {repo_id} {pattern} here, and the hub cannot be reached"
    with reraised(data_dir, what, FileNotFoundError):
        snapshot = huggingface_hub.snapshot_download(repo_id, repo_type="dataset",
                                                     allow_patterns=pattern, cache_dir=data_dir)
    files = sorted(glob.glob(os.path.join(snapshot, pattern)))
    if not files:
        raise FileNotFoundError(f"{snapshot}: no files match {pattern}")
    return files


def find_inputs(pattern):
    """The files matching `pattern` (a path or a glob, ** allowed), sorted. Files named as our
    outputs are left out: --input 'data/**' with the outputs in data/megatron_gpt2 must not read
    them back."""
    files = []
    for path in sorted(glob.glob(pattern, recursive=True)):
        name = os.path.basename(path)
        if os.path.isfile(path) and not (OUTPUT_FILE.fullmatch(name) or name == "summary.json"):
            if not path.endswith(INPUT_SUFFIXES):  # a stray file stops the run before any work
                raise ValueError(f"{path}: unsupported input type, not one of {INPUT_SUFFIXES}")
            files.append(path)
    if not files:
        raise FileNotFoundError(f"--input {pattern!r} matches no file")
    return files


@contextlib.contextmanager
def locked(output_dir):
    """Hold an exclusive flock on output_dir/.prepare.lock: a second run there stops at once."""
    path = os.path.join(output_dir, ".prepare.lock")
    try:
        fd = lock_file(path)
    except LockHeld as e:
        raise OSError(f"{path}: held by another prepare_fineweb.py run ({e.holder}); wait for it "
                      f"to end or stop it") from None
    try:
        yield fd
    finally:
        os.remove(path)  # before the unlock, so that a run that opened it meanwhile sees it gone
        os.close(fd)


def start_worker(lock_fd):
    """Leave Ctrl-C and the lock to the parent: a killed run's orphaned workers must not hold it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.close(lock_fd)


def parquet_tasks(path, text_key, chunk_bytes):
    """Yield (task, byte position reached) for the row groups of a parquet file."""
    with reraised(path, "not a readable parquet file", pa.ArrowException, OSError):
        parquet = pq.ParquetFile(path, pre_buffer=False)  # or iter_batches reads the file ahead
    if text_key not in parquet.schema_arrow.names:
        names = ", ".join(parquet.schema_arrow.names)
        raise ValueError(f"{path}: no column {text_key!r} (columns: {names}); see --text-key")
    kind = parquet.schema_arrow.field(text_key).type
    if kind not in ("string", "large_string", "binary", "large_binary"):
        raise ValueError(f"{path}: column {text_key!r} holds {kind}, not text")
    metadata, size = parquet.metadata, os.path.getsize(path)
    leaf = [column.path for column in metadata.schema].index(text_key)
    rows, total_rows = 0, max(metadata.num_rows, 1)  # the share of rows read is the progress
    with parquet, reraised(path, "unreadable parquet data", pa.ArrowException):
        for group in range(metadata.num_row_groups):
            group_rows = metadata.row_group(group).num_rows
            text_bytes = metadata.row_group(group).column(leaf).total_uncompressed_size
            # A row group of up to 16 chunks is a task that the worker reads, sparing the parent.
            if text_bytes <= 16 * chunk_bytes:
                rows += group_rows
                yield (path, "parquet", text_key, 0, group), size * rows // total_rows
                continue
            # A bigger one is read here, a task per chunk_bytes, so that the workers share it.
            batch_rows = max(1, group_rows * chunk_bytes // text_bytes)
            for batch in parquet.iter_batches(batch_rows, [group], [text_key]):
                rows += batch.num_rows
                yield (path, "parquet", text_key, 0, batch.column(0)), size * rows // total_rows


def text_tasks(path, text_key, chunk_bytes):
    """Yield (task, byte position reached) for chunk_bytes blocks of a JSONL or text file."""
    kind = "txt" if path.endswith(".txt") else "jsonl"
    with open(path, "rb") as raw, reraised(path, "unreadable", OSError, EOFError, zlib.error):
        stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        rest, first_line = b"", 1  # rest: the start of a document that the next block continues
        while True:
            # Reading at least what is left over keeps a giant line from being copied over and over.
            block = stream.read(max(chunk_bytes, len(rest)))
            if not block:
                break
            block = rest + block
            end = CUT[kind].match(block).end()  # just after the last whole document, 0 if none
            if end:
                yield (path, kind, text_key, first_line, block[:end]), raw.tell()
                first_line += block.count(b"\n", 0, end)
            rest = block[end:]
        yield (path, kind, text_key, first_line, rest), raw.tell()


def encode_task(task):
    """Tokenize one task in a worker: uint16 tokens, EOT after each document; lengths; counts."""
    path, kind, text_key, first_line, payload = task
    if kind == "parquet" and isinstance(payload, int):  # the number of a row group to read here
        with reraised(path, f"unreadable parquet data in row group {payload}", pa.ArrowException):
            with pq.ParquetFile(path) as parquet:
                payload = parquet.read_row_group(payload, columns=[text_key]).column(0)
    if kind == "jsonl":
        raws = payload.split(b"\n")
    elif kind == "txt":  # a document is a run of non-blank lines, without its final line break
        raws = [document.rstrip(b"\r\n") for document in TEXT_DOCUMENT.findall(payload)]
    else:  # parquet texts as bytes, so that invalid UTF-8 is replaced and counted as in the others
        raws = payload.cast(pa.large_binary()).fill_null(b"").to_pylist()
    encoding, pieces, lengths = gpt2_encoding(), [np.empty(0, np.uint32)], []  # one to concatenate
    counts = collections.Counter(empty_skipped=0, invalid_utf8=0)
    for line_number, raw in enumerate(raws, first_line):
        if kind == "jsonl" and not raw.strip():  # blank lines between records are not records
            continue
        # Invalid UTF-8 becomes U+FFFD instead of stopping the run; we count the documents it hit.
        text = raw.decode(errors="replace")
        invalid = "\ufffd" in text and text.encode() != raw
        if kind == "jsonl":
            where = f"{path}, line {line_number}"
            with reraised(where, "not valid JSON", ValueError):
                record = json.loads(text)
            if not isinstance(record, dict) or text_key not in record:
                found = f"keys: {', '.join(record)}" if isinstance(record, dict) else "no object"
                raise ValueError(f"{where}: no key {text_key!r} ({found}); see --text-key")
            text = record[text_key]
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{where}: the {text_key!r} value is not a string")
        if not text:
            counts["empty_skipped"] += 1
            continue
        try:  # encode_ordinary, to a numpy array: no special token is allowed, nor disallowed
            tokens = encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (JSON "\ud800"), replaced like encode_ordinary
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            tokens, invalid = encoding.encode_to_numpy(text, disallowed_special=()), True
        counts["invalid_utf8"] += invalid
        pieces += (tokens, EOT_ARRAY)
        lengths.append(len(tokens) + 1)
    return np.concatenate(pieces).astype(np.uint16), np.array(lengths, dtype=np.int64), counts


def document_stream(pool, todo, text_key, chunk_bytes, workers, counts, bar):
    """Yield (index, tokens) of each document of the inputs {index: path}, in order, and (index,
    None) at the end of each input. Two tasks in flight per worker keep each of them busy;
    Pool.imap would read every input ahead."""
    def sent_tasks():  # (index, the task's result or None at an end, bytes of all inputs read)
        done = 0
        for index, path in todo.items():
            read_tasks = parquet_tasks if path.endswith(".parquet") else text_tasks
            for task, position in read_tasks(path, text_key, chunk_bytes):
                yield index, pool.apply_async(encode_task, (task,)), done + position
            done += os.path.getsize(path)
            yield index, None, done

    tasks = sent_tasks()
    pending = collections.deque(itertools.islice(tasks, 2 * workers))
    while pending:
        index, result, position = pending.popleft()
        pending.extend(itertools.islice(tasks, 1))  # read and sent while this one is collected
        bar.update(position - bar.n)
        if result is None:
            yield index, None
            continue
        task_tokens, lengths, task_counts = result.get()
        counts[index].update(task_counts, input_documents=len(lengths))
        for document in np.split(task_tokens, np.cumsum(lengths)[:-1]):
            if len(document):  # a task without documents splits into one empty array
                yield index, document


def documents_of_one_input(stream):
    """The documents `stream` yields up to the end of their input; the end marker is taken too."""
    for _, document in stream:
        if document is None:
            return
        yield document


def val_documents(stream, val_tokens, seen):
    """The first documents of `stream` up to val_tokens tokens; `seen` gets each item's input."""
    tokens = 0
    for index, document in stream:
        seen.append(index)
        if document is not None:
            yield document
            tokens += len(document)
            if tokens >= val_tokens:
                return


def fingerprints_of(inputs, options):
    """A hash per input of the options and the input's size, mtime, first and last MiB (a full hash
    would reread a terabyte). With a val split, input i's also covers the inputs before it, as they
    decide which of its documents val took."""
    options_digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    digest, fingerprints = options_digest.copy(), []
    for path in inputs:
        if not options["val_tokens"]:
            digest = options_digest.copy()
        with open(path, "rb") as f:
            stat, head = os.stat(path), f.read(1 << 20)
            f.seek(max(stat.st_size - (1 << 20), 0))
            ends = hashlib.sha256(head + f.read(1 << 20)).hexdigest()
        digest.update(f"{stat.st_size}:{stat.st_mtime_ns}:{ends}".encode())
        fingerprints.append(digest.hexdigest())
    return fingerprints


def finished(prefix, entry):
    """Whether the dataset at `prefix` is the complete one that summary.json's entry describes."""
    if entry["output"] is None:  # every document of the input went to val, or it had none
        return entry["documents"] == 0
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # it checks the .bin's size
        dataset = IndexedDataset(prefix)
        documents, tokens = dataset.num_documents, dataset.num_tokens
        return documents == entry["documents"] > 0 and tokens == entry["tokens"]
    return False


def kept_outputs(inputs, output_dir, fingerprints, with_val):
    """(val entry or None, {index: entry}, summary) of what an earlier run finished, still valid."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, IndexError):  # keep nothing
        earlier = json.loads(pathlib.Path(output_dir, "summary.json").read_text())
        files = {}
        for entry in earlier["files"]:
            index = entry["index"]
            same_input = index < len(inputs) and entry["fingerprint"] == fingerprints[index]
            if same_input and finished(output_prefix(output_dir, index), entry):
                files[index] = dict(entry, kept=True)
        if not with_val:
            return None, files, earlier
        # val is kept with the output of the input it ended in, which starts where val ends: that
        # input's fingerprint covers the inputs before it, which went to val whole.
        val, val_prefix = earlier["val"], os.path.join(output_dir, "val_text_document")
        if val["last_input"] in files and finished(val_prefix, val):
            return dict(val, kept=True), files, earlier
    return None, {}, {}


def write_output(prefix, documents):
    """Write the token arrays `documents` as prefix.bin/.idx, each published whole."""
    for suffix in (".idx", ".bin"):  # the old pair goes first: no half of it passes for the new one
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
    tokens = os.path.getsize(prefix + ".bin") // 2
    documents = len(builder.sequence_lengths)
    entry.update(output=prefix, documents=documents, tokens=tokens, output_bytes=2 * tokens)
    tqdm.write(f"{prefix}: {documents:,} documents, {tokens:,} tokens")
    return entry


def write_summary(output_dir, start, options, val, files, complete):
    """summary.json: the totals, then each output's entry, which the next run's resume reads."""
    entries = [files[index] for index in sorted(files)]
    outputs = [entry for entry in [*entries, val] if entry]
    summary = {key: sum(entry.get(key, 0) for entry in outputs) for key in SUMMED}
    summary.update(finished=complete, seconds=round(time.time() - start, 3), options=options,
                   val=val, files=entries)
    with atomic_write(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def prepare(inputs, output_dir, *, text_key="text", workers=1, chunk_bytes=CHUNK_BYTES,
            val_tokens=0):
    """Tokenize `inputs` into output_dir, keeping what an earlier run finished."""
    start = time.time()
    os.makedirs(output_dir, exist_ok=True)
    with locked(output_dir) as lock:
        # What a killed run was writing: the lock keeps every other writer out, so it all goes.
        remove_stale_temporaries(output_dir, keep_empty=False)
        options = {"format": FORMAT, "tokenizer": "gpt2 (tiktoken encode_ordinary) + EOT 50256",
                   "bpe_sha256": SHA256, "text_key": text_key, "dtype": "uint16",
                   "val_tokens": val_tokens}
        fingerprints = fingerprints_of(inputs, options)
        val, files, earlier = kept_outputs(inputs, output_dir, fingerprints, bool(val_tokens))
        todo = {index: path for index, path in enumerate(inputs) if index not in files}
        # Complete if every output is kept and there are no outputs of other inputs to remove.
        if not todo and earlier.get("finished") and len(earlier["files"]) == len(inputs):
            print(f"{output_dir}: already complete ({earlier['documents']:,} documents, "
                  f"{earlier['tokens']:,} tokens); nothing to do")
            return dict(earlier, val=val, files=[files[index] for index in sorted(files)])
        for index, entry in sorted(files.items()):
            print(f"{entry['output'] or inputs[index]}: finished by an earlier run, kept")

        counts = {index: collections.Counter(empty_skipped=0, invalid_utf8=0, input_documents=0)
                  for index in todo}
        bar = tqdm(total=sum(map(os.path.getsize, todo.values())), unit="B", unit_scale=True,
                   desc=f"tokenizing {len(todo)} files", mininterval=1, disable=not todo)
        with multiprocessing.Pool(workers, start_worker, (lock,)) as pool, bar:
            stream = document_stream(pool, todo, text_key, chunk_bytes, workers, counts, bar)
            seen = [0]  # the inputs val drew from: those before the last one went to it whole
            if val_tokens and val is None:  # then todo is every input: the stream starts at input 0
                val_prefix = os.path.join(output_dir, "val_text_document")
                val = write_output(val_prefix, val_documents(stream, val_tokens, seen))
                val["last_input"] = seen[-1]
            for index, path in todo.items():
                documents = iter(()) if index < seen[-1] else documents_of_one_input(stream)
                written = write_output(output_prefix(output_dir, index), documents)
                files[index] = dict(index=index, input=path, input_name=os.path.basename(path),
                                    **written, fingerprint=fingerprints[index], **counts[index],
                                    input_bytes=os.path.getsize(path))
                write_summary(output_dir, start, options, val, files, complete=False)
                if not counts[index]["input_documents"]:
                    tqdm.write(f"{path}: warning: no documents, so no output", file=sys.stderr)
        # The outputs of inputs no longer given go: a glob over the directory would find them.
        made = {os.path.basename(entry["output"]) for entry in [val, *files.values()]
                if entry and entry["output"]}
        for name in sorted(os.listdir(output_dir)):
            match = OUTPUT_FILE.fullmatch(name)
            if match and match[1] not in made:
                os.remove(os.path.join(output_dir, name))
                print(f"{output_dir}/{name}: made from an input that is no longer given, removed")
        # No train file at all would send the user from train_gpt2.py back here: say it here.
        if not any(entry["output"] for entry in files.values()):
            raise ValueError(f"{output_dir}: no documents to train on in the {len(inputs)} "
                             f"input(s) (empty, or all taken by --val-tokens); nothing written")
        summary = write_summary(output_dir, start, options, val, files, complete=True)
        print(f"{output_dir}: " + "{documents:,} documents, {tokens:,} tokens, {seconds:,.1f} s; "
              "{empty_skipped:,} empty texts skipped, {invalid_utf8:,} with invalid UTF-8 replaced"
              .format_map(summary))
        return summary


def main(argv=None):
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fineweb-edu")
    parser.add_argument("--sample", choices=SAMPLES, default="10BT")
    parser.add_argument("--data-dir", default="fineweb_edu", help="hub cache for the download")
    parser.add_argument("--input", metavar="GLOB", help="local .parquet, .jsonl(.gz) or .txt files")
    parser.add_argument("--output-dir", help="for the .bin/.idx (default: DATA_DIR/megatron_gpt2)")
    parser.add_argument("--text-key", default="text", help="parquet column or JSON key of the text")
    parser.add_argument("--val-tokens", type=int, help=f"tokens for val_text_document (default: "
                        f"{HUB_VAL_TOKENS:,} for the hub datasets, 0 with --input)")
    parser.add_argument("--workers", type=int, default=usable_cores(), help="tokenizer processes")
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="text per worker task")
    args = parser.parse_args(argv)
    if args.val_tokens is None:  # llm.c's val shard for the hub's datasets, none for your own
        args.val_tokens = 0 if args.input else HUB_VAL_TOKENS
    if args.workers < 1 or args.chunk_bytes < 1 or args.val_tokens < 0:
        parser.error("--workers and --chunk-bytes must be at least 1, --val-tokens at least 0")
    output_dir = args.output_dir or os.path.join(args.data_dir, "megatron_gpt2")
    try:
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ValueError(f"{output_dir}: a file, not a directory; choose another --output-dir")
        if args.input:
            inputs = find_inputs(args.input)
        else:
            inputs = download(args.dataset, args.sample, args.data_dir)
        prepare(inputs, output_dir, text_key=args.text_key, workers=args.workers,
                chunk_bytes=args.chunk_bytes, val_tokens=args.val_tokens)
    except (ValueError, OSError) as e:  # ours name their file, WriteError's too ("cannot write F")
        sys.exit(f"prepare_fineweb.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit("prepare_fineweb.py: interrupted; run the same command again to resume")


if __name__ == "__main__":
    main()
