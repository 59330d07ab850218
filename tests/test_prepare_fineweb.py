"""prepare_fineweb.py end to end, offline: a parquet fixture laid out as the hub's dataset cache, JSONL and text inputs,
every document equal to tiktoken's gpt2 `encode_ordinary(text) + [50256]` in input order, outputs read by
megatron-core's IndexedDataset and by indexed_dataset.py, the same bytes for any number of workers, a kill -9 mid-run
resumed to the bytes of a clean run, and bad inputs named in clear errors."""
import glob
import gzip
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
import indexed_dataset
import prepare_fineweb
import tokenizer

EOT = 50256
COMMIT = "0123456789abcdef0123456789abcdef01234567"
with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
    SHAKESPEARE = f.read()
SPECIAL_TEXTS = ["Hello world", " <|endoftext|> is ordinary text here <|endoftext|>",
                 "naïve café 東京 🙂\n\n\t  x", " ", "\n", "x" * 20_000]


@pytest.fixture(scope="module")
def tiktoken_gpt2(tmp_path_factory):
    """tiktoken's own get_encoding("gpt2"), offline: its download cache seeded with the shipped BPE files."""
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    shutil.copy(os.path.join(tokenizer.BPE_DIR, "vocab.bpe"), cache / "6d1cbeee0f20b3d9449abfede4726ed8212e3aee")
    shutil.copy(os.path.join(tokenizer.BPE_DIR, "encoder.json"), cache / "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        import tiktoken
        return tiktoken.get_encoding("gpt2")


def shakespeare_documents(n, seed, max_chars=3000):
    rng = random.Random(seed)
    starts = [rng.randrange(len(SHAKESPEARE) - max_chars) for _ in range(n)]
    return [SHAKESPEARE[s:s + rng.randint(1, max_chars)] for s in starts]


def write_parquet(path, texts, column="text", kind=None, row_group_size=40):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), column: pa.array(texts, kind or pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size)


def hub_cache(root, files):
    """A hub cache holding HuggingFaceFW/fineweb-edu at COMMIT, `files` = {path in the repository: (texts, rows per
    row group)}."""
    repo = os.path.join(root, "datasets--HuggingFaceFW--fineweb-edu")
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for name, (texts, row_group_size) in files.items():
        write_parquet(os.path.join(repo, "snapshots", COMMIT, name), texts, row_group_size=row_group_size)
    return root


