"""train_gpt2.py on one process: the configurator (config files, --key=value, --help, the seed recipe's AutoModel YAML),
the training step (no host-device sync, compile, activation checkpointing, the memory plan against measurement),
comparability with llm.c and build-nanogpt (val windows, --eval_only, HellaSwag, epochs, metrics), token ids outside
the vocabulary, a resume that changes the schedule, and the common research edits (lr_at, build_optimizer, Muon, the
activation). The out_dir and its logs are test_run_dir.py's, checkpoints and a resume's checks test_checkpoint.py's.
Most runs use the byte-level Shakespeare dataset (vocabulary 512) and the 2-layer model of conftest.tiny: the tokenizer
is not the subject."""
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import batches
import hellaswag
import plot_log
import train_gpt2
from conftest import (ROOT, checkpoints, gpt2_token_dataset, metrics, rerun, script, save_tiny_hf_gpt2, small_byte_datasets,
                      tiny, torchrun, vislog, write_byte_dataset, write_ours)
from indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from muon import ShardedMuon
from tokenizer import EOT_ID, gpt2_encoding

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def documented_commands():
    """(file:line, world size, arguments) of each train_gpt2.py command in the code blocks of README.md and docs/*.md:
    python (1 process) or torchrun (--nproc_per_node x --nnodes, an elastic --nnodes MIN:MAX at its MAX)."""
    found = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        in_block, pending = False, ""
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
            if line.lstrip().startswith("```"):
                in_block, pending = not in_block, ""
                continue
            pending += line.rstrip("\n")
            if pending.endswith("\\"):  # a command continued on the next line
                pending = pending[:-1]
                continue
            text, pending = pending, ""
            for command in text.split("&&") if in_block else []:
                words = shlex.split(command, comments=True)
                script = next((i for i, word in enumerate(words) if word.endswith("train_gpt2.py")), None)
                if script is None or not words[0].startswith(("python", "torchrun")) or "--help" in words:
                    continue
                options, launcher = {}, words[:script]
                for i, word in enumerate(launcher):
                    if word.startswith("--"):
                        key, _, value = word[2:].replace("-", "_").partition("=")
                        options[key] = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
                world = int(options.get("nproc_per_node", 1)) * int(options.get("nnodes", "1").split(":")[-1])
                found.append((f"{os.path.relpath(path, ROOT)}:{number}", world, words[script + 1:]))
    return found


def test_every_train_gpt2_command_in_the_docs_passes_its_config_check_at_its_world_size(monkeypatch, capsys):
    commands = documented_commands()
    assert len(commands) >= 4 and any(world > 8 for _, world, _ in commands), commands  # one multi-node among them
    monkeypatch.chdir(ROOT)
    failures = []
    for where, world, args in commands:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        try:
            train_gpt2.load_config(args)
        except (ValueError, OSError) as e:
            failures.append(f"{where} (world size {world}): {e}")
    assert not failures, "\n".join(failures)


def test_val_data_paths_takes_a_blend_list():
    cfg = train_gpt2.load_config(["--val_data_paths=['1', 'a', '2', 'b']"])
    assert cfg.val_data_paths == ["1", "a", "2", "b"]


@pytest.mark.slow
def test_a_batch_that_does_not_divide_is_one_error_printed_once_under_torchrun(data, tmp_path):
    result = subprocess.run(torchrun(tiny(data, tmp_path / "out", global_batch_size=8, local_batch_size=3)),
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "is not divisible" in line]
    assert errors == ["train_gpt2.py: error: config: global_batch_size 8 is not divisible by local_batch_size 3 x "
                      "world size 2 = 6"], result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_a_shorter_max_steps_within_the_plan_is_allowed_and_its_schedule_logged(finished, tmp_path, capsys):
    copy, _, args = rerun(finished, tmp_path, max_steps=15, lr=1e-3)
    assert train_gpt2.main(args) == 0
    said = capsys.readouterr().out
    lr = train_gpt2.lr_at(10, train_gpt2.load_config(args))
    assert f"max_steps 20 -> 15; lr 0.003 -> 0.001: the config wins from step 10 on; " \
           f"lr at step 10 is {lr:.3e}" in said
    assert metrics(copy, "lr")[14] == train_gpt2.lr_at(14, train_gpt2.load_config(args))
    assert 15 in metrics(copy, "val_loss") and (copy / "hf").is_dir()  # the final evaluation and export at step 15


