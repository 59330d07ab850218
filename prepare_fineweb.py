"""FineWeb-Edu to Megatron-Core indexed datasets in one command: download, GPT-2 tokenize, write .bin/.idx.

    python prepare_fineweb.py --workers 32                      # HuggingFaceFW/fineweb-edu, sample/10BT
    python prepare_fineweb.py --dataset fineweb --sample 100BT  # HuggingFaceFW/fineweb, sample/100BT
    python prepare_fineweb.py --input 'corpus/*.jsonl.gz' --output-dir data/corpus
    python prepare_fineweb.py --input data/tinyshakespeare.txt --output-dir data/shakespeare

Every document becomes tiktoken's GPT-2 `encode_ordinary(text)` followed by EOT 50256, uint16, in input order. The
first whole documents holding --val-tokens tokens go to val_text_document (EOT followed by its tokens is llm.c's val
shard), the others of input file i (sorted) to processed_data_{i}_text_document. The hub's parquet files are fetched
through huggingface_hub into the hub cache --data-dir (resumable; HF_HUB_OFFLINE=1 works); --input takes .parquet,
.jsonl(.gz) or .txt files (a document per run of non-blank lines) instead. summary.json records each output with a
fingerprint of its inputs and options: a rerun keeps what still matches, so an interrupted run resumes to the bytes of
a clean one. README.md ("Data") tells the rest.
"""
import argparse
import collections
import functools
import glob
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
import zlib

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from atomic_io import atomic_save, atomic_write
from indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tokenizer import EOT_ID, SHA256, gpt2_encoding

DATASETS = {"fineweb-edu": "HuggingFaceFW/fineweb-edu", "fineweb": "HuggingFaceFW/fineweb"}
SAMPLE_TOKENS = {"10BT": 10e9, "100BT": 100e9, "350BT": 350e9}  # named by their size in GPT-2 tokens
# 2 bytes per uint16 token in the .bin, plus 20 per document in the .idx (int32 length, int64 pointer, int64
# boundary) at the ~670 tokens per document of FineWeb's sample-10BT
OUTPUT_BYTES_PER_TOKEN = 2 + 20 / 670
HUB_VAL_TOKENS = 100_000_000  # llm.c's and build-nanogpt's val shard: the first 100M tokens
INPUT_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".txt")
# Text per worker task: big enough that pickling is noise next to tokenizing (~0.2 s of work), small enough that every
# worker has work until the end and the in-flight tasks (2 per worker) use little memory.
CHUNK_BYTES = 1 << 20
# A parquet row group of up to this many chunks of text is one task, read by the worker; a bigger one (pandas writes
# 1M rows per group) is read here in record batches, so that no task holds more than a chunk.
ROW_GROUP_TASK_CHUNKS = 16
BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
SUMMARY_NAME, VAL_NAME = "summary.json", "val_text_document"
OUTPUT_FILE = re.compile(r"(processed_data_\d+|val)_text_document\.(bin|idx)")
TEMPORARY_FILE = re.compile(r"\.((processed_data_\d+|val)_text_document\.(bin|idx)|summary\.json)\.\d+\.tmp")
EOT_ARRAY = np.array([EOT_ID], dtype=np.uint32)
FORMAT = 2  # bump when a change here changes the bytes written, so that outputs of the old code are redone


def output_prefix(output_dir, index):
    return os.path.join(output_dir, f"processed_data_{index}_text_document")


# ----------------------------------------------------------------------------------------------------------------
# inputs


def download(dataset="fineweb-edu", sample="10BT", data_dir="fineweb_edu"):
    """The parquet files of `sample/{sample}` of the dataset, fetched into the hub cache `data_dir`; sorted paths."""
    repo_id, pattern = DATASETS[dataset], f"sample/{sample}/*.parquet"
    try:
        snapshot = huggingface_hub.snapshot_download(repo_id, repo_type="dataset", allow_patterns=pattern,
                                                     cache_dir=data_dir)
    except FileNotFoundError as e:  # huggingface_hub's LocalEntryNotFoundError: offline and not (fully) cached
        raise FileNotFoundError(f"{data_dir}: no complete copy of {repo_id} {pattern} in this hub cache, and the hub "
                                f"cannot be reached ({e})") from e
    files = sorted(glob.glob(os.path.join(snapshot, "sample", sample, "*.parquet")))
    if not files:
        raise FileNotFoundError(f"{snapshot}: no files match {pattern}")
    return files