def read_megatron(prefix):
    """Every document of the dataset at `prefix` as a token list, read by megatron-core's IndexedDataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    assert dataset.index.dtype == np.uint16
    # one sequence per document
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(dataset) + 1))
    return [dataset[i].tolist() for i in range(len(dataset))]


def expected_tokens(encoding, texts):
    return [encoding.encode_ordinary(text) + [EOT] for text in texts if text]


def dataset_bytes(output_dir):
    names = sorted(os.listdir(output_dir))
    return {name: open(os.path.join(output_dir, name), "rb").read() for name in names if name != "summary.json"}


def leftovers(output_dir):
    return [name for name in os.listdir(output_dir) if name.startswith(".") or name.endswith(".tmp")]


def run_cli(*args, timeout=180):
    return subprocess.run([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_hub_cache_end_to_end_offline(tmp_path, tiktoken_gpt2):
    first = shakespeare_documents(150, seed=0) + [None] + SPECIAL_TEXTS + [""]
    second = shakespeare_documents(90, seed=1)
    cache = hub_cache(str(tmp_path / "hub"), {
        "sample/10BT/000_00000.parquet": (first, 10),  # small row groups: the workers read them
        "sample/10BT/001_00000.parquet": (second, 1000),  # one row group over 16 chunks: read in record batches
        "sample/100BT/000_00000.parquet": (["another sample, never read"], 10),
    })
    # no --output-dir: the outputs go to {data_dir}/megatron_gpt2
    run = run_cli("--data-dir", cache, "--workers", "2", "--chunk-bytes", "4096", "--val-tokens", "0")
    assert run.returncode == 0, run.stderr
    output_dir = os.path.join(cache, "megatron_gpt2")
    assert sorted(os.listdir(output_dir)) == [
        "processed_data_0_text_document.bin", "processed_data_0_text_document.idx",
        "processed_data_1_text_document.bin", "processed_data_1_text_document.idx", "summary.json"]
    for index, texts in enumerate([first, second]):
        prefix = prepare_fineweb.output_prefix(output_dir, index)
        assert read_megatron(prefix) == expected_tokens(tiktoken_gpt2, texts)
        ours = indexed_dataset.IndexedDataset(prefix)
        assert [ours[i].tolist() for i in range(len(ours))] == expected_tokens(tiktoken_gpt2, texts)

    with open(os.path.join(output_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["finished"] and summary["documents"] == 150 + len(SPECIAL_TEXTS) + 90
    assert summary["empty_skipped"] == 2 and summary["invalid_utf8"] == 0
    assert summary["tokens"] == sum(map(len, expected_tokens(tiktoken_gpt2, first + second)))
    assert summary["output_bytes"] == 2 * summary["tokens"]
    assert [entry["input_name"] for entry in summary["files"]] == ["000_00000.parquet", "001_00000.parquet"]
    assert f"{summary['documents']:,} documents" in run.stdout
    assert "B/s" in run.stderr  # the progress bar

    # one worker and default chunks (every row group read by the worker) give the same bytes as two workers and tiny
    # chunks
    files = sorted(glob.glob(os.path.join(cache, "datasets--*", "snapshots", COMMIT, "sample", "10BT", "*")))
    prepare_fineweb.prepare(files, str(tmp_path / "one_worker"), workers=1)
    assert dataset_bytes(tmp_path / "one_worker") == dataset_bytes(output_dir)


def test_offline_without_the_dataset_is_a_clear_error(tmp_path):
    cache = hub_cache(str(tmp_path / "hub"), {"sample/10BT/000_00000.parquet": (["text"], 10)})
    run = run_cli("--data-dir", cache, "--dataset", "fineweb", "--workers", "1")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert cache in run.stderr and "HuggingFaceFW/fineweb sample/10BT/*.parquet" in run.stderr


def test_jsonl_gzip_and_text_inputs(tmp_path, tiktoken_gpt2):
    records = [{"text": "first record", "id": 1}, {"text": None}, {"text": ""}, {"id": 4, "text": SPECIAL_TEXTS[1]},
               {"text": "a lone \ud800 surrogate"}]  # escaped in JSON, so the line itself is valid UTF-8
    records += [{"text": text} for text in shakespeare_documents(60, seed=2)]
    lines = [json.dumps(record) for record in records]
    with open(tmp_path / "a.jsonl", "w") as f:
        f.write("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")  # a blank line between records
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"content": text}) + "\n" for text in SPECIAL_TEXTS))
    with open(tmp_path / "c.txt", "w") as f:
        f.write("Para one,\nline two.\n\n\n\nPara two  \n \t \nPara three\r\nends here\r\n\r\n<|endoftext|>\n")
    text_documents = ["Para one,\nline two.", "Para two  ", "Para three\r\nends here", "<|endoftext|>"]

    inputs = prepare_fineweb.find_inputs(str(tmp_path / "[ac].*"))
    assert [os.path.basename(path) for path in inputs] == ["a.jsonl", "c.txt"]
    summary = prepare_fineweb.prepare(inputs, str(tmp_path / "out"), workers=2, chunk_bytes=500)
    assert read_megatron(str(tmp_path / "out" / "processed_data_0_text_document")) == expected_tokens(
        tiktoken_gpt2, [record.get("text") for record in records])
    assert read_megatron(str(tmp_path / "out" / "processed_data_1_text_document")) == expected_tokens(
        tiktoken_gpt2, text_documents)
    assert summary["empty_skipped"] == 2 and summary["documents"] == len(records) - 2 + len(text_documents)
    assert summary["invalid_utf8"] == 1  # the surrogate, replaced as encode_ordinary replaces it

    prepare_fineweb.prepare([str(tmp_path / "b.jsonl.gz")], str(tmp_path / "gz"), text_key="content", workers=1)
    assert read_megatron(str(tmp_path / "gz" / "processed_data_0_text_document")) == expected_tokens(
        tiktoken_gpt2, SPECIAL_TEXTS)


def test_demo_shakespeare_command(tmp_path, tiktoken_gpt2):
    output_dir = tmp_path / "shakespeare"
    run = run_cli("--input", os.path.join("data", "tinyshakespeare.txt"), "--output-dir", str(output_dir))
    assert run.returncode == 0, run.stderr
    blocks = [block.strip("\n") for block in re.split(r"\n\s*\n", SHAKESPEARE) if block.strip()]
    assert len(blocks) > 5000
    assert read_megatron(str(output_dir / "processed_data_0_text_document")) == expected_tokens(tiktoken_gpt2, blocks)
    assert not leftovers(output_dir)


def test_parquet_row_groups_of_any_size(tmp_path, tiktoken_gpt2):
    # small row groups go to the workers whole, a big one (over 16 chunks) is read in record batches here: in order
    groups = [shakespeare_documents(n, seed=n, max_chars=chars) + [None]
              for n, chars in ((2, 300), (3, 300), (300, 3000), (1, 300), (2, 300))]
    path = str(tmp_path / "mixed.parquet")
    with pq.ParquetWriter(path, pa.schema([("text", pa.large_string())])) as writer:
        for texts in groups:
            writer.write_table(pa.table({"text": pa.array(texts, pa.large_string())}))
    assert pq.ParquetFile(path).metadata.num_row_groups == len(groups)
    summary = prepare_fineweb.prepare([path], str(tmp_path / "out"), workers=2, chunk_bytes=4096)
    texts = [text for texts in groups for text in texts]
    assert read_megatron(str(tmp_path / "out" / "processed_data_0_text_document")) == expected_tokens(
        tiktoken_gpt2, texts)
    assert summary["empty_skipped"] == len(groups)


@pytest.mark.parametrize("chunk_bytes", [1, 50, 4096])
def test_text_documents_do_not_depend_on_chunks(tmp_path, tiktoken_gpt2, chunk_bytes):
    rng = random.Random(chunk_bytes)
    blocks = [block for block in re.split(r"\n\s*\n", SHAKESPEARE[:30_000]) if block.strip()]
    separators = ["\n\n", "\n\n\n\n", "\n \t\n", "\r\n\r\n", "\n\r\n  \n\n"]
    text = "".join(block + rng.choice(separators) for block in blocks) + "last document, no final newline"
    with open(tmp_path / "t.txt", "w", newline="") as f:
        f.write(text)
    documents = [block.rstrip("\r\n") for block in re.split(r"\n(?:[ \t\r]*\n)+", text) if block.strip()]
    assert len(documents) == len(blocks) + 1
    prepare_fineweb.prepare([str(tmp_path / "t.txt")], str(tmp_path / "out"), workers=2, chunk_bytes=chunk_bytes)
    assert read_megatron(str(tmp_path / "out" / "processed_data_0_text_document")) == expected_tokens(
        tiktoken_gpt2, documents)


def test_invalid_utf8_is_replaced_and_counted(tmp_path, tiktoken_gpt2):
    bad = b"caf\xe9 \xff\xfe ok"  # Latin-1 bytes: invalid UTF-8
    with open(tmp_path / "a.txt", "wb") as f:
        f.write(b"good line\n\n" + bad + b"\n\nmore good\n")
    with open(tmp_path / "b.jsonl", "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "' + bad + b'"}\n')
    write_parquet(str(tmp_path / "c.parquet"), [b"fine", bad, None], kind=pa.binary())
    summary = prepare_fineweb.prepare(prepare_fineweb.find_inputs(str(tmp_path / "*")), str(tmp_path / "out"),
                                      workers=1)
    replaced = bad.decode("utf-8", errors="replace")
    assert "\ufffd" in replaced
    expected = [["good line", replaced, "more good"], ["fine", replaced], ["fine", replaced]]
    for index, texts in enumerate(expected):
        prefix = prepare_fineweb.output_prefix(str(tmp_path / "out"), index)
        assert read_megatron(prefix) == expected_tokens(tiktoken_gpt2, texts)
    assert [entry["invalid_utf8"] for entry in summary["files"]] == [1, 1, 1]
    assert summary["invalid_utf8"] == 3 and summary["empty_skipped"] == 1


BAD_INPUTS = [
    ("missing_column.parquet", None, r"missing_column\.parquet: no column 'text'"),
    ("numbers.parquet", None, r"numbers\.parquet: column 'text' holds int64, not text"),
    ("garbage.parquet", b"this is not parquet", r"garbage\.parquet: not a readable parquet file"),
    ("no_key.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n{"body": "x"}\n', r"no_key\.jsonl, line 3: no key 'text'"),
    ("not_json.jsonl", b'{"text": "ok"}\n{"text": oops}\n', r"not_json\.jsonl, line 2: not valid JSON"),
    ("number.jsonl", b'{"text": 7}\n', r"number\.jsonl, line 1: the 'text' value"),
    ("broken.jsonl.gz", gzip.compress(b'{"text": "ok"}\n' * 1000)[:-40], r"broken\.jsonl\.gz: unreadable"),
    ("table.csv", b"text\nhello\n", r"table\.csv: unsupported input type"),
]


@pytest.mark.parametrize("name, content, message", [pytest.param(*case, id=case[0]) for case in BAD_INPUTS])
def test_bad_input_names_the_file(tmp_path, name, content, message):
    path = str(tmp_path / "in" / name)
    os.makedirs(os.path.dirname(path))
    if name == "missing_column.parquet":
        write_parquet(path, ["a"], column="body")
    elif name == "numbers.parquet":
        pq.write_table(pa.table({"text": pa.array([1, 2], pa.int64())}), path)
    else:
        with open(path, "wb") as f:
            f.write(content)
    good = str(tmp_path / "in" / "0_good.txt")
    with open(good, "w") as f:
        f.write("a good file comes first\n")
    with pytest.raises(ValueError, match=message):  # tiny chunks: line numbers are counted across chunks
        prepare_fineweb.prepare(prepare_fineweb.find_inputs(str(tmp_path / "in" / "*")), str(tmp_path / "out"),
                                workers=2, chunk_bytes=16)
    # nothing half-written is left, under its final name or a temporary one
    if os.path.isdir(tmp_path / "out"):
        assert not [name for name in os.listdir(tmp_path / "out") if "processed_data_1" in name]
        assert not leftovers(tmp_path / "out")


def test_cli_errors_are_one_clear_line(tmp_path):
    run = run_cli("--input", str(tmp_path / "nothing_*.parquet"), "--output-dir", str(tmp_path / "out"))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "nothing_*.parquet' matches no file" in run.stderr
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write('{"text": "ok"}\n{"txt": "typo"}\n')
    run = run_cli("--input", str(tmp_path / "bad.jsonl"), "--output-dir", str(tmp_path / "out"), "--workers", "1")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "bad.jsonl, line 2: no key 'text'" in run.stderr


def test_rerun_keeps_finished_outputs_and_redoes_broken_ones(tmp_path):
    inputs = []
    for index in range(3):
        inputs.append(str(tmp_path / f"{index}.parquet"))
        write_parquet(inputs[-1], shakespeare_documents(30, seed=10 + index))
    output_dir = str(tmp_path / "out")
    prepare_fineweb.prepare(inputs, output_dir, workers=2)
    clean = dataset_bytes(output_dir)
    first_idx = os.path.join(output_dir, "processed_data_0_text_document.idx")
    mtime = os.stat(first_idx).st_mtime_ns

    with open(os.path.join(output_dir, "processed_data_1_text_document.bin"), "r+b") as f:
        f.truncate(100)  # a damaged output
    summary = prepare_fineweb.prepare(inputs, output_dir, workers=2)
    assert [entry["kept"] for entry in summary["files"]] == [True, False, True]
    assert os.stat(first_idx).st_mtime_ns == mtime
    assert dataset_bytes(output_dir) == clean

    write_parquet(inputs[2], shakespeare_documents(31, seed=99))  # a changed input is redone
    summary = prepare_fineweb.prepare(inputs, output_dir, workers=2)
    assert [entry["kept"] for entry in summary["files"]] == [True, True, False]
    assert summary["files"][2]["documents"] == 31


@pytest.mark.slow
def test_kill_mid_run_then_rerun_gives_the_clean_bytes(tmp_path):
    inputs = []
    for index in range(3):
        inputs.append(str(tmp_path / "in" / f"{index:03d}.parquet"))
        write_parquet(inputs[-1], shakespeare_documents(1200, seed=20 + index), row_group_size=200)
    clean_dir, output_dir = str(tmp_path / "clean"), str(tmp_path / "out")
    prepare_fineweb.prepare(inputs, clean_dir, workers=2)

    args = [sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), "--input", str(tmp_path / "in" / "*.parquet"),
            "--output-dir", output_dir, "--workers", "1", "--chunk-bytes", "20000"]
    process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    in_progress = os.path.join(output_dir, ".processed_data_1_text_document.bin.*.tmp")  # atomic_io's temporary
    try:
        deadline = time.time() + 120
        while not glob.glob(in_progress) and process.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        assert process.poll() is None, "the run ended before it could be interrupted"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        try:  # the orphaned pool worker, in the session started above
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    names = os.listdir(output_dir)
    assert "processed_data_0_text_document.idx" in names and "processed_data_2_text_document.idx" not in names
    assert leftovers(output_dir)

    run = run_cli("--input", str(tmp_path / "in" / "*.parquet"), "--output-dir", output_dir, "--workers", "2")
    assert run.returncode == 0, run.stderr
    assert "processed_data_0_text_document: finished by an earlier run, kept" in run.stdout
    assert dataset_bytes(output_dir) == dataset_bytes(clean_dir)
    assert not leftovers(output_dir)


def fineweb_parquets(directory, rows_per_file, seed=0):
    """Parquet files shaped like the hub's FineWeb samples (text, id, dump, url, token_count columns); their texts."""
    files, texts = [], []
    for index, rows in enumerate(rows_per_file):
        file_texts = shakespeare_documents(rows, seed=seed + index, max_chars=1200)
        table = pa.table({"text": file_texts, "id": [f"<urn:uuid:{index}-{i}>" for i in range(rows)],
                          "dump": ["CC-MAIN-2024-10"] * rows, "url": [f"https://example.org/{i}" for i in range(rows)],
                          "token_count": pa.array([len(text) // 4 for text in file_texts], pa.int64())})
        files.append(str(directory / f"{index:03d}_00000.parquet"))
        os.makedirs(directory, exist_ok=True)
        pq.write_table(table, files[-1], row_group_size=100)
        texts.append(file_texts)
    return files, texts


def output_documents(output_dir, name):
    path = os.path.join(output_dir, name)
    return read_megatron(path) if os.path.exists(path + ".idx") else []


@pytest.mark.slow
def test_val_tokens_are_llmc_val_shard(tmp_path, tiktoken_gpt2):
    files, texts = fineweb_parquets(tmp_path / "hub", [500, 900, 800, 700])
    documents = [tiktoken_gpt2.encode_ordinary(text) + [EOT] for file_texts in texts for text in file_texts]
    # llm.c dev/data/fineweb.py (and build-nanogpt): every row as [EOT] + encode_ordinary(text), in order
    llmc = [token for file_texts in texts for text in file_texts for token in [EOT] + tiktoken_gpt2.encode_ordinary(text)]
    val_tokens = sum(map(len, documents[:500])) + 1000  # all of input 0 and the start of input 1
    output_dir = str(tmp_path / "out")
    summary = prepare_fineweb.prepare(files, output_dir, workers=2, chunk_bytes=20_000, val_tokens=val_tokens)

    val = read_megatron(os.path.join(output_dir, "val_text_document"))
    stream = [EOT] + [token for document in val for token in document]
    assert len(stream) > val_tokens and stream[:val_tokens] == llmc[:val_tokens]
    cut = len(val)  # whole documents, the fewest that hold val_tokens
    assert val == documents[:cut] and sum(map(len, val[:-1])) < val_tokens <= sum(map(len, val))
    assert 500 < cut < 1400
    # the train outputs hold every other document, none twice; input 0 went wholly to val, so it has no output
    assert not os.path.exists(os.path.join(output_dir, "processed_data_0_text_document.bin"))
    trains = [output_documents(output_dir, f"processed_data_{i}_text_document") for i in range(4)]
    assert trains[0] == [] and trains[1] == documents[cut:1400] and trains[2] + trains[3] == documents[1400:]
    assert summary["val"]["documents"] == cut and summary["val"]["last_input"] == 1
    assert summary["documents"] == len(documents) and summary["tokens"] == sum(map(len, documents))

    # one worker and default chunks: the same bytes; a rerun keeps everything
    prepare_fineweb.prepare(files, str(tmp_path / "one"), workers=1, val_tokens=val_tokens)
    assert dataset_bytes(tmp_path / "one") == dataset_bytes(output_dir)
    summary = prepare_fineweb.prepare(files, output_dir, workers=2, val_tokens=val_tokens)
    assert summary["val"]["kept"] and all(entry["kept"] for entry in summary["files"])

    # a damaged output after the val split is redone alone, to the same bytes
    clean = dataset_bytes(output_dir)
    with open(os.path.join(output_dir, "processed_data_3_text_document.bin"), "r+b") as f:
        f.truncate(10)
    summary = prepare_fineweb.prepare(files, output_dir, workers=2, val_tokens=val_tokens)
    assert summary["val"]["kept"] and [entry["kept"] for entry in summary["files"]] == [True, True, True, False]
    assert dataset_bytes(output_dir) == clean

    # another --val-tokens redoes every output; without one the val dataset is removed as stale
    summary = prepare_fineweb.prepare(files, output_dir, workers=2, val_tokens=1000)
    assert not summary["val"]["kept"] and not any(entry["kept"] for entry in summary["files"])
    val = read_megatron(os.path.join(output_dir, "val_text_document"))
    assert val == documents[:len(val)] and read_megatron(prepare_fineweb.output_prefix(output_dir, 0)) == \
        documents[len(val):500]
    summary = prepare_fineweb.prepare(files, output_dir, workers=2)
    assert summary["val"] is None and not any(entry["kept"] for entry in summary["files"])
    assert not glob.glob(os.path.join(output_dir, "val_text_document*"))
    assert [read_megatron(prepare_fineweb.output_prefix(output_dir, i)) for i in range(4)] == [
        documents[:500], documents[500:1400], documents[1400:2200], documents[2200:]]


def test_changed_content_of_the_same_size_is_redone(tmp_path, tiktoken_gpt2):
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    for path, text in zip(inputs, ["first file\n\nsecond paragraph\n", "other file\n\nmore text\n"]):
        with open(path, "w") as f:
            f.write(text)
    output_dir = str(tmp_path / "out")
    prepare_fineweb.prepare(inputs, output_dir, workers=1)
    stat = os.stat(inputs[1])
    with open(inputs[1], "w") as f:
        f.write("other file\n\nmore TEXT\n")  # the same size, and the same mtime below
    os.utime(inputs[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(inputs[1]) == stat.st_size
    summary = prepare_fineweb.prepare(inputs, output_dir, workers=1)
    assert [entry["kept"] for entry in summary["files"]] == [True, False]
    assert read_megatron(prepare_fineweb.output_prefix(output_dir, 1)) == expected_tokens(
        tiktoken_gpt2, ["other file", "more TEXT"])


def test_outputs_of_inputs_no_longer_given_are_removed(tmp_path, capsys):
    inputs = []
    for index in range(3):
        inputs.append(str(tmp_path / f"{index}.jsonl"))
        with open(inputs[-1], "w") as f:
            f.write(json.dumps({"text": f"document of file {index}"}) + "\n")
    output_dir = str(tmp_path / "out")
    prepare_fineweb.prepare(inputs, output_dir, workers=1)
    capsys.readouterr()
    summary = prepare_fineweb.prepare(inputs[:2], output_dir, workers=1)
    assert [entry["kept"] for entry in summary["files"]] == [True, True]
    assert sorted(os.listdir(output_dir)) == [f"processed_data_{i}_text_document.{ext}" for i in range(2)
                                              for ext in ("bin", "idx")] + ["summary.json"]
    printed = capsys.readouterr().out
    assert "processed_data_2_text_document.bin: made from an input that is no longer given, removed" in printed
    # the glob training uses now finds only the outputs of the current inputs
    assert indexed_dataset.resolve_blend(os.path.join(output_dir, "processed_data_*_text_document"))[0] == [
        prepare_fineweb.output_prefix(output_dir, i) for i in range(2)]


def test_empty_inputs_give_no_output_and_a_warning(tmp_path, tiktoken_gpt2):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    empties = {"0_empty.txt": b"", "1_blank_lines.txt": b"\n \n\t\n", "2_empty_texts.jsonl": b'{"text": ""}\n'
               b'{"text": null}\n', "4_empty.jsonl": b""}
    for name, content in {**empties, "3_good.txt": b"one document\n\nanother\n"}.items():
        (corpus / name).write_bytes(content)
    output_dir = tmp_path / "out"
    run = run_cli("--input", str(corpus / "*"), "--output-dir", str(output_dir), "--workers", "2")
    assert run.returncode == 0, run.stderr
    # an output only for the input with documents: megatron-core cannot map an empty .bin
    assert sorted(os.listdir(output_dir)) == ["processed_data_3_text_document.bin",
                                              "processed_data_3_text_document.idx", "summary.json"]
    assert read_megatron(str(output_dir / "processed_data_3_text_document")) == expected_tokens(
        tiktoken_gpt2, ["one document", "another"])
    warnings = [line for line in run.stderr.splitlines() if "warning" in line]
    assert [line.split(": warning:")[0] for line in warnings] == [str(corpus / name) for name in sorted(empties)]
    with open(output_dir / "summary.json") as f:
        summary = json.load(f)
    assert [entry["output"] is None for entry in summary["files"]] == [True, True, True, False, True]
    assert indexed_dataset.resolve_blend(str(output_dir / "processed_data_*_text_document"))[0] == [
        str(output_dir / "processed_data_3_text_document")]

    # an empty output of older code is redone to none (and so removed)
    for entry in summary["files"][:1]:
        entry["output"] = str(output_dir / "processed_data_0_text_document")
        indexed_dataset.IndexedDatasetBuilder(entry["output"] + ".bin").finalize(entry["output"] + ".idx")
    with open(output_dir / "summary.json", "w") as f:
        json.dump(summary, f)
    summary = prepare_fineweb.prepare(prepare_fineweb.find_inputs(str(corpus / "*")), str(output_dir))
    assert [entry["kept"] for entry in summary["files"]] == [False, True, True, True, True]
    assert not glob.glob(str(output_dir / "processed_data_0_*"))


def test_inputs_without_a_document_fail_in_one_line_and_are_not_marked_finished(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"\n \n")
    output_dir = tmp_path / "out"
    run = run_cli("--input", str(tmp_path / "empty.txt"), "--output-dir", str(output_dir), "--workers", "1")
    assert run.returncode == 1 and run.stderr.splitlines()[-1] == (
        f"prepare_fineweb.py: error: {output_dir}: no documents to train on in the 1 input(s) (empty, or "
        "all taken by --val-tokens); nothing written"), run.stderr
    with open(output_dir / "summary.json") as f:
        assert json.load(f)["finished"] is False
    assert not glob.glob(str(output_dir / "*.idx"))


def test_a_second_run_into_the_same_output_dir_stops_at_once(tmp_path):
    with open(tmp_path / "a.txt", "w") as f:
        f.write("some text\n")
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    # what a killed run left: its temporaries and its lock file (unlocked: the OS drops the flock of a dead process)
    dead = [output_dir / ".processed_data_0_text_document.bin.999999.tmp", output_dir / ".summary.json.999999.tmp"]
    for path in dead + [output_dir / ".prepare.lock"]:
        path.write_text("pid 999999 on host gone\n")
    dead.append(output_dir / ".val_text_document.bin.999999.tmp")  # killed before it wrote a byte
    dead[-1].touch()
    args = ["--input", str(tmp_path / "a.txt"), "--output-dir", str(output_dir), "--workers", "1"]
    with prepare_fineweb.locked(str(output_dir)) as lock:  # another run, busy in output_dir
        # its pool workers hold no share of the lock: the orphans of a killed run would keep it
        with multiprocessing.Pool(1, prepare_fineweb.start_worker, (lock,)) as pool:
            worker = pool.apply(os.getpid)
            assert str(output_dir / ".prepare.lock") not in [
                os.readlink(f"/proc/{worker}/fd/{fd}") for fd in os.listdir(f"/proc/{worker}/fd")]
        ours = output_dir / f".processed_data_0_text_document.bin.{os.getpid()}.tmp"
        ours.write_bytes(b"in progress")
        start = time.time()
        with pytest.raises(SystemExit) as exit_:
            prepare_fineweb.main(args)
        assert time.time() - start < 5
        message = str(exit_.value)  # one line, naming the lock and who holds it
        assert message.startswith(f"prepare_fineweb.py: error: {output_dir}/.prepare.lock: ") and "\n" not in message
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert ours.exists() and all(path.exists() for path in dead)  # the refused run deleted nothing
        ours.unlink()
    prepare_fineweb.main(args)  # the next run clears the dead runs' leftovers
    assert sorted(os.listdir(output_dir)) == ["processed_data_0_text_document.bin",
                                              "processed_data_0_text_document.idx", "summary.json"]


@pytest.mark.parametrize("layout", ["output dir is the input dir", "output dir below a ** glob"])
def test_outputs_are_never_read_back_as_inputs(tmp_path, layout):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first file\n")
    (corpus / "b.jsonl").write_text('{"text": "second file"}\n')
    glob_, output_dir = (corpus / "*", corpus) if layout == "output dir is the input dir" else (
        corpus / "**", corpus / "sub" / "megatron")
    for _ in range(2):  # the rerun the tool recommends
        run = run_cli("--input", str(glob_), "--output-dir", str(output_dir), "--workers", "1")
        assert run.returncode == 0, run.stderr
    assert run.stdout == f"{output_dir}: already complete (2 documents, 6 tokens); nothing to do\n"
    with open(output_dir / "summary.json") as f:
        assert [entry["input_name"] for entry in json.load(f)["files"]] == ["a.txt", "b.jsonl"]


def test_rerun_of_a_complete_prepare_does_nothing_but_say_so(tmp_path):
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    for path in inputs:
        with open(path, "w") as f:
            f.write(f"the text of {path}\n")
    output_dir = tmp_path / "out"
    summary = prepare_fineweb.prepare(inputs, str(output_dir), val_tokens=3)
    before = {name: (os.stat(output_dir / name).st_mtime_ns, (output_dir / name).read_bytes())
              for name in os.listdir(output_dir)}
    run = run_cli("--input", str(tmp_path / "*.txt"), "--output-dir", str(output_dir), "--val-tokens", "3")
    assert run.returncode == 0, run.stderr
    assert run.stdout == (f"{output_dir}: already complete ({summary['documents']} documents, {summary['tokens']} "
                          f"tokens); nothing to do\n") and run.stderr == ""
    assert {name: (os.stat(output_dir / name).st_mtime_ns, (output_dir / name).read_bytes())
            for name in os.listdir(output_dir)} == before
    again = prepare_fineweb.prepare(inputs, str(output_dir), val_tokens=3)
    assert again["val"]["kept"] and all(entry["kept"] for entry in again["files"])
    assert {key: again[key] for key in ("documents", "tokens", "seconds")} == {
        key: summary[key] for key in ("documents", "tokens", "seconds")}


def test_output_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "taken").write_text("not a directory")
    run = run_cli("--input", str(tmp_path / "a.txt"), "--output-dir", str(tmp_path / "taken"))
    assert run.returncode == 1 and run.stderr == (f"prepare_fineweb.py: error: {tmp_path / 'taken'}: a file, not a "
                                                  f"directory; choose another --output-dir\n")


PREPARE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
import prepare_fineweb
prepare_fineweb.main(sys.argv[1:])
"""


def test_a_failed_write_is_one_line_naming_the_file(tmp_path):
    output_dir = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", PREPARE_UNDER_A_SIZE_LIMIT, "--input",
                          os.path.join("data", "tinyshakespeare.txt"), "--output-dir", str(output_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (f"prepare_fineweb.py: error: cannot write "
                                           f"{output_dir}/processed_data_0_text_document.bin: File too large")
    assert "Traceback" not in run.stderr and os.listdir(output_dir) == []