@pytest.mark.slow
def test_eval_only_on_a_finished_run_leaves_its_records_and_writes_its_own(finished, tmp_path, capsys):
    prefix, out = finished
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    before = {name: (copy / name).read_bytes() for name in ("metrics.jsonl", "main.log", "train_config.json")}
    args = tiny(prefix, copy, max_steps=20, index_mapping_dir=os.path.join(os.path.dirname(prefix), "..", "cache"))
    for val_tokens in (256, 512):
        assert train_gpt2.main(args + ["--eval_only=True", f"--val_tokens={val_tokens}"]) == 0
    assert {name: (copy / name).read_bytes() for name in before} == before
    assert f"eval_only: the results are appended to {copy / 'eval'}/main.log" in capsys.readouterr().out
    records = [json.loads(line) for line in (copy / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [20, 20]
    assert [r["val_loss"] for r in records if "val_loss" in r][1] == metrics(copy, "val_loss")[20]  # as trained
    assert json.loads((copy / "eval" / "eval_config.json").read_text())["val_tokens"] == 512
    assert plot_log.parse_log(str(copy))["tel"][-1] == (20, round(metrics(copy, "val_loss")[20], 4))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, bad", [(np.uint16, 600), (np.int32, -3)])
def test_a_token_id_outside_the_vocabulary_names_the_dataset_and_document(tmp_path, dtype, bad):
    prefix = str(tmp_path / "bad")
    write_byte_dataset(prefix)
    if dtype is np.int32:  # the same documents in a signed int32 dataset, as Megatron writes for large vocabularies
        dataset = IndexedDataset(prefix)
        write_ours(prefix + "32", [(dataset[i], [len(dataset[i])]) for i in range(len(dataset))], np.int32)
        prefix += "32"
    tokens = np.memmap(prefix + ".bin", dtype, "r+")
    tokens[::5000] = bad  # bit rot: beyond the 512-token vocabulary, or below 0
    tokens.flush()
    with pytest.raises(ValueError, match=rf"token id {bad} in .*bad(32)?: documents? \d+.* \(sample \d+\) is outside "
                                         r"the model's vocabulary \(vocab_size 512\)"):
        train_gpt2.main(tiny(prefix, tmp_path / "out", max_steps=400, val_tokens=0, val_every_steps=1000,
                             index_mapping_dir=str(tmp_path / "cache")))


def test_blend_weights_that_overflow_and_val_tokens_beyond_the_validation_split_are_one_line(data, tmp_path):
    with pytest.raises(ValueError, match=r"blend list .*: the weights \['1e308', '1e308'\] add up to more than a "
                                         r"float holds; scale them down"):
        train_gpt2.main(tiny(data, tmp_path / "a", data_paths=["1e308", data, "1e308", data]))
    # the byte dataset's validation split (90,10,0) holds 81,657 tokens: 2,551 windows of 32
    with pytest.raises(ValueError, match=r"the validation split \('90,10,0'\) holds 81,657 tokens, fewer than the "
                                         r"96,001 that val_tokens 96,000 needs; lower val_tokens"):
        train_gpt2.main(tiny(data, tmp_path / "b", val_tokens=96_000))


PROJECT_FILES = tuple(os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.endswith(".py"))


@pytest.mark.slow
def test_no_synchronising_call_in_a_step_that_does_not_log(data, tmp_path, monkeypatch):
    """.item(), .cpu(), .tolist() and bool(tensor) wait for the device; count those the project's own code makes,
    per training step, with the numbers read once per 4 steps."""
    calls, current = [], {"step": None}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller in PROJECT_FILES:
                calls.append((current["step"], name, os.path.basename(caller), sys._getframe(1).f_lineno))
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("item", "cpu", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    real_start = train_gpt2.StepLog.start_step

    def start_step(self):
        current["step"] = len([c for c in calls if c[1] == "start"])  # steps started so far
        calls.append((current["step"], "start", "", 0))
        real_start(self)

    monkeypatch.setattr(train_gpt2.StepLog, "start_step", start_step)
    train_gpt2.main(tiny(data, tmp_path / "out", max_steps=12, log_every_steps=4, val_every_steps=100,
                         ckpt_every_steps=0))
    per_step = {}
    for step, name, where, line in calls:
        if name != "start" and step is not None:
            per_step.setdefault(step, []).append(f"{name} at {where}:{line}")
    logging_steps = {s for s in range(12) if (s + 1) % 4 == 0} | {11}  # and the last, which checkpoints
    quiet = {s: per_step.get(s, []) for s in range(12) if s not in logging_steps}
    assert all(not found for found in quiet.values()), quiet
    assert len(metrics(tmp_path / "out", "train_loss")) == 12  # every step is still logged


def compile_args(data, out, compile):
    return tiny(data, out, max_steps=4, val_every_steps=2, ckpt_every_steps=0, compile=compile, val_tokens=256)


def assert_losses_close(a, b, tol=1e-4):
    for key in ("train_loss", "val_loss"):
        ma, mb = metrics(a, key), metrics(b, key)
        assert ma.keys() == mb.keys() and max(abs(ma[k] - mb[k]) for k in ma) <= tol, (key, ma, mb)


@pytest.mark.slow
def test_compile_gives_the_eager_losses_on_one_process(data, tmp_path):
    train_gpt2.main(compile_args(data, tmp_path / "eager", False))
    train_gpt2.main(compile_args(data, tmp_path / "compiled", True))
    assert_losses_close(tmp_path / "eager", tmp_path / "compiled")


@pytest.mark.slow
def test_compile_gives_the_eager_losses_on_two_ranks_with_fsdp2(data, tmp_path):
    for name, flag in (("eager", False), ("compiled", True)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(ROOT, "train_gpt2.py"), *compile_args(data, tmp_path / name, flag)]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_losses_close(tmp_path / "eager", tmp_path / "compiled")


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same_run(data, tmp_path):
    train_gpt2.main(tiny(data, tmp_path / "plain", max_steps=4, ckpt_every_steps=0))
    train_gpt2.main(tiny(data, tmp_path / "recomputed", max_steps=4, ckpt_every_steps=0, activation_checkpointing=True))
    for key in ("train_loss", "val_loss", "grad_norm"):
        a, b = metrics(tmp_path / "plain", key), metrics(tmp_path / "recomputed", key)
        assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) <= 1e-6


HELLASWAG_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hellaswag_small.jsonl")
T = 32


@pytest.mark.slow
def test_evaluation_runs_uncompiled_so_training_compiles_each_graph_once(tmp_path):
    """A compiled run evaluating every 4 steps, with validation, HellaSwag and a sample: evaluation runs the model as
    written, so each compiled function holds the one graph training compiled for its shape. Compiled, evaluation's
    no_grad and shapes (batch 2 and 1, HellaSwag's rows, the sample's growing context) added 4 graphs to
    Block.forward and 1 to the loss head's chunk."""
    import model
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    prefix = gpt2_token_dataset(str(tmp_path / "shakespeare"))
    torch._dynamo.reset()  # no graph of an earlier test's
    out = tmp_path / "out"
    assert train_gpt2.main(tiny(prefix, out, vocab_size=50257, n_embd=64, max_steps=8, val_every_steps=4,
                                val_tokens=320, ckpt_every_steps=0, compile=True, hellaswag=HELLASWAG_FIXTURE,
                                sample_tokens=16, hf_export="off", index_mapping_dir=str(tmp_path / "cache"))) == 0
    assert sorted(metrics(out, "val_loss")) == [0, 4, 8] and sorted(metrics(out, "hellaswag_acc_norm")) == [4, 8]
    assert sorted(metrics(out, "sample")) == [4, 8]
    graphs = {f.__qualname__: len(_debug_get_cache_entry_list(f.__code__))
              for f in (model.Block.forward, model._real_vocab_chunk_loss)}
    assert graphs == {"Block.forward": 1, "_real_vocab_chunk_loss": 1}


@pytest.mark.slow
def test_deterministic_trains_the_same_run_on_a_cpu_and_is_put_back_after(data, tmp_path, monkeypatch):
    """On a CPU every kernel is deterministic already: --deterministic=True logs today's numbers, bit for bit, and
    the process is as before after the run (a notebook's next run is not slowed)."""
    during, real_train = [], train_gpt2.train

    def train(*args):
        during.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return real_train(*args)

    monkeypatch.setattr(train_gpt2, "train", train)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for name, flag in (("default", False), ("deterministic", True)):
        assert train_gpt2.main(tiny(data, tmp_path / name, max_steps=12, val_every_steps=6,
                                    deterministic=flag)) == 0
    assert during == [(False, None), (True, ":4096:8")]
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    for key in ("train_loss", "val_loss", "grad_norm"):
        assert metrics(tmp_path / "default", key) == metrics(tmp_path / "deterministic", key), key


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
    return save_tiny_hf_gpt2(str(tmp_path_factory.mktemp("hf")), vocab_size=50257)


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
    return metrics(out / "eval", "val_loss")[0]


@pytest.mark.gpt2
@pytest.mark.slow
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


@pytest.mark.slow
def test_eval_only_writes_the_reference_line_and_hellaswag_of_the_standalone_script(hf_dir, val_prefix, tmp_path):
    out = tmp_path / "gpt2_reference"
    train_gpt2.main(eval_only_args(hf_dir, val_prefix, out, hellaswag=HELLASWAG_FIXTURE))
    streams = vislog(out / "eval" / "main.log")
    assert set(streams) == {"tel", "eval"} and set(streams["tel"]) == {0} and set(streams["eval"]) == {0}
    standalone = hellaswag.main(["--model", hf_dir, "--data", HELLASWAG_FIXTURE])
    assert streams["eval"][0] == pytest.approx(round(standalone["acc_norm"], 4))
    assert metrics(out / "eval", "hellaswag_acc_norm")[0] == standalone["acc_norm"]
    assert not os.path.exists(out / "hf")  # nothing trained, nothing written
    assert not os.path.isdir(out / "ckpt") or not os.listdir(out / "ckpt")


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_the_muon_config_after_the_124m_recipe_keeps_its_run_and_trains_with_muon():
    recipe, muon = (os.path.join(ROOT, "configs", name) for name in ("gpt2_124m.py", "gpt2_124m_muon.py"))
    adamw, cfg = train_gpt2.load_config([recipe]), train_gpt2.load_config([recipe, muon])
    # Muon's own defaults: muon_lr, and the AdamW part at SCALAR_LR_FACTOR x the recipe's lr; the schedule is the recipe's
    assert (cfg.optimizer, cfg.muon_lr, cfg.muon_scalar_lr, cfg.lr, cfg.min_lr) == \
        ("muon", train_gpt2.TrainConfig.muon_lr, None, adamw.lr, adamw.min_lr)
    kept = lambda config: {k: v for k, v in vars(config).items() if "lr" not in k and "optimizer" not in k}  # noqa: E731
    assert kept(cfg) == dict(kept(adamw), out_dir="out_gpt2_124m_muon")


@pytest.mark.slow
def test_muon_ends_below_adamw_at_equal_steps_on_the_demo_model(tmp_path):
    """60 steps of the demo (its own settings, warmup 6): AdamW against --optimizer=muon alone, at Muon's own lr
    defaults (bench/bench_muon.py also compares them at 200 and 400 steps and at equal wall time)."""
    data_dir = tmp_path / "shakespeare"
    subprocess.run([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), "--input",
                    os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--output-dir", str(data_dir), "--workers", "1"],
                   check=True, capture_output=True)
    demo = os.path.join(ROOT, "configs", "demo_cpu.py")
    val_loss = {}
    for name, extra in [("adamw", []), ("muon", ["--optimizer=muon"])]:
        out = tmp_path / name
        train_gpt2.main([demo, f"--data_paths={str(data_dir / 'processed_data_0_text_document')!r}",
                         f"--out_dir={str(out)!r}", "--max_steps=60", "--lr_warmup_steps=6", "--val_every_steps=60",
                         "--sample_tokens=0", "--ckpt_every_steps=0", "--compile=False", *extra])
        val_loss[name] = metrics(out, "val_loss")[60]
    assert val_loss["muon"] < val_loss["adamw"], val_loss


@pytest.mark.slow
def test_a_stop_during_hellaswag_resumes_and_evaluates_that_step_again(tmp_path, monkeypatch):
    prefix = gpt2_token_dataset(str(tmp_path / "shakespeare"))
    out = tmp_path / "out"
    args = tiny(prefix, out, vocab_size=50257, max_steps=4, val_every_steps=2, ckpt_every_steps=2,
                hellaswag=HELLASWAG_FIXTURE, index_mapping_dir=str(tmp_path / "cache"))
    real_evaluate = hellaswag.evaluate

    def signal_then_evaluate(*a, **kw):  # SIGTERM during step 2's HellaSwag, after its val loss
        os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*a, **kw)

    monkeypatch.setattr(hellaswag, "evaluate", signal_then_evaluate)
    assert train_gpt2.main(args) == 128 + signal.SIGTERM
    monkeypatch.undo()
    assert train_gpt2.main(args) == 0
    with open(out / "main.log") as f:
        lines = f.read().splitlines()
    val_lines = [line for line in lines if line.startswith("s:2 tel:")]
    assert len(val_lines) == 2 and val_lines[0] == val_lines[1]  # the same value, logged again
    assert len([line for line in lines if line.startswith("s:2 eval:")]) == 1
    assert sorted(vislog(out / "main.log")["eval"]) == [2, 4]


@pytest.mark.slow
def test_a_blends_weights_are_said_at_every_start(data, tmp_path, capsys):
    other = str(tmp_path / "other")
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, other + suffix)
    blend = ["1", data, "3", other]
    for out in ("cold", "warm"):  # the second start finds the blend in the index cache
        train_gpt2.main(tiny(data, tmp_path / out, data_paths=blend, max_steps=2, val_tokens=0,
                             index_mapping_dir=str(tmp_path / "cache")))
        assert f"train blend: {data} 0.2500, {other} 0.7500" in capsys.readouterr().err


