"""Comparability with llm.c / build-nanogpt: the val loss over llm.c's windows equals transformers' on any number of
ranks and batch sizes, --eval_only measures a reference model on the same windows and HellaSwag examples, training
runs past one epoch with exact resume, and every step's speed and memory land in metrics.jsonl."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
import hellaswag
import train_gpt2
from indexed_dataset import IndexedDatasetBuilder
from tokenizer import EOT_ID, gpt2_encoding
from conftest import BYTE_EOT, metrics, tiny, vislog

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
HELLASWAG_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hellaswag_small.jsonl")
T = 32


@pytest.fixture(scope="module")
def val_prefix(tmp_path_factory):
    """Shakespeare paragraphs as GPT-2 tokens, each document followed by EOT, as prepare_fineweb.py writes them."""
    prefix = str(tmp_path_factory.mktemp("val") / "val_text_document")
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        paragraphs = [p for p in re.split(r"\n\s*\n", f.read()) if p.strip()][:300]
    enc = gpt2_encoding()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for paragraph in paragraphs:
        builder.add_document(np.array(enc.encode_ordinary(paragraph) + [EOT_ID], dtype=np.uint16))
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("hf"))
    GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(path)
    return path


def llmc_val_loss(hf_dir, prefix, num_windows):
    """transformers' mean loss over llm.c's windows: stream = [EOT] + the documents; inputs stream[kT : kT+T],
    targets stream[kT+1 : kT+T+1] (the windows share one token), as llm.c's DataLoader reads its val shard."""
    from transformers import GPT2LMHeadModel

    with open(prefix + ".bin", "rb") as f:
        stream = np.concatenate([[EOT_ID], np.frombuffer(f.read(), dtype=np.uint16)]).astype(np.int64)
    model = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    losses = []
    with torch.no_grad():
        for k in range(num_windows):
            x = torch.from_numpy(stream[k * T:k * T + T])[None]
            y = torch.from_numpy(stream[k * T + 1:k * T + T + 1])
            losses.append(F.cross_entropy(model(x).logits[0], y, reduction="sum").item())
    return sum(losses) / (num_windows * T)


def eval_only_args(hf_dir, prefix, out, **overrides):
    config = dict(eval_only=True, init_from=hf_dir, val_data_paths=prefix, val_tokens=10 * T, seq_length=T,
                  local_batch_size=2, global_batch_size=4, padded_vocab_size=None, device="cpu", dtype="float32",
                  compile=False, out_dir=str(out), dist_timeout_s=60)
    config.update(overrides)
    return [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in config.items()]


def val_loss_logged(out):
    return metrics(out, "val_loss")[0]


def test_val_loss_on_llmc_windows_equals_transformers_for_any_ranks_and_batch(hf_dir, val_prefix, tmp_path):
    expected = llmc_val_loss(hf_dir, val_prefix, 10)
    for local_batch_size in (1, 4):
        out = tmp_path / f"lbs{local_batch_size}"
        train_gpt2.main(eval_only_args(hf_dir, val_prefix, out, local_batch_size=local_batch_size))
        assert val_loss_logged(out) == pytest.approx(expected, abs=1e-5)
    out = tmp_path / "two_ranks"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train_gpt2.py"), *eval_only_args(hf_dir, val_prefix, out, local_batch_size=3)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert val_loss_logged(out) == pytest.approx(expected, abs=1e-5)


def test_eval_only_writes_the_reference_line_and_hellaswag_of_the_standalone_script(hf_dir, val_prefix, tmp_path):
    out = tmp_path / "gpt2_reference"
    train_gpt2.main(eval_only_args(hf_dir, val_prefix, out, hellaswag=HELLASWAG_FIXTURE))
    streams = vislog(out / "main.log")
    assert set(streams) == {"tel", "eval"} and set(streams["tel"]) == {0} and set(streams["eval"]) == {0}
    standalone = hellaswag.main(["--model", hf_dir, "--data", HELLASWAG_FIXTURE])
    assert streams["eval"][0] == pytest.approx(round(standalone["acc_norm"], 4))
    assert metrics(out, "hellaswag_acc_norm")[0] == standalone["acc_norm"]
    assert not os.path.exists(out / "hf")  # nothing trained, nothing written
    assert not os.path.isdir(out / "ckpt") or not os.listdir(out / "ckpt")


def small_byte_datasets(directory, count=2, blocks_each=15):
    """`count` byte-level prefixes of a few Shakespeare paragraphs each: a short epoch."""
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        blocks = [b for b in re.split(r"\n\s*\n", f.read()) if b.strip()]
    for i in range(count):
        builder = IndexedDatasetBuilder(os.path.join(directory, f"part_{i}.bin"), dtype=np.uint16)
        for block in blocks[i * blocks_each:(i + 1) * blocks_each]:
            builder.add_document(np.append(np.frombuffer(block.encode(), dtype=np.uint8), BYTE_EOT).astype(np.uint16))
        builder.finalize(os.path.join(directory, f"part_{i}.idx"))
    return os.path.join(directory, "part_*")


def test_training_past_one_epoch_resumes_bit_exactly_in_the_second_epoch(tmp_path):
    glob = small_byte_datasets(str(tmp_path))
    common = dict(split="100,0,0", val_tokens=0, index_mapping_dir=str(tmp_path / "cache"))
    epoch_out = tmp_path / "epoch"
    train_gpt2.main(tiny(glob, epoch_out, max_steps=None, **common))
    epoch_steps = max(metrics(epoch_out, "train_loss")) + 1
    assert 4 <= epoch_steps <= 30

    steps = 2 * epoch_steps + 3
    full = tmp_path / "full"
    train_gpt2.main(tiny(glob, full, max_steps=steps, ckpt_every_steps=epoch_steps + 2, ckpt_keep=5, **common))
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    for name in sorted(os.listdir(resumed / "ckpt"))[1:]:  # as if killed after the first checkpoint
        shutil.rmtree(resumed / "ckpt" / name)
    shutil.rmtree(resumed / "hf")
    train_gpt2.main(tiny(glob, resumed, max_steps=steps, ckpt_every_steps=epoch_steps + 2, ckpt_keep=5, **common))
    assert metrics(resumed, "train_loss") == metrics(full, "train_loss")
    assert len(metrics(full, "train_loss")) == steps


def test_metrics_hold_step_time_throughput_mfu_and_per_step_memory(tmp_path):
    glob = small_byte_datasets(str(tmp_path), count=1)
    out = tmp_path / "out"
    train_gpt2.main(tiny(glob, out, split="100,0,0", val_tokens=0, max_steps=3, log_every_steps=2))
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if '"train_loss"' in line]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0
        assert r["run_peak_mem_gib"] >= r["peak_mem_gib"] and "mfu" in r  # MFU n/a (None) on a CPU


@pytest.mark.parametrize("name, layers, width, heads, steps, tokens_per_step", [
    ("gpt2_124m", 12, 768, 12, 19073, 524288), ("gpt2_350m", 24, 1024, 16, 60000, 524288),
    ("gpt2_774m", 36, 1280, 20, 286102, 524288), ("gpt2_1558m", 48, 1600, 25, 32000, 1048576)])
def test_recipe_configs_load_with_the_reference_shapes(name, layers, width, heads, steps, tokens_per_step):
    cfg = train_gpt2.load_config([os.path.join(ROOT, "configs", f"{name}.py")])
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.max_steps) == (layers, width, heads, steps)
    assert cfg.global_batch_size * cfg.seq_length == tokens_per_step and cfg.val_data_paths and cfg.split == "100,0,0"
