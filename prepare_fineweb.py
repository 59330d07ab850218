"""FineWeb-Edu to Megatron-Core indexed datasets in one command: download, GPT-2 tokenize, write .bin/.idx.

    python prepare_fineweb.py --workers 32                      # HuggingFaceFW/fineweb-edu, sample/10BT
    python prepare_fineweb.py --dataset fineweb --sample 100BT  # HuggingFaceFW/fineweb, sample/100BT
    python prepare_fineweb.py --input 'corpus/*.jsonl.gz' --output-dir data/corpus
    python prepare_fineweb.py --input data/tinyshakespeare.txt --output-dir data/shakespeare

Input file i, in sorted order, becomes {output_dir}/processed_data_{i}_text_document.{bin,idx}: the GPT-2 BPE tokens
of every document (tiktoken `encode_ordinary`, so "<|endoftext|>" inside a text is ordinary text) followed by EOT 50256,
uint16, one sequence per document, in input order; megatron-core's IndexedDataset and indexed_dataset.py read it.

The download goes through huggingface_hub into --data-dir, which is a hub cache directory (files land in
datasets--HuggingFaceFW--fineweb-edu/snapshots/<commit>/sample/10BT/): an interrupted download resumes, files already
there are not fetched again (point --data-dir at an existing cache such as ~/.cache/huggingface/hub to reuse it), and
with HF_HUB_OFFLINE=1 nothing is fetched at all. --input takes local files instead: .parquet (column --text-key),
.jsonl/.jsonl.gz (one JSON object per line, field --text-key) or .txt (each run of lines between blank lines is one
document). Null or empty texts are skipped and counted; invalid UTF-8 is replaced by U+FFFD and counted.

--workers processes tokenize tasks of about --chunk-bytes of text (parquet row groups, which they read themselves,
or blocks of JSONL lines or plain text) and this process writes their tokens in input order; at most two tasks per
worker are in flight, so memory does not grow with the input, and one big file keeps every worker as busy as many
files do.

Outputs are written under hidden temporary names and renamed when complete; summary.json, rewritten after each output,
lists the finished ones. A rerun skips those and redoes the rest, so an interrupted run (Ctrl-C, kill -9, full disk)
resumes and ends with exactly the bytes of an uninterrupted one, whatever --workers is.

There is no shuffling pass (terashuf): GPTDataset shuffles documents and samples by index at training time, the
validation split takes the last documents of each file, and the hub's samples are already in random order.
"""
import argparse
import collections
import functools
import glob
import gzip
import json
import multiprocessing
import os
import re
import signal
import sys
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tokenizer import EOT_ID, gpt2_encoding

DATASETS = {"fineweb-edu": "HuggingFaceFW/fineweb-edu", "fineweb": "HuggingFaceFW/fineweb"}
SAMPLES = ("10BT", "100BT", "350BT")
INPUT_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".txt")
# Text sent to a worker per task: big enough that pickling is noise next to tokenizing (~0.2 s of work), small enough
# that every worker has work until the end and the in-flight tasks (2 per worker) use little memory.
CHUNK_BYTES = 1 << 20
# A parquet row group of up to this many chunks of text is one task, read by the worker; a bigger one is read here.
ROW_GROUP_TASK_CHUNKS = 16
PARQUET_BATCH_ROWS = 1024
BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
SUMMARY_NAME = "summary.json"
EOT_ARRAY = np.array([EOT_ID], dtype=np.uint32)


def output_prefix(output_dir, index):
    return os.path.join(output_dir, f"processed_data_{index}_text_document")


def temporary_prefix(output_dir, index):
    # Hidden, so no glob of the outputs (e.g. processed_data_*_text_document*) ever picks up a partial file.
    return os.path.join(output_dir, f".processed_data_{index}_text_document.tmp")


# ----------------------------------------------------------------------------------------------------------------
# inputs


def download(dataset="fineweb-edu", sample="10BT", data_dir="fineweb_edu"):
    """The parquet files of `sample/{sample}` of the dataset, fetched into the hub cache `data_dir`; sorted paths."""
    from huggingface_hub import snapshot_download

    repo_id, pattern = DATASETS[dataset], f"sample/{sample}/*.parquet"
    try:
        snapshot = snapshot_download(repo_id, repo_type="dataset", allow_patterns=pattern, cache_dir=data_dir)
    except FileNotFoundError as e:  # huggingface_hub's LocalEntryNotFoundError: offline and not (fully) cached
        raise FileNotFoundError(f"{data_dir}: no complete copy of {repo_id} {pattern} in this hub cache, and the hub "
                                f"cannot be reached ({e})") from e
    files = sorted(glob.glob(os.path.join(snapshot, "sample", sample, "*.parquet")))
    if not files:
        raise FileNotFoundError(f"{snapshot}: no files match {pattern}")
    return files