# The common research edits, each made in one function, checked for what could go silently wrong
# elsewhere: the logged lr, resume, the checkpoint's optimizer state.

def run_stopped_and_resumed(args, out, stop_after):
    """A run to the end, and the same run killed after its checkpoint at `stop_after` and rerun:
    both runs' train losses."""
    full = out / "full"
    train_gpt2.main(args(full) + ["--ckpt_keep=10"])
    resumed = out / "resumed"
    shutil.copytree(full, resumed)
    for name in os.listdir(resumed / "ckpt"):
        if int(name.split("_")[1]) > stop_after:
            shutil.rmtree(resumed / "ckpt" / name)
    shutil.rmtree(resumed / "hf")
    train_gpt2.main(args(resumed) + ["--ckpt_keep=10"])
    return metrics(full, "train_loss"), metrics(resumed, "train_loss"), full


@pytest.mark.slow
def test_a_schedule_of_your_own_is_lr_at_alone(data, tmp_path, monkeypatch):
    def warmup_stable_decay(step, cfg):  # 2 steps of warmup, flat, the last 25% decaying to 0
        decay_start = int(0.75 * cfg.max_steps)
        if step < cfg.lr_warmup_steps:
            return cfg.lr * (step + 1) / cfg.lr_warmup_steps
        if step < decay_start:
            return cfg.lr
        return cfg.lr * (cfg.max_steps - step) / (cfg.max_steps - decay_start)

    monkeypatch.setattr(train_gpt2, "lr_at", warmup_stable_decay)
    full, resumed, out = run_stopped_and_resumed(
        lambda out: tiny(data, out, max_steps=20, index_mapping_dir=str(tmp_path / "c")),
        tmp_path, stop_after=10)
    assert full == resumed
    cfg = train_gpt2.load_config(tiny(data, out, max_steps=20))
    assert metrics(out, "lr") == {step: warmup_stable_decay(step, cfg) for step in range(20)}