def hub_sizes(repo_id, sample):
    """{path in the repository: bytes} of the sample's parquet files, or None when the hub cannot be asked."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None
    try:
        entries = list(huggingface_hub.HfApi().list_repo_tree(repo_id, f"sample/{sample}", repo_type="dataset"))
    except huggingface_hub.errors.EntryNotFoundError as e:
        raise FileNotFoundError(f"{repo_id} has no sample/{sample} on the hub ({e})") from e
    except Exception as e:  # no network: the download will say so, or find everything cached
        print(f"could not list {repo_id} sample/{sample} on the hub ({e}); checking the space for the outputs only")
        return None
    return {entry.path: entry.size for entry in entries if entry.path.endswith(".parquet")}


def check_disk_space(dataset, sample, data_dir, output_dir):
    """Fail before the download if the parquet files not yet cached plus the outputs not yet written do not fit."""
    repo_id = DATASETS[dataset]
    fetch = sum(size for name, size in (hub_sizes(repo_id, sample) or {}).items() if not isinstance(
        huggingface_hub.try_to_load_from_cache(repo_id, name, cache_dir=data_dir, repo_type="dataset"), str))
    written = sum(os.path.getsize(os.path.join(output_dir, name)) for name in
                  (os.listdir(output_dir) if os.path.isdir(output_dir) else ()) if OUTPUT_FILE.fullmatch(name))
    needs = {data_dir: fetch, output_dir: max(SAMPLE_TOKENS[sample] * OUTPUT_BYTES_PER_TOKEN - written, 0)}
    print(f"{repo_id} sample/{sample}: {fetch / 1e9:,.1f} GB of parquet to download into {data_dir}, about "
          f"{needs[output_dir] / 1e9:,.1f} GB of outputs to write in {output_dir}")
    need, free = collections.Counter(), {}  # by filesystem: directories on one add up
    for directory, size in needs.items():
        path = os.path.abspath(directory)
        while not os.path.isdir(path):  # the nearest folder that exists, where a new one will be made
            path = os.path.dirname(path)
        need[os.stat(path).st_dev] += size
        free.setdefault(os.stat(path).st_dev, (directory, shutil.disk_usage(path).free))
    for device, (directory, space) in free.items():
        if need[device] > space:
            raise OSError(f"{directory}: needs about {need[device] / 1e9:,.1f} GB (download and outputs on its "
                          f"filesystem) but only {space / 1e9:,.1f} GB is free there; make room, choose another "
                          f"--data-dir/--output-dir, or pass --skip-space-check")


def find_inputs(pattern):
    """The files matching `pattern` (a path or a glob, ** allowed), sorted: their order numbers the outputs."""
    files = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
    if not files:
        raise FileNotFoundError(f"--input {pattern!r} matches no file")
    return files


def check_input(path, text_key):
    """Fail before any work starts, naming the file, if `path` cannot be read at all."""
    if not path.endswith(INPUT_SUFFIXES):
        raise ValueError(f"{path}: unsupported input type; expected one of {', '.join(INPUT_SUFFIXES)}")
    (open_parquet(path, text_key) if path.endswith(".parquet") else open(path, "rb")).close()


def open_parquet(path, text_key):
    try:  # with pre_buffer, iter_batches fetches every row group's column chunk ahead: the whole file in memory
        parquet = pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({e})") from e
    schema = parquet.schema_arrow
    if text_key not in schema.names:
        parquet.close()
        raise ValueError(f"{path}: no column {text_key!r} (columns: {', '.join(schema.names)}); choose one with "
                         f"--text-key")
    kind = schema.field(text_key).type
    if kind not in (pa.string(), pa.large_string(), pa.binary(), pa.large_binary()):
        parquet.close()
        raise ValueError(f"{path}: column {text_key!r} holds {kind}, not text")
    return parquet


def as_bytes(column):
    """Texts as bytes: they reach the tokenizer undecoded, so invalid UTF-8 is replaced (and counted) there."""
    return column.cast(pa.large_binary()).to_pylist()


def read_tasks(path, text_key, chunk_bytes):
    """Yield (kind, payload, number of its first line, byte position reached) for the tasks of one input file."""
    if path.endswith(".parquet"):
        yield from parquet_tasks(path, text_key, chunk_bytes)
        return
    kind = "txt" if path.endswith(".txt") else "jsonl"
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
            # cut after the last whole line, or for text after the last blank line: documents stay whole in one task
            if kind == "jsonl":
                end = block.rfind(b"\n") + 1
            else:
                end = max((match.end() for match in BLANK_LINE.finditer(block)), default=0)
            if end:
                yield kind, block[:end], first_line, raw.tell()
                first_line += block.count(b"\n", 0, end)
            rest = block[end:]
        yield kind, rest, first_line, raw.tell()


def parquet_tasks(path, text_key, chunk_bytes):
    """Tasks of ("row_groups", numbers of row groups holding about chunk_bytes of text, read by the worker), or for a
    row group over ROW_GROUP_TASK_CHUNKS chunks, ("texts", a record batch of about chunk_bytes read here)."""
    parquet = open_parquet(path, text_key)
    metadata, size = parquet.metadata, os.path.getsize(path)
    leaf = next(i for i in range(metadata.num_columns) if metadata.schema.column(i).path == text_key)
    groups, group_bytes, rows, total_rows = [], 0, 0, max(metadata.num_rows, 1)  # progress: the share of rows read
    try:
        for group in range(metadata.num_row_groups):
            group_rows = metadata.row_group(group).num_rows
            text_bytes = metadata.row_group(group).column(leaf).total_uncompressed_size
            big = text_bytes > ROW_GROUP_TASK_CHUNKS * chunk_bytes
            if groups and (big or group_bytes >= chunk_bytes):
                yield "row_groups", groups, 0, size * rows // total_rows
                groups, group_bytes = [], 0
            if big:
                batch_rows = max(1, group_rows * chunk_bytes // text_bytes)
                for batch in parquet.iter_batches(batch_rows, row_groups=[group], columns=[text_key]):
                    rows += batch.num_rows
                    yield "texts", as_bytes(batch.column(0)), 0, size * rows // total_rows
            else:
                groups.append(group)
                group_bytes += text_bytes
                rows += group_rows
    except pa.ArrowException as e:
        raise ValueError(f"{path}: unreadable parquet data ({e})") from e
    finally:
        parquet.close()
    if groups:
        yield "row_groups", groups, 0, size


# ----------------------------------------------------------------------------------------------------------------
# tokenizing, in the worker processes


@functools.lru_cache(maxsize=1)
def parquet_file(path):
    return pq.ParquetFile(path, pre_buffer=False)  # a worker keeps the file it is reading open


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


def json_text(line, where, text_key):
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object")
    if text_key not in record:
        raise ValueError(f"{where}: no key {text_key!r} (keys: {', '.join(record)}); choose one with --text-key")
    text = record[text_key]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: the {text_key!r} value is {type(text).__name__}, not a string")
    return text


def decode(raw):
    """(text, whether raw was invalid UTF-8): invalid bytes become U+FFFD instead of stopping the run."""
    try:
        return raw.decode(), False
    except UnicodeDecodeError:
        return raw.decode(errors="replace"), True


def task_texts(path, kind, text_key, first_line, payload):
    """Yield (text or None, whether it was invalid UTF-8) for every document of one task, in order."""
    if kind == "jsonl":
        for number, line in enumerate(payload.split(b"\n"), first_line):
            if line.strip():  # blank lines between records are not records
                line, invalid = decode(line)
                yield json_text(line, f"{path}, line {number}", text_key), invalid
        return
    if kind == "row_groups":
        try:
            payload = as_bytes(parquet_file(path).read_row_groups(payload, columns=[text_key]).column(0))
        except pa.ArrowException as e:
            raise ValueError(f"{path}: unreadable parquet data in row groups {payload[0]}-{payload[-1]} ({e})") from e
    elif kind == "txt":
        payload = text_documents(payload)
    for raw in payload:
        yield decode(raw) if raw is not None else (None, False)


def encode_task(task):
    """Tokenize one task: (uint16 tokens with EOT after each document, int64 document lengths, counts)."""
    encoding, pieces, lengths = gpt2_encoding(), [], []
    counts = collections.Counter(empty_skipped=0, invalid_utf8=0)
    for text, invalid in task_texts(*task):
        if not text:
            counts["empty_skipped"] += 1
            continue
        # encode_to_numpy with no special token allowed or disallowed is encode_ordinary without a Python list
        try:
            tokens = encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (a JSON "\ud800"): replaced, as encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            tokens, invalid = encoding.encode_to_numpy(text, disallowed_special=()), True
        counts["invalid_utf8"] += invalid
        pieces += (tokens, EOT_ARRAY)
        lengths.append(len(tokens) + 1)
    tokens = np.concatenate(pieces).astype(np.uint16) if pieces else np.empty(0, np.uint16)
    return tokens, np.array(lengths, dtype=np.int64), counts


def document_stream(pool, inputs, todo, text_key, chunk_bytes, workers, counts, bar):
    """Yield (index, tokens) for every document of the inputs numbered `todo`, in order, and (index, None) at the end
    of each; counts[index] gathers its skipped and replaced texts. Pool.imap would keep the order too, but it reads all
    its tasks ahead (a 100 GB input in RAM): here at most two tasks per worker are in flight."""
    def tasks():  # (index, position reached, task or None at the end of the input), and a final None
        for index in todo:
            for kind, payload, first_line, position in read_tasks(inputs[index], text_key, chunk_bytes):
                yield index, position, (inputs[index], kind, text_key, first_line, payload)
            yield index, os.path.getsize(inputs[index]), None
        yield None

    pending, documents, tokens, file_position = collections.deque(), 0, 0, 0
    for item in tasks():
        if item:
            index, position, task = item
            pending.append((index, position, task and pool.apply_async(encode_task, (task,))))
        while len(pending) > 2 * workers or (pending and item is None):
            index, position, result = pending.popleft()
            bar.update(position - file_position)
            file_position = position if result else 0
            if not result:
                yield index, None
                continue
            task_tokens, lengths, task_counts = result.get()
            counts[index].update(task_counts)
            documents, tokens = documents + len(lengths), tokens + len(task_tokens)
            elapsed = max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix_str(f"{documents / elapsed:,.0f} docs/s, {tokens / elapsed / 1e6:,.2f}M tokens/s",
                                refresh=False)
            yield from ((index, document) for document in np.split(task_tokens, np.cumsum(lengths)[:-1])
                        if len(document))


def val_documents(stream, val_tokens, ended):
    """The first documents of `stream`, until they hold val_tokens tokens; `ended` lists the inputs that end on the way
    (every document of those went to val)."""
    tokens = 0
    for index, document in stream:
        if document is None:
            ended.append(index)
            continue
        yield document
        tokens += len(document)
        if tokens >= val_tokens:
            return


def file_documents(stream):
    """The documents of `stream` up to the end of the input they are from."""
    for _, document in stream:
        if document is None:
            return
        yield document


# ----------------------------------------------------------------------------------------------------------------
# outputs


def input_fingerprint(path):
    """Size, mtime and a hash of the first and last MiB of the file at `path`: hashing whole files would reread up to a
    terabyte on every rerun; the ends catch a different file copied with its mtime kept (a parquet footer holds the
    offsets and statistics of every row group)."""
    stat, digest = os.stat(path), hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(stat.st_size - (1 << 20), 0))
        digest.update(f.read(1 << 20))
    return f"{stat.st_size}:{stat.st_mtime_ns}:{digest.hexdigest()}"


def output_fingerprints(inputs, options):
    """A hash per output of what makes it: the options and its input, or, with a val split, inputs 0 to its own (how
    many of an input's documents go to val depends on the token counts of those before it)."""
    start = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    digest, fingerprints = start.copy(), []
    for path in inputs:
        digest = digest if options["val_tokens"] else start.copy()
        digest.update(input_fingerprint(path).encode())
        fingerprints.append(digest.hexdigest())
    return fingerprints


def is_finished(prefix, entry):
    """Whether the dataset at `prefix` is the complete one that summary.json's `entry` describes."""
    if entry.get("output", prefix) is None:  # no output: every document of the input went to val
        return entry.get("documents") == 0
    try:
        dataset = IndexedDataset(prefix)  # checks the index, and that the .bin holds exactly its tokens
        return (dataset.dtype == np.uint16 and dataset.num_documents == len(dataset) == entry["documents"]
                and dataset.num_tokens == entry["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def kept_outputs(output_dir, fingerprints, val_tokens):
    """(val entry or None, {index: entry}): what an earlier run's summary.json lists that still holds. The val dataset
    is kept only with the outputs of every input it draws from; when it is redone, so is every output, as their
    documents start where it ends."""
    try:  # a missing or damaged summary.json keeps nothing
        with open(os.path.join(output_dir, SUMMARY_NAME)) as f:
            earlier = json.load(f)
        files = {entry["index"]: dict(entry, kept=True) for entry in earlier["files"]
                 if entry["index"] < len(fingerprints) and entry["fingerprint"] == fingerprints[entry["index"]]
                 and is_finished(output_prefix(output_dir, entry["index"]), entry)}
        if not val_tokens:
            return None, files
        val, last = earlier["val"], earlier["val"]["last_input"]
        if (val["fingerprint"] == fingerprints[last] and all(index in files for index in range(last + 1))
                and is_finished(os.path.join(output_dir, VAL_NAME), val)):
            return dict(val, kept=True), files
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    return None, {}


def write_output(prefix, documents):
    """Write the token arrays `documents` as prefix.bin/.idx, each file published whole; its summary entry. No prefix:
    no output (every document of the input went to val, and megatron-core cannot map an empty .bin)."""
    entry = dict(output=prefix, documents=0, tokens=0)

    def save_bin(path):
        builder = IndexedDatasetBuilder(path, dtype=np.uint16)
        for document in documents:
            builder.add_document(document)
            entry["documents"] += 1
            entry["tokens"] += len(document)
        atomic_save(prefix + ".idx", builder.finalize)  # finalize closes the .bin, which atomic_save then publishes
    if prefix:
        for suffix in (".idx", ".bin"):  # the old pair goes first, so no half of it can pass for part of the new one
            if os.path.exists(prefix + suffix):
                os.remove(prefix + suffix)
        atomic_save(prefix + ".bin", save_bin)
    return dict(entry, output_bytes=2 * entry["tokens"], kept=False)


def prepare(inputs, output_dir, *, text_key="text", workers=1, chunk_bytes=CHUNK_BYTES, val_tokens=0):
    """Tokenize the files `inputs` into output_dir (see the module's docstring), keeping the outputs that an earlier run
    finished from the same inputs and options; prints and returns the summary."""
    start = time.time()
    if not hasattr(gpt2_encoding(), "encode_to_numpy"):  # also fails here if the BPE files are missing or corrupt
        raise RuntimeError("prepare_fineweb.py needs tiktoken >= 0.9 (for Encoding.encode_to_numpy): "
                           "pip install -U tiktoken")
    if not inputs:
        raise FileNotFoundError(f"{output_dir}: no input files to tokenize")
    os.makedirs(output_dir, exist_ok=True)
    for name in os.listdir(output_dir):  # what a killed run was writing
        if TEMPORARY_FILE.match(name):
            os.remove(os.path.join(output_dir, name))
    options = {"format": FORMAT, "tokenizer": "gpt2 (tiktoken encode_ordinary) + EOT 50256", "bpe_sha256": SHA256,
               "text_key": text_key, "dtype": "uint16", "val_tokens": val_tokens}
    fingerprints = output_fingerprints(inputs, options)
    val, files = kept_outputs(output_dir, fingerprints, val_tokens)
    for index in sorted(files):
        print(f"{output_prefix(output_dir, index)}: finished by an earlier run, kept")
    todo = [index for index in range(len(inputs)) if index not in files]
    for index in todo:
        check_input(inputs[index], text_key)
    counts = {index: collections.Counter(empty_skipped=0, invalid_utf8=0) for index in todo}

    def save(finished):
        entries = [files[index] for index in sorted(files)]
        outputs, seconds = entries + ([val] if val else []), time.time() - start
        summary = {key: sum(entry.get(key, 0) for entry in outputs)
                   for key in ("documents", "tokens", "empty_skipped", "invalid_utf8", "input_bytes", "output_bytes")}
        tokenized = sum(entry["tokens"] for entry in outputs if not entry["kept"])
        summary.update(finished=finished, seconds=round(seconds, 3), workers=workers,
                       tokens_per_second=round(tokenized / max(seconds, 1e-9)), options=options, val=val, files=entries)
        with atomic_write(os.path.join(output_dir, SUMMARY_NAME), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    def finish(index, documents):  # documents None: all of them went to val
        prefix = output_prefix(output_dir, index) if documents is not None else None
        written = write_output(prefix, documents)
        files[index] = dict(index=index, input=inputs[index], input_name=os.path.basename(inputs[index]),
                            fingerprint=fingerprints[index], **written, **counts[index],
                            input_bytes=os.path.getsize(inputs[index]))
        save(finished=False)
        tqdm.write(f"{prefix or inputs[index]}: {written['documents']:,} documents, {written['tokens']:,} tokens")

    # the workers ignore Ctrl-C: it is the parent's to handle, by terminating the pool
    with multiprocessing.Pool(workers, signal.signal, (signal.SIGINT, signal.SIG_IGN)) as pool, tqdm(
            total=sum(os.path.getsize(inputs[index]) for index in todo), unit="B", unit_scale=True,
            desc=f"tokenizing {len(todo)} files", mininterval=1, dynamic_ncols=True, disable=not todo) as bar:
        stream = document_stream(pool, inputs, todo, text_key, chunk_bytes, workers, counts, bar)
        if val_tokens and val is None:  # then todo is every input, and the stream starts with input 0
            ended, val_prefix = [], os.path.join(output_dir, VAL_NAME)
            val = write_output(val_prefix, val_documents(stream, val_tokens, ended))
            last = min(len(ended), len(inputs) - 1)  # the input of the last val document
            val.update(last_input=last, fingerprint=fingerprints[last])
            tqdm.write(f"{val_prefix}: {val['documents']:,} documents, {val['tokens']:,} tokens, from inputs 0 to "
                       f"{last}")
            for index in ended:
                finish(index, None)
        for index in todo:
            if index not in files:
                finish(index, file_documents(stream))
    summary = save(finished=True)
    made = {f"processed_data_{index}" for index, entry in files.items() if entry["output"]}
    made |= {"val"} if val else set()
    for name in sorted(os.listdir(output_dir)):
        match = OUTPUT_FILE.fullmatch(name)
        if match and match[1] not in made:
            os.remove(os.path.join(output_dir, name))
            print(f"{os.path.join(output_dir, name)}: made from an input that is no longer given, removed")
    kept = sum(entry["kept"] for entry in summary["files"])
    print(f"{output_dir}: {len(made)} outputs ({kept} kept from an earlier run), {summary['documents']:,} documents, "
          f"{summary['tokens']:,} tokens, {summary['seconds']:,.1f} s ({summary['tokens_per_second'] / 1e6:,.2f}M "
          f"tokens/s); {summary['empty_skipped']:,} empty or null texts skipped, {summary['invalid_utf8']:,} with "
          f"invalid UTF-8 replaced")
    return summary


def main(argv=None):
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
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
    val_tokens = args.val_tokens if args.val_tokens is not None else 0 if args.input else HUB_VAL_TOKENS
    try:
        if args.input:
            inputs = find_inputs(args.input)
        else:
            if not args.skip_space_check:
                check_disk_space(args.dataset, args.sample, args.data_dir, output_dir)
            inputs = download(args.dataset, args.sample, args.data_dir)
        prepare(inputs, output_dir, text_key=args.text_key, workers=args.workers, chunk_bytes=args.chunk_bytes,
                val_tokens=val_tokens)
    except (ValueError, OSError) as e:
        sys.exit(f"prepare_fineweb.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit("prepare_fineweb.py: interrupted; run the same command again to resume")


if __name__ == "__main__":
    main()