def find_inputs(pattern):
    """The files matching `pattern` (a path or a glob, ** allowed), sorted: their order numbers the outputs."""
    files = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
    if not files:
        raise FileNotFoundError(f"--input {pattern!r} matches no file")
    return files


def open_parquet(path, text_key):
    try:
        # with pre_buffer, iter_batches fetches every row group's column chunk ahead: the whole file in memory
        parquet = pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({e})") from e
    schema = parquet.schema_arrow
    if text_key not in schema.names:
        parquet.close()
        raise ValueError(f"{path}: no column {text_key!r} (columns: {', '.join(schema.names)}); choose one with "
                         f"--text-key")
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        parquet.close()
        raise ValueError(f"{path}: column {text_key!r} holds {kind}, not text")
    return parquet


def check_input(path, text_key):
    """Fail before any work starts, naming the file, if `path` cannot be read at all."""
    if path.endswith(".parquet"):
        open_parquet(path, text_key).close()
    elif not path.endswith(INPUT_SUFFIXES):
        raise ValueError(f"{path}: unsupported input type; expected one of {', '.join(INPUT_SUFFIXES)}")
    else:
        open(path, "rb").close()


def as_bytes(column):
    """Texts as bytes: they reach the tokenizer undecoded, so invalid UTF-8 is replaced (and counted) there."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    return column.to_pylist()


def read_parquet(path, text_key, chunk_bytes):
    """Yield (kind, payload, 0, byte position reached) tasks for a parquet file.

    Row groups are read by the workers ("row_groups": runs of about chunk_bytes of text), so this process only hands
    them out; a row group too big for one task (over ROW_GROUP_TASK_CHUNKS chunks) is read here in record batches and
    sent as "texts" chunks instead.
    """
    parquet = open_parquet(path, text_key)
    metadata, size = parquet.metadata, os.path.getsize(path)
    leaf = next(i for i in range(metadata.num_columns) if metadata.schema.column(i).path == text_key)

    def position(rows):  # progress in bytes of the file, by the share of its rows read
        return size * rows // max(metadata.num_rows, 1)

    groups, group_bytes, rows_done = [], 0, 0
    try:
        for group in range(metadata.num_row_groups):
            text_bytes = metadata.row_group(group).column(leaf).total_uncompressed_size
            if text_bytes > ROW_GROUP_TASK_CHUNKS * chunk_bytes:
                if groups:
                    yield "row_groups", groups, 0, position(rows_done)
                    groups, group_bytes = [], 0
                for texts, rows_read in row_group_chunks(parquet, group, text_key, chunk_bytes):
                    yield "texts", texts, 0, position(rows_done + rows_read)
            else:
                groups.append(group)
                group_bytes += text_bytes
            rows_done += metadata.row_group(group).num_rows
            if group_bytes >= chunk_bytes:
                yield "row_groups", groups, 0, position(rows_done)
                groups, group_bytes = [], 0
    except pa.ArrowException as e:
        raise ValueError(f"{path}: unreadable parquet data ({e})") from e
    finally:
        parquet.close()
    yield "row_groups", groups, 0, size


def row_group_chunks(parquet, group, text_key, chunk_bytes):
    """Yield (texts, rows read so far) for one row group, read in record batches, in chunks of about chunk_bytes."""
    texts, text_bytes, rows = [], 0, 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[text_key]):
        for text in as_bytes(batch.column(0)):
            texts.append(text)
            text_bytes += len(text) if text else 0
            rows += 1
            if text_bytes >= chunk_bytes:
                yield texts, rows
                texts, text_bytes = [], 0
    yield texts, rows


def read_jsonl(path, chunk_bytes):
    """Yield ("jsonl", about chunk_bytes of whole lines, number of their first line, byte position reached)."""
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        rest, first_line = b"", 1
        while True:
            try:  # reading at least as much as is left over keeps a giant line from being copied over and over
                block = stream.read(max(chunk_bytes, len(rest)))
            except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz (BadGzipFile is an OSError)
                raise ValueError(f"{path}: unreadable ({e})") from e
            if not block:
                break
            block = rest + block
            cut = block.rfind(b"\n") + 1
            lines, rest = block[:cut], block[cut:]
            if lines:
                yield "jsonl", lines, first_line, raw.tell()
                first_line += lines.count(b"\n")
        yield "jsonl", rest, first_line, raw.tell()


def read_text(path, chunk_bytes):
    """Yield ("txt", about chunk_bytes of text that ends with a blank line, 0, byte position reached).

    Cutting only after blank lines keeps every document whole in one task, so the workers split them exactly as a
    reading of the whole file would.
    """
    with open(path, "rb") as f:
        rest = b""
        while True:
            block = f.read(max(chunk_bytes, len(rest)))  # as in read_jsonl: a giant document is not copied over and over
            if not block:
                break
            block = rest + block
            empty_line = block.rfind(b"\n\n")
            if empty_line >= 0:
                cut = empty_line + 2
            else:  # no empty line: cut after a line of only whitespace, or not at all
                cut = max((match.end() for match in BLANK_LINE.finditer(block)), default=0)
            if cut:
                yield "txt", block[:cut], 0, f.tell()
            rest = block[cut:]
        yield "txt", rest, 0, os.path.getsize(path)


def read_tasks(path, text_key, chunk_bytes):
    if path.endswith(".parquet"):
        return read_parquet(path, text_key, chunk_bytes)
    if path.endswith(".txt"):
        return read_text(path, chunk_bytes)
    return read_jsonl(path, chunk_bytes)


# ----------------------------------------------------------------------------------------------------------------
# tokenizing, in the worker processes


def init_worker():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it terminates the pool
    gpt2_encoding()


@functools.lru_cache(maxsize=1)
def parquet_file(path):
    return pq.ParquetFile(path, pre_buffer=False)  # a worker keeps the file it is reading open


def read_row_groups(path, groups, text_key):
    try:
        return as_bytes(parquet_file(path).read_row_groups(groups, columns=[text_key]).column(0))
    except pa.ArrowException as e:
        raise ValueError(f"{path}: unreadable parquet data in row groups {groups[0]}-{groups[-1]} ({e})") from e


def text_documents(block):
    """The documents of plain text: runs of lines that are not blank, each without its final line break."""
    documents, lines = [], []
    for line in block.split(b"\n") + [b""]:
        if line.strip():
            lines.append(line)
        elif lines:
            documents.append(b"\n".join(lines).rstrip(b"\r"))
            lines = []
    return documents


def decode(raw):
    """(text, whether raw was invalid UTF-8): invalid bytes become U+FFFD instead of stopping the run."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