@pytest.mark.slow
def test_a_parameter_group_of_your_own_resumes_exactly(data, tmp_path, monkeypatch):
    """The embedding at 10x the lr in a group of its own: an edit of build_optimizer alone."""
    def with_embedding_group(model, cfg, device):
        wte = model.transformer.wte.weight
        matrices = [p for p in model.parameters() if p.dim() >= 2 and p is not wte]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        groups = [dict(name="embedding", params=[wte], weight_decay=0.0, lr_scale=10.0),
                  dict(name="decay", params=matrices, weight_decay=cfg.weight_decay, lr_scale=1.0),
                  dict(name="no_decay", params=vectors, weight_decay=0.0, lr_scale=1.0)]
        return [torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))]

    def args(out):
        return tiny(data, out, max_steps=20, index_mapping_dir=str(tmp_path / "c"))

    plain = tmp_path / "plain"
    train_gpt2.main(args(plain))
    monkeypatch.setattr(train_gpt2, "build_optimizer", with_embedding_group)
    full, resumed, out = run_stopped_and_resumed(args, tmp_path, stop_after=10)
    assert full == resumed
    assert full[19] != metrics(plain, "train_loss")[19]  # the group's lr took effect
    # A checkpoint of the two-group optimizer resumes into the three groups: moments by name.
    regrouped = tmp_path / "regrouped"
    shutil.copytree(plain, regrouped)
    shutil.rmtree(regrouped / "hf")
    assert train_gpt2.main(tiny(data, regrouped, max_steps=30,
                                index_mapping_dir=str(tmp_path / "c"))) == 0
    assert sorted(metrics(regrouped, "train_loss")) == list(range(30))


def test_muon_is_torchs_for_the_blocks_matrices_with_dions_lr_and_adamw_for_the_rest():
    from model import GPT, GPTConfig
    cfg = train_gpt2.load_config(["--optimizer=muon", "--lr=0.02", "--muon_lr=0.02", "--muon_scalar_lr=0.01",
                                  "--weight_decay=0.1"])
    model = GPT(GPTConfig(block_size=16, vocab_size=64, padded_vocab_size=None, n_layer=2, n_head=2, n_embd=16))
    muon, adamw = train_gpt2.build_optimizer(model, cfg, torch.device("cpu"))
    assert type(muon) is ShardedMuon and type(adamw) is torch.optim.AdamW  # ShardedMuon: torch's Muon, sharded
    matrices = [p for p in model.transformer.h.parameters() if p.dim() == 2]
    assert [p for group in muon.param_groups for p in group["params"]] == matrices
    held = [p for opt in (muon, adamw) for group in opt.param_groups for p in group["params"]]
    assert len(held) == len({id(p) for p in held}) == len(list(model.parameters()))
    scalar, embedding = adamw.param_groups
    assert (scalar["lr_scale"], scalar["weight_decay"], embedding["lr_scale"], embedding["weight_decay"]) == \
        (0.5, 0.1, 0.5, 0.0)
    outside = [p for name, p in model.named_parameters() if p.dim() == 2 and not name.startswith("transformer.h.")]
    assert embedding["params"] == outside  # wte (and the head, tied or not) and wpe
    # One step on the MLP's c_proj (16 x 64): dion's spectral_norm update, lr x sqrt(16 / 64) x NS(grad), and
    # its decay by lr x weight_decay.
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz
    c_proj = model.transformer.h[0].mlp.c_proj.weight
    before, grad = c_proj.detach().clone(), torch.randn_like(c_proj)
    c_proj.grad = grad
    for group in muon.param_groups:
        group["lr"] = 0.02 * group["lr_scale"]
    muon.step()
    momentum = torch.zeros_like(grad).lerp_(grad, 1 - 0.95)  # the first step's, without Nesterov
    update = _zeropower_via_newtonschulz(momentum, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS).float()
    assert torch.allclose(c_proj.detach(), before * (1 - 0.02 * 0.1) - 0.02 * 0.5 * update, atol=1e-7)
    assert len(train_gpt2.build_optimizer(model, train_gpt2.load_config([]), torch.device("cpu"))) == 1
    # At Muon's defaults the matrices run at muon_lr, the AdamW part at SCALAR_LR_FACTOR x lr, both under the schedule.
    muon, adamw = train_gpt2.build_optimizer(model, train_gpt2.load_config(["--optimizer=muon"]), torch.device("cpu"))
    defaults = train_gpt2.TrainConfig()
    assert muon.param_groups[0]["lr_scale"] == defaults.muon_lr / defaults.lr  # c_attn: fan_out > fan_in
    assert [group["lr_scale"] for group in adamw.param_groups] == [train_gpt2.SCALAR_LR_FACTOR] * 2


@pytest.mark.slow
def test_muon_trains_and_resumes_bit_exactly_and_its_runs_resume_only_under_muon(data, tmp_path):
    def args(out):
        return tiny(data, out, max_steps=20, optimizer="muon", lr=0.02, muon_scalar_lr=3e-3,
                    index_mapping_dir=str(tmp_path / "c"))

    full, resumed, out = run_stopped_and_resumed(args, tmp_path, stop_after=10)
    assert full == resumed and full[19] < full[0] - 1
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    shutil.rmtree(partial / "hf")
    shutil.rmtree(partial / "ckpt" / "step_00000020")
    with pytest.raises(ValueError, match=r"step_00000010: the run was trained with --optimizer=muon; resume so"):
        train_gpt2.main(tiny(data, partial, max_steps=20, index_mapping_dir=str(tmp_path / "c")))
    assert checkpoints(partial) == ["step_00000010"]  # nothing set aside as damaged


def test_a_signal_during_setup_without_validation_checkpoints_before_any_step(data, tmp_path,
                                                                            monkeypatch):
    real_build_optimizer = train_gpt2.build_optimizer

    def signalled_during_setup(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build_optimizer(*args)

    monkeypatch.setattr(train_gpt2, "build_optimizer", signalled_during_setup)
    out = tmp_path / "out"
    assert train_gpt2.main(tiny(data, out, val_tokens=0)) == 128 + signal.SIGTERM
    assert checkpoints(out) == ["step_00000000"]
    assert not os.path.exists(out / "metrics.jsonl") or not metrics(out, "train_loss")


@pytest.mark.slow
def test_a_data_error_mid_run_saves_the_last_good_step_and_the_rerun_resumes_it(
        data, tmp_path, monkeypatch):
    args = tiny(data, tmp_path / "out", max_steps=20, index_mapping_dir=str(tmp_path / "c"))
    reference = tmp_path / "reference"
    train_gpt2.main(tiny(data, reference, max_steps=20, index_mapping_dir=str(tmp_path / "c")))
    real_host_batch, calls = batches.host_batch, []

    def fails_once(dataset, indices, *rest):
        if threading.current_thread() is not threading.main_thread():  # the training batches
            calls.append(1)
            if len(calls) == 28:  # the 14th step's batches: the file shrank under the run
                raise ValueError("data/x.bin: shrank from 100 to 50 bytes while the run read it")
        return real_host_batch(dataset, indices, *rest)

    monkeypatch.setattr(batches, "host_batch", fails_once)  # the reading thread's
    with pytest.raises(ValueError, match="shrank"):
        train_gpt2.main(args)
    saved = checkpoints(tmp_path / "out")
    assert saved[-1] > "step_00000010", saved  # past the periodic checkpoint
    monkeypatch.setattr(batches, "host_batch", real_host_batch)
    assert train_gpt2.main(args) == 0
    assert metrics(tmp_path / "out", "train_loss") == metrics(reference, "train_loss")


@pytest.mark.slow
def test_a_data_error_during_validation_saves_the_step_reached_and_the_rerun_resumes_it(
        data, tmp_path, monkeypatch):
    """The validation windows are read in the main thread: a file cut short there stops every rank at
    that step's checkpoint too (with ckpt_every_steps=0 nothing else would be saved)."""
    args = tiny(data, tmp_path / "out", max_steps=20, val_every_steps=5, ckpt_every_steps=0)
    train_gpt2.main(tiny(data, tmp_path / "reference", max_steps=20, val_every_steps=5, ckpt_every_steps=0))
    real_host_batch, real_validate, validating = train_gpt2.host_batch, train_gpt2.Evaluator.validate, [0]

    def validate(self, model, step, *rest):
        validating[0] = step
        return real_validate(self, model, step, *rest)

    def fails_at_step_15(dataset, indices, *rest):
        if validating[0] == 15 and threading.current_thread() is threading.main_thread():
            raise ValueError("data/x.bin: shrank from 100 to 50 bytes while the run read it")
        return real_host_batch(dataset, indices, *rest)

    monkeypatch.setattr(train_gpt2.Evaluator, "validate", validate)
    monkeypatch.setattr(train_gpt2, "host_batch", fails_at_step_15)
    with pytest.raises(ValueError, match="shrank"):
        train_gpt2.main(args)
    assert checkpoints(tmp_path / "out") == ["step_00000015"]
    monkeypatch.setattr(train_gpt2, "host_batch", real_host_batch)
    assert train_gpt2.main(args) == 0
    assert metrics(tmp_path / "out", "train_loss") == metrics(tmp_path / "reference", "train_loss")


def test_a_run_that_fails_in_process_leaves_no_reading_thread_behind(data, tmp_path, monkeypatch):
    """A notebook's failed runs must not pile up threads holding the data's mappings and batches."""
    def fails(self, step, *rest):
        if step == 3:
            raise RuntimeError("a failure of the run's own")
        return real_log_step(self, step, *rest)

    def left_behind():  # the checkpoint writer's one pooled thread is meant to stay
        return [t for t in set(threading.enumerate()) - before if not t.name.startswith("ThreadPool")]

    real_log_step, before = train_gpt2.StepLog.log_step, set(threading.enumerate())
    monkeypatch.setattr(train_gpt2.StepLog, "log_step", fails)
    for attempt in range(2):
        with pytest.raises(RuntimeError, match="of the run's own"):
            train_gpt2.main(tiny(data, tmp_path / f"out{attempt}", max_steps=20))
    deadline = time.monotonic() + 10
    while left_behind() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left_behind()


def test_a_non_finite_val_loss_stops_the_run_in_one_line(data, tmp_path, monkeypatch):
    """Validation in bf16 can overflow where training did not: the run stops there, naming the step."""
    import model

    def chunk_loss(logits, targets, training):
        plain = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
        return plain if training else plain * float("nan")

    monkeypatch.setattr(model, "chunk_loss", chunk_loss)
    with pytest.raises(FloatingPointError, match=r"^step 0: val loss nan is not finite; stopped, state not saved$"):
        train_gpt2.main(tiny(data, tmp_path / "out", max_steps=4))
    assert not os.path.exists(tmp_path / "out" / "hf")


@pytest.mark.gpt2
@pytest.mark.slow
def test_another_activation_trains_resumes_and_exports_under_its_name(data, tmp_path):
    """Squared ReLU by name: the run, its resume and its Hugging Face export all use it."""
    def args(out):
        return tiny(data, out, max_steps=20, activation="relu2",
                    index_mapping_dir=str(tmp_path / "c"))

    full, resumed, out = run_stopped_and_resumed(args, tmp_path, stop_after=10)
    assert full == resumed
    assert json.loads((out / "hf" / "config.json").read_text())["activation_function"] == "relu2"
    from transformers import GPT2LMHeadModel
    from checkpoint import load_model
    theirs = GPT2LMHeadModel.from_pretrained(out / "hf").eval()
    ours = load_model(str(out / "hf"))
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], theirs(tokens).logits)
    plain = tmp_path / "plain"
    train_gpt2.main(tiny(data, plain, max_steps=20, index_mapping_dir=str(tmp_path / "c")))
    assert metrics(plain, "train_loss")[19] != full[19]