def json_text(line, path, number, text_key):
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from e
    if not isinstance(record, dict):
        raise ValueError(f"{path}, line {number}: a JSON {type(record).__name__}, not an object")
    if text_key not in record:
        raise ValueError(f"{path}, line {number}: no key {text_key!r} (keys: {', '.join(record)}); choose one with "
                         f"--text-key")
    text = record[text_key]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{path}, line {number}: the {text_key!r} value is {type(text).__name__}, not a string")
    return text


def task_texts(path, kind, text_key, first_line, payload):
    """Yield (text or None, whether it was invalid UTF-8) for every document of one task, in order."""
    if kind == "jsonl":
        for n, line in enumerate(payload.split(b"\n")):
            if line.strip():  # blank lines between records are not records
                line, invalid = decode(line)
                yield json_text(line, path, first_line + n, text_key), invalid
        return
    if kind == "row_groups":
        payload = read_row_groups(path, payload, text_key) if payload else []
    elif kind == "txt":
        payload = text_documents(payload)
    for raw in payload:
        yield decode(raw) if raw is not None else (None, False)


def encode_task(task):
    """Tokenize one task: (uint16 tokens with EOT after each document, int64 document lengths, counts)."""
    encoding = gpt2_encoding()
    pieces, lengths, empty, invalid_utf8 = [], [], 0, 0
    for text, invalid in task_texts(*task):
        if not text:
            empty += 1
            continue
        # encode_to_numpy with no special token allowed or disallowed is encode_ordinary without a Python list
        try:
            tokens = encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (a JSON "\ud800"): replaced, as encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            tokens = encoding.encode_to_numpy(text, disallowed_special=())
            invalid = True
        invalid_utf8 += invalid
        pieces += (tokens, EOT_ARRAY)
        lengths.append(len(tokens) + 1)
    tokens = np.concatenate(pieces).astype(np.uint16) if pieces else np.empty(0, np.uint16)
    return tokens, np.array(lengths, dtype=np.int64), {"empty_skipped": empty, "invalid_utf8": invalid_utf8}