# ------------------------------------------------------------------------------------------------------------------
# Edits of model.py, made as a researcher makes them: the classes changed in a copy of the project, not a flag.

SWIGLU = [("""        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.activation = ACTIVATIONS[config.activation]
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)""",
           """        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_gate = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)"""),
          ("""        return self.c_proj(self.activation(self.c_fc(x)))""",
           """        return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))""")]
QK_NORM = [("""        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C""", """        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.q_norm = nn.LayerNorm(config.n_embd // config.n_head, bias=False)
        self.k_norm = nn.LayerNorm(config.n_embd // config.n_head, bias=False)

    def forward(self, x):
        B, T, C"""),
           ("""        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)""",
            """        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)""")]
# Rotary embeddings in place of wpe: a table of angles as a buffer, computed in __init__ as nanoGPT computes its mask.
ROTARY = [("""        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C""", """        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        head = config.n_embd // config.n_head
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head, 2).float() / head)
        angles = torch.outer(torch.arange(config.block_size).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rotate(self, x):
        cos, sin = self.cos[:x.size(2)], self.sin[:x.size(2)]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def forward(self, x):
        B, T, C"""),
          ("""        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)""",
           """        q, k = self.rotate(q), self.rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)"""),
          ("""            wpe=nn.Embedding(config.block_size, config.n_embd),\n""", ""),
          ("""        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))""",
           """        x = self.transformer.wte(idx)""")]
NO_LN_F = [("""            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),\n""", ""),
           ("""        x = self.transformer.ln_f(x)\n""", "")]
# Sliding-window attention (a window of 100 at seq_length 128): the same tensors, another function from position 100
# on, which a check of the first 64 positions passed.
WINDOW = [("""        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)""",
           """        i = torch.arange(T, device=x.device)
        near = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 100)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=near)""")]
# A parallel block (GPT-J's): attention and MLP read the same input; the same tensors again.
PARALLEL = [("""        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))""", """        return x + self.attn(self.ln_1(x)) + self.mlp(self.ln_2(x))""")]
# A gate on each block's attention, learnt from zero (its __init__ value, which the run keeps).
ZERO_GATE = [("""        self.mlp = MLP(config)
""", """        self.mlp = MLP(config)
        self.gate = nn.Parameter(torch.zeros(1))
"""), ("""        x = x + self.attn(self.ln_1(x))""", """        x = x + (1 + self.gate) * self.attn(self.ln_1(x))""")]
# The same weights computing something else: ReLU where the config says gelu_new.
RELU_IN_FORWARD = [("""        return self.c_proj(self.activation(self.c_fc(x)))""", """        return self.c_proj(F.relu(self.c_fc(x)))""")]
LABEL_SMOOTHING = [("""    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")""",
                    """    smoothing = 0.0
    if training:
        smoothing = 0.1
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum", label_smoothing=smoothing)""")]

# edit: (its replacements, what the check before step 1 says, what a resume of a run from before the edit says)
EDITS = {
    "swiglu": (SWIGLU, "transformer.h.0.mlp.c_gate.weight, which GPT-2 has no place for",
               "added transformer.h.0.mlp.c_gate.weight"),
    "qk_norm": (QK_NORM, "transformer.h.0.attn.q_norm.weight, which GPT-2 has no place for",
                "added transformer.h.0.attn.q_norm.weight"),
    "rotary": (ROTARY, "no transformer.wpe.weight, which GPT-2 computes with", "missing transformer.wpe.weight"),
    "no_ln_f": (NO_LN_F, "no transformer.ln_f.weight, which GPT-2 computes with", "missing transformer.ln_f.weight"),
    "relu_in_forward": (RELU_IN_FORWARD, "transformers' GPT-2 computes other logits from the same weights",
                        "model.py computes otherwise than when this run's checkpoints were written"),
    "sliding_window": (WINDOW, "transformers' GPT-2 computes other logits from the same weights",
                       "model.py computes otherwise than when this run's checkpoints were written"),
    "parallel_block": (PARALLEL, "transformers' GPT-2 computes other logits from the same weights",
                       "model.py computes otherwise than when this run's checkpoints were written"),
    "zero_gate": (ZERO_GATE, "transformer.h.0.gate, which GPT-2 has no place for", "added transformer.h.0.gate"),
}


def edited_project(directory, replacements, edited="model.py"):
    """A copy of the project's scripts and data/ whose `edited` file has each (old, new) replaced once."""
    os.makedirs(directory)
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), directory)
    shutil.copytree(os.path.join(ROOT, "data"), os.path.join(directory, "data"))
    path = os.path.join(directory, edited)
    text = open(path).read()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)
    return directory


def edit_args(data, out, **overrides):
    """A tiny run at seq_length 128: past the 64 positions that a partial check of the model would see."""
    defaults = dict(max_steps=4, ckpt_every_steps=2, val_every_steps=2, val_tokens=256, seq_length=128)
    return tiny(data, out, **dict(defaults, **overrides))


def train_in(project, args):
    return subprocess.run([sys.executable, os.path.join(project, "train_gpt2.py"), *args], cwd=project, text=True,
                          capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def unedited_run(data, tmp_path_factory):
    """A run of the unedited model: checkpoints at steps 2 and 4, and its hf/."""
    out = str(tmp_path_factory.mktemp("unedited") / "run")
    result = train_in(ROOT, edit_args(data, out))
    assert result.returncode == 0, result.stderr
    assert os.path.isdir(os.path.join(out, "hf")) and len(checkpoints(out)) == 2
    return out


@pytest.mark.slow
@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_of_model_py_is_never_exported_or_resumed_silently_wrong(edit, data, unedited_run, tmp_path):
    """Trained afresh, the edited model says before step 1 why hf/ will not be written, trains and checkpoints, and
    writes no hf/. Rerunning a run from before the edit says what differs in one line and leaves its checkpoints as
    they are; started from that run's weights on purpose, it loads what matches and says what it did not."""
    replacements, export_says, resume_says = EDITS[edit]
    project = edited_project(str(tmp_path / "project"), replacements)
    fresh = str(tmp_path / "fresh")
    result = train_in(project, edit_args(data, fresh))
    assert result.returncode == 0, result.stderr
    before_step_1 = result.stdout.split("step     0/4 | loss")[0]
    assert "hf/ will not be written" in before_step_1 and export_says in before_step_1, result.stdout
    assert "hf/ was not written" in result.stdout.splitlines()[-1]
    assert not os.path.exists(os.path.join(fresh, "hf")) and len(checkpoints(fresh)) == 2
    losses = list(metrics(fresh, "val_loss").values())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]  # a rotary table trains: no garbage buffer
    if edit == "swiglu":  # --hf_export=require stops before step 1, in one line saying why (once: it costs a run)
        result = train_in(project, edit_args(data, str(tmp_path / "required"), hf_export="require"))
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert result.returncode == 1 and len(errors) == 1, result.stderr
        assert errors[0].startswith("train_gpt2.py: error: config: hf_export='require', and hf/ will not be "
                                    "written")
        assert export_says in errors[0] and "step     0/4" not in result.stdout
        assert not glob.glob(str(tmp_path / "required" / "ckpt" / "*"))

    old = str(tmp_path / "old")
    shutil.copytree(unedited_run, old)
    before = sorted(os.listdir(os.path.join(old, "ckpt")))
    result = train_in(project, edit_args(data, old, max_steps=6))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and resume_says in errors[0] and "damaged" not in result.stderr, result.stderr
    assert sorted(os.listdir(os.path.join(old, "ckpt"))) == before  # untouched, under their own names

    warm = str(tmp_path / "warm")
    partial = edit not in ("relu_in_forward", "sliding_window", "parallel_block")  # the same tensors: all load
    result = train_in(project, edit_args(data, warm, init_from=old, init_from_partial=partial))
    assert result.returncode == 0, result.stderr
    if partial:
        assert re.search(r"init_from: loaded \d+ of the model's \d+ tensors from .*step_00000004; ", result.stdout)
    else:
        assert "init_from: loaded the weights of" in result.stdout
    assert not os.path.exists(os.path.join(warm, "hf"))


def resume_from_step_4(whole, resumed):
    """A copy of a finished 6-step run as if it had stopped after its checkpoint at step 4."""
    shutil.copytree(whole, resumed)
    shutil.rmtree(os.path.join(resumed, "ckpt", "step_00000006"))
    shutil.rmtree(os.path.join(resumed, "hf"), ignore_errors=True)


UNTIE = [("""        self.lm_head.weight = self.transformer.wte.weight\n""", "")]

# Compares, in the edited project, the newest checkpoint's model with transformers' reading of hf/ over the whole
# context, and says whether its head is its own.
COMPARE_HF = """
import sys, torch, transformers
from checkpoint import load_model
from hf_files import check_ids
ours = load_model(sys.argv[1]).eval()
theirs = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/hf", dtype=torch.float32)
ids = check_ids(ours.config)
with torch.no_grad():
    print((ours(ids)[0] - theirs(ids).logits).abs().max().item())
print(ours.lm_head.weight is ours.transformer.wte.weight, torch.equal(ours.lm_head.weight, ours.transformer.wte.weight))
"""


@pytest.mark.slow
def test_an_untied_head_trains_checkpoints_resumes_and_exports_untied(data, tmp_path):
    """Deleting the tie in GPT.__init__ is the whole edit: the run trains a head of its own (counted as such), resumes
    it exactly, and exports it as transformers' GPT-2 with tie_word_embeddings false, computing the same logits."""
    project = edited_project(str(tmp_path / "project"), UNTIE)
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    result = train_in(project, edit_args(data, whole, max_steps=6))
    assert result.returncode == 0, result.stderr
    before_step_1 = result.stdout.split("step     0/6 | loss")[0]
    assert "hf/: transformers' GPT-2 computes the model's logits" in before_step_1, before_step_1
    tied = train_in(ROOT, edit_args(data, str(tmp_path / "tied"), max_steps=1, ckpt_every_steps=0))
    count = [int(re.search(r"model: ([\d,]+) parameters", r.stdout)[1].replace(",", "")) for r in (result, tied)]
    assert count[0] - count[1] == 512 * 32  # the head's own vocabulary x n_embd
    resume_from_step_4(whole, resumed)
    assert train_in(project, edit_args(data, resumed, max_steps=6)).returncode == 0
    assert metrics(resumed, "train_loss") == metrics(whole, "train_loss")
    config = json.loads(open(os.path.join(resumed, "hf", "config.json")).read())
    assert config["tie_word_embeddings"] is False
    compared = subprocess.run([sys.executable, "-c", COMPARE_HF, resumed], cwd=project, capture_output=True,
                              text=True, timeout=300)
    assert compared.returncode == 0, compared.stderr
    difference, identity = compared.stdout.split("\n")[:2]
    assert float(difference) < 1e-5 and identity == "False False"


# A GPTConfig field of the edit's own: the window of a sliding-window attention, 0 (the default) for none.
WINDOW_FIELD = [("""    activation: str = "gelu_new"  # the MLP's: a key of ACTIVATIONS (add yours there)
""", """    activation: str = "gelu_new"  # the MLP's: a key of ACTIVATIONS (add yours there)
    window: int = 0  # attend to the last `window` positions only; 0: to all
"""), ("""        self.n_head = config.n_head
""", """        self.n_head = config.n_head
        self.window = config.window
"""), ("""        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)""",
       """        i = torch.arange(T, device=x.device)
        near = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (self.window or T))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=near)""")]


@pytest.mark.slow
def test_a_gptconfig_field_is_a_config_key_recorded_in_checkpoints_and_compared_on_resume(data, unedited_run, tmp_path):
    """A field added to GPTConfig is a key (--help, the command line) with nothing else to edit; it reaches the model,
    train_config.json and every checkpoint. A checkpoint with the field resumed by code without it, or the reverse, is
    one line naming the field, and no checkpoint is renamed."""
    project = edited_project(str(tmp_path / "project"), WINDOW_FIELD)
    assert "--window: int = 0  # attend to the last `window` positions only; 0: to all" in \
        train_in(project, ["--help"]).stdout
    windowed = str(tmp_path / "windowed")
    result = train_in(project, edit_args(data, windowed, window=100))
    assert result.returncode == 0, result.stderr
    assert "hf/ will not be written: transformers' GPT-2 computes other logits" in result.stdout
    assert json.loads(open(os.path.join(windowed, "train_config.json")).read())["window"] == 100
    saved = json.loads(open(os.path.join(windowed, "ckpt", "step_00000004", "train_state.json")).read())
    assert saved["model_config"]["window"] == 100
    # --window=0 is GPT-2: that export is written
    result = train_in(project, edit_args(data, str(tmp_path / "full"), window=0, max_steps=1))
    assert result.returncode == 0 and os.path.isdir(tmp_path / "full" / "hf"), result.stderr
    old = str(tmp_path / "old")
    shutil.copytree(unedited_run, old)
    for code, out, says in ((ROOT, windowed, "the checkpoint's model has window=100, which model.py's GPTConfig "
                                             "lacks; add the field back to read it"),
                            (project, old, "model.py's GPTConfig has window (default 0), which the checkpoint's "
                                           "model lacks (it was written before the field was added)")):
        before = checkpoints(out)
        result = train_in(code, edit_args(data, out, max_steps=6))
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert result.returncode == 1 and len(errors) == 1 and says in errors[0], result.stderr
        assert checkpoints(out) == before and "damaged" not in result.stdout + result.stderr