def encoded_tasks(pool, tasks, max_in_flight):
    """Yield (index, position, encode_task result or None) for `tasks` in order, at most max_in_flight at a time.

    Pool.imap would keep the order too, but it reads its whole input ahead: with a 100 GB input that is 100 GB of RAM.
    Items whose task is None are end-of-file markers and pass through in order.
    """
    pending = collections.deque()
    for index, position, task in tasks:
        pending.append((index, position, None if task is None else pool.apply_async(encode_task, (task,))))
        while len(pending) > max_in_flight:
            index, position, result = pending.popleft()
            yield index, position, None if result is None else result.get()
    for index, position, result in pending:
        yield index, position, None if result is None else result.get()


# ----------------------------------------------------------------------------------------------------------------
# outputs


def is_finished(prefix, entry):
    """Whether the dataset at `prefix` is the complete one that summary.json's `entry` describes."""
    try:
        dataset = IndexedDataset(prefix)  # checks the header and that the .bin holds every indexed token
        return (dataset.dtype == np.uint16 and dataset.num_documents == len(dataset) == entry["documents"]
                and dataset.num_tokens == entry["tokens"] and os.path.getsize(prefix + ".bin") == 2 * entry["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_summary(path):
    """The finished entries of an earlier run's summary.json, by output index; {} if there is none."""
    try:
        with open(path) as f:
            return {entry["index"]: entry for entry in json.load(f)["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def write_summary(path, summary):
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.replace(temporary, path)


def totals(entries, seconds, workers, finished):
    summary = {key: sum(entry[key] for entry in entries)
               for key in ("documents", "tokens", "empty_skipped", "invalid_utf8", "input_bytes", "output_bytes")}
    tokenized_now = sum(entry["tokens"] for entry in entries if not entry["kept"])
    summary.update(finished=finished, seconds=round(seconds, 3), workers=workers,
                   tokens_per_second=round(tokenized_now / max(seconds, 1e-9)),
                   tokenizer="gpt2 (tiktoken encode_ordinary) + EOT 50256", dtype="uint16", files=entries)
    return summary


def start_output(output_dir, index, path, text_key):
    """A builder writing output `index` under its temporary name, and the summary entry it will fill."""
    prefix = output_prefix(output_dir, index)
    # A redone output's old files go first, so no stale pair of them can pass for the new result.
    for suffix in (".idx", ".bin"):
        if os.path.exists(prefix + suffix):
            os.remove(prefix + suffix)
    builder = IndexedDatasetBuilder(temporary_prefix(output_dir, index) + ".bin", dtype=np.uint16)
    entry = {"index": index, "input": path, "input_name": os.path.basename(path), "text_key": text_key,
             "output": prefix, "documents": 0, "tokens": 0, "empty_skipped": 0, "invalid_utf8": 0,
             "input_bytes": os.path.getsize(path)}
    return builder, entry


def finish_output(builder, output_dir, index):
    temporary, prefix = temporary_prefix(output_dir, index), output_prefix(output_dir, index)
    builder.finalize(temporary + ".idx")
    # .bin first: until .idx is renamed too the output is visibly incomplete.
    os.replace(temporary + ".bin", prefix + ".bin")
    os.replace(temporary + ".idx", prefix + ".idx")
    return os.path.getsize(prefix + ".bin")


def prepare(inputs, output_dir, *, text_key="text", workers=1, chunk_bytes=CHUNK_BYTES):
    """Tokenize input file i into {output_dir}/processed_data_{i}_text_document.{bin,idx}; returns the summary.

    Outputs that an earlier run finished (listed in summary.json, for the same input file and text key) are kept.
    """
    start = time.time()
    if not hasattr(gpt2_encoding(), "encode_to_numpy"):  # also fails here if the BPE files are missing or corrupt
        raise RuntimeError("prepare_fineweb.py needs tiktoken >= 0.9 (for Encoding.encode_to_numpy): "
                           "pip install -U tiktoken")
    os.makedirs(output_dir, exist_ok=True)
    summary_path = os.path.join(output_dir, SUMMARY_NAME)
    earlier = read_summary(summary_path)
    entries, todo = {}, []
    for index, path in enumerate(inputs):
        entry = earlier.get(index)
        if (entry is not None and entry.get("input_name") == os.path.basename(path)
                and entry.get("input_bytes") == os.path.getsize(path) and entry.get("text_key") == text_key
                and is_finished(output_prefix(output_dir, index), entry)):
            entries[index] = dict(entry, kept=True)
            print(f"{output_prefix(output_dir, index)}: finished by an earlier run, kept")
        else:
            check_input(path, text_key)
            todo.append(index)

    def save(finished):
        summary = totals([entries[index] for index in sorted(entries)], time.time() - start, workers, finished)
        write_summary(summary_path, summary)
        return summary

    def tasks():
        for index in todo:
            path = inputs[index]
            for kind, payload, first_line, position in read_tasks(path, text_key, chunk_bytes):
                yield index, position, (path, kind, text_key, first_line, payload)
            yield index, os.path.getsize(path), None  # end of this file

    if not todo:
        return save(finished=True)
    builder, documents, tokens = None, 0, 0
    try:
        with multiprocessing.Pool(workers, initializer=init_worker) as pool, tqdm(
                total=sum(os.path.getsize(inputs[index]) for index in todo), unit="B", unit_scale=True,
                desc=f"tokenizing {len(todo)} files", mininterval=1, dynamic_ncols=True) as bar:
            previous_end = time.time()
            for index, position, result in encoded_tasks(pool, tasks(), 2 * workers):
                if builder is None:
                    builder, entry = start_output(output_dir, index, inputs[index], text_key)
                    file_position = 0
                if result is not None:
                    task_tokens, lengths, counts = result
                    for document in np.split(task_tokens, np.cumsum(lengths)[:-1]) if len(lengths) else ():
                        builder.add_document(document)
                    for key, count in dict(counts, documents=len(lengths), tokens=len(task_tokens)).items():
                        entry[key] += count
                    documents += len(lengths)
                    tokens += len(task_tokens)
                bar.update(position - file_position)
                file_position = position
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"{documents / elapsed:,.0f} docs/s, {tokens / elapsed / 1e6:,.2f}M tokens/s",
                                    refresh=False)
                if result is None:  # the end of input file `index`
                    entry.update(output_bytes=finish_output(builder, output_dir, index),
                                 seconds=round(time.time() - previous_end, 3), kept=False)
                    builder, previous_end, entries[index] = None, time.time(), entry
                    save(finished=False)
                    tqdm.write(f"{entry['output']}: {entry['documents']:,} documents, {entry['tokens']:,} tokens")
    except BaseException:
        if builder is not None:  # an output was being written: its temporary files go
            for suffix in (".bin", ".idx"):
                if os.path.exists(temporary_prefix(output_dir, entry["index"]) + suffix):
                    os.remove(temporary_prefix(output_dir, entry["index"]) + suffix)
        raise
    return save(finished=True)


def print_summary(summary, output_dir):
    kept = sum(entry["kept"] for entry in summary["files"])
    print(f"{len(summary['files'])} outputs in {output_dir} ({kept} kept from an earlier run): "
          f"{summary['documents']:,} documents, {summary['tokens']:,} tokens, "
          f"{summary['input_bytes'] / 1e6:,.1f} MB in, {summary['output_bytes'] / 1e6:,.1f} MB out, "
          f"{summary['seconds']:,.1f} s ({summary['tokens_per_second'] / 1e6:,.2f}M tokens/s); "
          f"{summary['empty_skipped']:,} empty or null texts skipped, "
          f"{summary['invalid_utf8']:,} with invalid UTF-8 replaced; {os.path.join(output_dir, SUMMARY_NAME)}")


def default_workers():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def positive_int(value):
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return number


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fineweb-edu",
                        help="which Hugging Face dataset to download")
    parser.add_argument("--sample", choices=SAMPLES, default="10BT", help="which sample/<N> to download")
    parser.add_argument("--data-dir", default="fineweb_edu",
                        help="hub cache directory for the download (an existing cache is reused)")
    parser.add_argument("--input", metavar="GLOB",
                        help="local .parquet, .jsonl, .jsonl.gz or .txt files to tokenize instead of the download")
    parser.add_argument("--output-dir", help="where the .bin/.idx files go (default: {data_dir}/megatron_gpt2)")
    parser.add_argument("--text-key", default="text", help="parquet column or JSON field holding the text")
    parser.add_argument("--workers", type=positive_int, default=default_workers(),
                        help="tokenizer processes (default: one per CPU)")
    parser.add_argument("--chunk-bytes", type=positive_int, default=CHUNK_BYTES,
                        help="text per task sent to a worker")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or os.path.join(args.data_dir, "megatron_gpt2")
    try:
        inputs = find_inputs(args.input) if args.input else download(args.dataset, args.sample, args.data_dir)
        summary = prepare(inputs, output_dir, text_key=args.text_key, workers=args.workers,
                          chunk_bytes=args.chunk_bytes)
    except (ValueError, OSError) as e:
        sys.exit(f"prepare_fineweb.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit("prepare_fineweb.py: interrupted; run the same command again to resume")
    print_summary(summary, output_dir)


if __name__ == "__main__":
    main()