# An EMA of the weights, kept as docs/training.md shows: in build_extra_state, updated after each optimizer step.
EMA = [("""    return {}
""", """    return {"ema": {name: p.detach().clone() for name, p in model.named_parameters()}}
"""), ("""        norm, lr = update(model, optimizer, step, cfg)
""", """        norm, lr = update(model, optimizer, step, cfg)
        for name, p in model.named_parameters():
            extra_state["ema"][name].lerp_(p.detach(), 0.1)
""")]


@pytest.mark.slow
def test_training_state_an_edit_adds_is_checkpointed_and_a_resume_across_the_edit_is_one_line(
        data, unedited_run, tmp_path):
    """The EMA edit trains, checkpoints its EMA and resumes exactly. A run written before the edit, resumed with it (or
    the EMA run without it), is refused in one line naming the state that differs, every checkpoint keeps its name,
    and undoing the edit resumes as before: a damaged checkpoint is one whose bytes changed, never one of other code."""
    project = edited_project(str(tmp_path / "project"), EMA, "train_gpt2.py")
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    assert train_in(project, edit_args(data, whole, max_steps=6)).returncode == 0
    resume_from_step_4(whole, resumed)
    assert train_in(project, edit_args(data, resumed, max_steps=6)).returncode == 0
    assert metrics(resumed, "train_loss") == metrics(whole, "train_loss")
    old = str(tmp_path / "old")
    shutil.copytree(unedited_run, old)
    for code, out, says in ((project, old, "the code has extra.ema.transformer.wte.weight"),
                            (ROOT, resumed, "the checkpoint has extra.ema.transformer.wte.weight")):
        before = checkpoints(out)
        result = train_in(code, edit_args(data, out, max_steps=8))
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert result.returncode == 1 and len(errors) == 1, result.stderr
        assert "the code's training state is not the checkpoint's" in errors[0] and says in errors[0], errors[0]
        assert checkpoints(out) == before and "damaged" not in result.stdout + result.stderr
    assert train_in(ROOT, edit_args(data, old, max_steps=6)).returncode == 0  # the edit undone: it resumes


# Positions masked out of the loss, as an edit of the data or the loop masks them (labels of -100).
MASKED = [("""    tokens, labels = torch.from_numpy(tokens), torch.from_numpy(labels)""",
           """    labels[tokens % 3 == 0] = -100  # a different count of scored tokens in every micro-batch
    tokens, labels = torch.from_numpy(tokens), torch.from_numpy(labels)""")]


@pytest.mark.slow
def test_masked_positions_weigh_per_token_across_micro_batches_and_ranks(data, tmp_path):
    """The loss is the mean over the step's scored tokens, however they fall into micro-batches and ranks: one
    micro-batch, two, and two ranks of one give the same training and validation losses (a mean of each micro-batch's
    mean would differ, since each holds another count of scored tokens)."""
    project = edited_project(str(tmp_path / "project"), MASKED, "batches.py")
    runs = {"accumulated": ["--local_batch_size=4"], "one": ["--local_batch_size=8"]}
    for name, extra in runs.items():
        result = train_in(project, edit_args(data, str(tmp_path / name), ckpt_every_steps=0) + extra)
        assert result.returncode == 0, result.stderr
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(project, "train_gpt2.py"),
               *edit_args(data, str(tmp_path / "ranks"), ckpt_every_steps=0), "--local_batch_size=2"]
    result = subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for key in ("train_loss", "val_loss"):
        one = metrics(tmp_path / "one", key)
        for name in ("accumulated", "ranks"):
            other = metrics(tmp_path / name, key)
            assert one.keys() == other.keys()
            assert all(abs(one[s] - other[s]) < 1e-5 for s in one), (name, key, one, other)


@pytest.mark.slow
def test_label_smoothing_in_the_training_loss_leaves_validation_plain_and_the_export_written(data, tmp_path):
    """chunk_loss's `training` is False in validation (eval mode): the edit changes the training loss from step 0 on,
    the validation loss not at all (the same init, the same windows), and the model is still GPT-2 at inference."""
    plain, smoothed = str(tmp_path / "plain"), str(tmp_path / "smoothed")
    assert train_in(ROOT, edit_args(data, plain, max_steps=1, val_every_steps=1)).returncode == 0
    project = edited_project(str(tmp_path / "project"), LABEL_SMOOTHING)
    result = train_in(project, edit_args(data, smoothed, max_steps=1, val_every_steps=1))
    assert result.returncode == 0, result.stderr
    assert metrics(smoothed, "val_loss")[0] == metrics(plain, "val_loss")[0]
    assert abs(metrics(smoothed, "train_loss")[0] - metrics(plain, "train_loss")[0]) > 1e-4
    assert "hf/: transformers' GPT-2 computes the model's logits" in result.stdout
    assert os.path.isdir(os.path.join(smoothed, "hf"))


@pytest.mark.slow
def test_a_run_shorter_than_its_warmup_trains_and_says_so_in_one_line(data, tmp_path):
    """nanoGPT and AutoModel train on with the warmup unfinished; so does this, after one line."""
    result = script(*tiny(data, tmp_path / "out", max_steps=2, lr_warmup_steps=5, val_every_steps=2))
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if "lr_warmup_steps" in line and "max_steps" in line]
    assert said == ["lr_warmup_steps 5 is more than max_steps 2: the warmup does not finish, and lr peaks at 1.20e-03"]
    assert list(metrics(tmp_path / "out", "lr").values()) == pytest.approx([6e-4, 1.2e-3])



def test_a_short_run_is_a_valid_config():
    cfg = train_gpt2.load_config([os.path.join(ROOT, "configs", "demo_cpu.py"), "--max_steps=4"])
    assert (cfg.max_steps, cfg.lr_warmup_steps) == (4, 10)
