"""train_gpt2.py on one process: the configurator (config files, --key=value, --help, the seed recipe's AutoModel YAML),
the out_dir and its checkpoints, resume refusals, a finished run's rerun, the training step (no host-device sync,
compile, activation checkpointing, the memory plan against measurement), comparability with llm.c and build-nanogpt
(val windows, --eval_only, HellaSwag, epochs, metrics), token ids outside the vocabulary, full disks and wandb.
Most runs use the byte-level Shakespeare dataset (vocabulary 512) and the 2-layer model of conftest.tiny: the tokenizer
is not the subject."""
import errno
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

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hellaswag
import plot_log
import train_gpt2
from conftest import (BYTE_EOT, ROOT, checkpoints, metrics, save_tiny_hf_gpt2, tiny, torchrun, vislog,
                      write_byte_dataset, write_ours)
from indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from model import MARKER, check_checkpoint, complete_checkpoints
from tokenizer import EOT_ID, gpt2_encoding

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def script(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=None if env is None else {**os.environ, **env})




@pytest.mark.slow
def test_an_older_python_gets_one_line_before_any_import():
    """TrainConfig's `str | None` is a TypeError on Python 3.9 (RHEL 9's python3): train_gpt2.py says what it needs
    first. Checked with the interpreter told it is 3.9, and with a real 3.9 where one is installed."""
    path = os.path.join(ROOT, "train_gpt2.py")
    told = (f"import sys; sys.version_info = (3, 9, 18, 'final', 0); sys.argv = [{path!r}, '--help']; "
            f"exec(compile(open({path!r}).read(), {path!r}, 'exec'), {{'__name__': '__main__'}})")
    pythons = [[sys.executable, "-c", told]] + [[p, path, "--help"] for p in glob.glob(
        os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")) + glob.glob("/usr/bin/python3.9")][:1]
    for command in pythons:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stdout) == (1, ""), result.stderr
        assert result.stderr == "train_gpt2.py: error: Python 3.10 or newer is needed, this is Python 3.9\n"


@pytest.mark.slow
def test_an_older_torch_stops_at_start_in_one_line():
    """requirements.txt's floor is MIN_TORCH, the oldest torch bench/compat.sh passes the suite on."""
    assert train_gpt2.torch_version_problem() is None and train_gpt2.torch_version_problem("2.9.1+cu128") is None
    assert f"torch>={train_gpt2.MIN_TORCH}\n" in open(os.path.join(ROOT, "requirements.txt")).read()
    path = os.path.join(ROOT, "train_gpt2.py")
    told = (f"import runpy, sys, torch; torch.__version__ = torch.torch_version.TorchVersion('2.6.0+cu124'); "
            f"sys.argv = [{path!r}, '--help']; runpy.run_path({path!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", told], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert result.stderr == f"train_gpt2.py: error: torch 2.6.0+cu124 is older than {train_gpt2.MIN_TORCH}, the " \
        f"oldest this code is tested on; pip install 'torch>={train_gpt2.MIN_TORCH}' (or a CUDA build of it for GPUs)\n"


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


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """A 20-step run with checkpoints at 10 and 20, on its own copy of the data (tests replace it)."""
    base = tmp_path_factory.mktemp("finished")
    prefix = str(base / "data" / "bytes")
    os.makedirs(os.path.dirname(prefix))
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, prefix + suffix)
    out = base / "out"
    assert train_gpt2.main(tiny(prefix, out, max_steps=20, index_mapping_dir=str(base / "cache"))) == 0
    return prefix, out


def rerun(finished, tmp_path, **overrides):
    """A copy of the finished run's out_dir (its step-10 checkpoint newest), rerun with overrides."""
    prefix, out = finished
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "ckpt" / "step_00000020")
    shutil.rmtree(copy / "hf")
    config = (copy / "train_config.json").read_text()
    args = tiny(prefix, copy, max_steps=20, index_mapping_dir=os.path.join(os.path.dirname(prefix), "..", "cache"))
    overrides = [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in overrides.items()]
    return copy, config, args + overrides


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", [
    (dict(split="80,20,0"), "split '90,10,0' -> '80,20,0'"),
    (dict(seed=7), "seed 1234 -> 7"),
    (dict(seq_length=16), "seq_length 32 -> 16"),
    (dict(max_steps=30_000), r"max_steps 20 -> 30000 \(the train split is then built in other epochs"),
])
def test_a_resume_refuses_what_would_change_the_tokens_or_their_order(finished, tmp_path, overrides, message):
    copy, config, args = rerun(finished, tmp_path, **overrides)
    with pytest.raises(ValueError, match=message) as error:
        train_gpt2.main(args)
    assert "resume_allow_data_change=True" in str(error.value) and "\n" not in str(error.value)
    assert (copy / "train_config.json").read_text() == config  # a refused run rewrites nothing


@pytest.mark.slow
def test_a_resume_refuses_other_data_at_the_same_path_unless_allowed(finished, tmp_path, capsys):
    prefix, out = finished
    other = str(tmp_path / "other" / "bytes")
    os.makedirs(os.path.dirname(other))
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, other + suffix)
    with open(other + ".bin", "r+b") as f:  # the same sizes, other tokens
        f.seek(100)
        f.write(b"\x07\x00" * 50)
    builder = IndexedDatasetBuilder(other + "2.bin", np.uint16)
    builder.add_document(np.full(40, 3, np.uint16))
    builder.finalize(other + "2.idx")
    copy, _, args = rerun(finished, tmp_path, data_paths=other)
    with pytest.raises(ValueError, match=r"data_paths .* -> .*; data .*bytes fingerprint"):
        train_gpt2.main(args)
    assert train_gpt2.main(args + ["--resume_allow_data_change=True"]) == 0
    assert "resuming with changed data (resume_allow_data_change)" in capsys.readouterr().out


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
def test_eval_only_past_max_steps_and_a_finished_rerun_does_nothing(finished, tmp_path, capsys):
    prefix, out = finished
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    args = tiny(prefix, copy, max_steps=20, index_mapping_dir=os.path.join(os.path.dirname(prefix), "..", "cache"))
    before = {name: (copy / name).read_bytes() for name in ("metrics.jsonl", "main.log", "train_config.json")}
    assert train_gpt2.main(args) == 0
    assert "this run is already complete" in capsys.readouterr().out
    assert {name: (copy / name).read_bytes() for name in before} == before
    assert train_gpt2.main(args + ["--eval_only=True", "--max_steps=5"]) == 0  # evaluation needs no step budget
    capsys.readouterr()
    assert train_gpt2.main(args + ["--seq_length=16", "--lr=1e-3"]) == 0  # what a finished run does not take is named
    said = capsys.readouterr().out
    assert "this run is already complete" in said and "the config differs from the run's (seq_length 32 -> 16; " \
        "lr 0.003 -> 0.001) and a finished run takes no change" in said


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


@pytest.mark.slow
def test_a_nonfinite_checkpoint_is_set_aside_and_the_older_one_resumed(finished, tmp_path, capsys):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    copy, _, args = rerun(finished, tmp_path)
    step10, step15 = copy / "ckpt" / "step_00000010", copy / "ckpt" / "step_00000015"
    shutil.copytree(step10, step15)
    dcp_to_torch_save(str(step10), str(tmp_path / "state.pt"))
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    moments = [key for key in state["optim"] if key.endswith(".exp_avg_sq")]
    state["optim"][moments[0]].fill_(-1.0)  # AdamW would take its square root
    shutil.rmtree(step15)
    shutil.copytree(step10, step15, ignore=shutil.ignore_patterns("*.distcp", ".metadata"))
    torch.save(state, tmp_path / "state.pt")
    torch_save_to_dcp(str(tmp_path / "state.pt"), str(step15))
    train_state = json.loads((step10 / "train_state.json").read_text())
    train_state["step"], train_state["consumed_samples"] = 15, 15 * 8
    (step15 / "train_state.json").write_text(json.dumps(train_state))
    (step15 / MARKER).unlink()
    (step15 / MARKER).write_text(json.dumps(dict(step=15, sizes=train_gpt2.fsync_tree(str(step15)))))
    assert train_gpt2.main(args) == 0
    said = capsys.readouterr().out
    assert re.search(r"skipping checkpoint .*step_00000015: .*negative or non-finite Adam moment", said)
    assert glob.glob(str(copy / "ckpt" / "step_00000015.damaged*"))


FULL_DISK = """
import resource, signal, sys
import train_gpt2
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))  # the index cache fits, a checkpoint not
train_gpt2.cli(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_naming_it(data, tmp_path):
    result = subprocess.run([sys.executable, "-c", FULL_DISK, *tiny(data, tmp_path / "out", n_embd=64)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert re.fullmatch(r"train_gpt2\.py: error: writing checkpoint .*step_00000010 failed( on rank 0)?: .*",
                        result.stderr.splitlines()[-1]), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path / "out" / "ckpt") == []


# The write of checkpoint step 20 stops inside its shard, in the thread that writes it, until the process is killed
# (kill -9) at the 25th optimizer step, once the write is known to be stopped there: no race with a sleep.
KILL_INSIDE_A_BACKGROUND_WRITE = """
import os, signal, sys, threading
import torch
import torch.distributed.checkpoint.filesystem as fs
import train_gpt2
inside, real_write, real_step, steps = threading.Event(), fs._write_item, torch.optim.AdamW.step, [0]
def write_item(transforms, stream, *rest, **kwargs):
    if "step_00000020.tmp" in stream.name:
        inside.set()
        threading.Event().wait()
    return real_write(transforms, stream, *rest, **kwargs)
def step(self, *args, **kwargs):
    result = real_step(self, *args, **kwargs)
    steps[0] += 1
    if steps[0] == 25:
        assert threading.current_thread() is threading.main_thread()
        inside.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return result
fs._write_item, torch.optim.AdamW.step = write_item, step
train_gpt2.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_kill9_inside_a_background_checkpoint_write_then_a_rerun_gives_the_uninterrupted_run(data, tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "killed"
    args = dict(max_steps=30, index_mapping_dir=str(tmp_path / "c"))
    assert train_gpt2.main(tiny(data, reference, **args)) == 0
    result = subprocess.run([sys.executable, "-c", KILL_INSIDE_A_BACKGROUND_WRITE, *tiny(data, out, **args)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert checkpoints(out) == ["step_00000010", "step_00000020.tmp"]
    assert max(metrics(out, "train_loss")) >= 22  # training went on while step 20 was written
    assert train_gpt2.main(tiny(data, out, **args)) == 0
    for key in ("train_loss", "val_loss", "grad_norm"):
        assert metrics(out, key) == metrics(reference, key)


@pytest.mark.parametrize("async_checkpoint", [True, False])
def test_a_full_disk_during_a_background_write_is_one_line_and_leaves_the_previous_checkpoint(
        data, tmp_path, monkeypatch, async_checkpoint):
    """In the background the error is raised at the next save (step 6), in the blocking save at once (step 4)."""
    import torch.distributed.checkpoint.filesystem as fs
    real_write = fs._write_item

    def write_item(transforms, stream, *rest, **kwargs):
        if "step_00000004" in stream.name:
            raise OSError(errno.ENOSPC, "No space left on device", stream.name)
        return real_write(transforms, stream, *rest, **kwargs)
    monkeypatch.setattr(fs, "_write_item", write_item)
    out = tmp_path / "full"
    args = tiny(data, out, max_steps=8, ckpt_every_steps=2, async_checkpoint=async_checkpoint)
    monkeypatch.setattr(sys, "argv", ["train_gpt2.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        train_gpt2.cli()
    assert re.fullmatch(r"train_gpt2\.py: error: .*step_00000004\.tmp/__0_0\.distcp: writing checkpoint "
                        r".*step_00000004 failed( on rank 0)?: No space left on device; the disk is full: free "
                        r"some space or choose another out_dir", exit_info.value.code)
    assert os.listdir(out / "ckpt") == ["step_00000002"]
    assert max(metrics(out, "train_loss")) == {True: 5, False: 3}[async_checkpoint]


@pytest.mark.slow
def test_wandb_gets_every_metric_and_a_resumed_run_continues_the_same_wandb_run(data, tmp_path):
    out = tmp_path / "out"
    env = dict(WANDB_MODE="offline", WANDB_SILENT="true")
    args = tiny(data, out, max_steps=20, wandb_log=True, wandb_project="tiny")
    assert script(*args, env=env).returncode == 0
    shutil.rmtree(out / "hf")
    shutil.rmtree(out / "ckpt" / "step_00000020")
    result = script(*args, "--max_steps=30", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and len({os.path.basename(r) for r in runs}) == 1  # one run id, resumed
    history = {}
    for path in runs:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                if "train_loss" in row:
                    history[row["step"]] = row["train_loss"]
    assert history == metrics(out, "train_loss") and len(history) == 30


def wandb_records(path):
    """The protobuf records of a .wandb file: a 7-byte header, then 32 KiB blocks of (crc32, length, type, data)
    chunks, the LevelDB log format; a record split over blocks is FIRST, MIDDLE..., LAST."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted 6-step run, a checkpoint every 2 steps, all kept."""
    out = tmp_path_factory.mktemp("reference")
    assert train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3)) == 0
    return out


def test_out_dir_that_is_not_a_run_directory_is_refused(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("the user's")
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_text("x")
    cases = {"": "out_dir is empty", ".": "current directory", str(tmp_path): "current directory",
             # the project's parent may hold the working directory too (a clone under /tmp): either reason will do
             os.path.dirname(ROOT): "(project|current) directory", str(foreign): "not a training run's directory",
             str(foreign / "cat.jpg"): "is a file"}
    for out_dir, message in cases.items():
        with pytest.raises(ValueError, match=message):
            train_gpt2.main(tiny(data, out_dir, max_steps=1, lr_warmup_steps=1))
    assert (tmp_path / "hf" / "mine.txt").read_text() == "the user's"
    assert sorted(os.listdir(foreign)) == ["cat.jpg"]


@pytest.mark.slow
def test_export_replaces_only_an_hf_dir_it_wrote(data, tmp_path):
    out = tmp_path / "run"
    train_gpt2.main(tiny(data, out, max_steps=2))
    assert os.path.isfile(out / "hf" / ".train_gpt2.json")
    (out / "hf" / "notes.txt").write_text("mine")  # the marker is still there: a later export replaces the whole hf/
    train_gpt2.main(tiny(data, out, max_steps=3))
    assert not os.path.exists(out / "hf" / "notes.txt")
    shutil.rmtree(out / "hf")
    (out / "hf").mkdir()
    (out / "hf" / "notes.txt").write_text("mine")  # no marker: moved aside, never deleted
    train_gpt2.main(tiny(data, out, max_steps=4))
    moved = [name for name in os.listdir(out) if name.startswith("hf.moved-")]
    assert len(moved) == 1 and (out / moved[0] / "notes.txt").read_text() == "mine"
    assert os.path.isfile(out / "hf" / "model.safetensors")
    assert not [name for name in os.listdir(out) if name.startswith(".hf.")]


@pytest.mark.slow
def test_fresh_run_moves_old_logs_aside_and_a_resumed_run_appends(data, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "main.log").write_text("s:0 trl:9.0000 lr:0.001 norm:1.00\n")
    (out / "main.log.1").write_text("older\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "train_loss": 9.0}\n')
    train_gpt2.main(tiny(data, out, max_steps=2))
    said = capsys.readouterr().out
    assert f"{out / 'main.log'} of an earlier run moved to {out / 'main.log.2'}" in said
    assert (out / "main.log.2").read_text() == "s:0 trl:9.0000 lr:0.001 norm:1.00\n"
    assert (out / "metrics.jsonl.1").read_text() == '{"step": 0, "train_loss": 9.0}\n'
    assert sorted(vislog(out / "main.log")["trl"]) == [0, 1]
    train_gpt2.main(tiny(data, out, max_steps=4))  # resumes from step 2: the same log goes on
    assert sorted(vislog(out / "main.log")["trl"]) == [0, 1, 2, 3] and not os.path.exists(out / "main.log.3")


@pytest.mark.slow
def test_a_torn_last_line_of_the_logs_is_cut_on_resume_and_said(data, tmp_path, capsys):
    out = tmp_path / "torn"
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=3))
    with open(out / "main.log", "a") as f:  # killed inside the writes of step 6's records
        f.write("s:6 trl:5.12")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train_lo')
    capsys.readouterr()
    train_gpt2.main(tiny(data, out, max_steps=9, ckpt_every_steps=3))
    said = capsys.readouterr().out
    assert f"{out / 'main.log'}: cut its partial last line (the run was killed while writing it): b's:6 trl:5.12'" \
        in said and f"{out / 'metrics.jsonl'}: cut its partial last line" in said
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 6, 9]
    streams = plot_log.parse_log(str(out / "main.log"))
    assert [step for step, _ in streams["tel"]] == [0, 6, 9] and [s for s, _ in streams["trl"]] == list(range(9))
    assert "skipped" not in capsys.readouterr().err


@pytest.mark.slow
def test_incomplete_checkpoint_is_moved_aside_and_rewritten(data, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "hf")
    os.remove(out / "ckpt" / "step_00000006" / MARKER)  # as if the write stopped before its marker
    assert [os.path.basename(p) for p in complete_checkpoints(str(out / "ckpt"))] == [
        "step_00000002", "step_00000004"]
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3))
    assert metrics(out, "train_loss") == metrics(reference, "train_loss")
    assert os.path.isfile(out / "ckpt" / "step_00000006" / MARKER)
    aside = [name for name in checkpoints(out) if name.startswith("step_00000006.incomplete-")]
    assert len(aside) == 1


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated shard", "missing shard", "empty rng.pt", "bad train_state.json",
                                    "no .metadata"])
def test_check_checkpoint_names_the_damaged_file(reference, tmp_path, damage):
    path = tmp_path / "step"
    shutil.copytree(reference / "ckpt" / "step_00000006", path)
    assert check_checkpoint(str(path)) is None
    name, text = {"truncated shard": ("__0_0.distcp", None), "missing shard": ("__0_0.distcp", None),
                  "empty rng.pt": ("rng.pt", b""), "bad train_state.json": ("train_state.json", b"{\"step\": 6,"),
                  "no .metadata": (".metadata", None)}[damage]
    if damage == "truncated shard":
        os.truncate(path / name, os.path.getsize(path / name) // 2)
    elif text is None:
        os.remove(path / name)
    else:
        (path / name).write_bytes(text)
    assert str(path / name) in check_checkpoint(str(path))


@pytest.mark.slow
def test_damaged_newest_checkpoint_is_skipped_named_and_kept(data, reference, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "hf")
    os.truncate(out / "ckpt" / "step_00000006" / "__0_0.distcp", 1000)
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3))
    said = capsys.readouterr().out
    assert f"skipping damaged checkpoint {out / 'ckpt' / 'step_00000006'}: " \
           f"{out / 'ckpt' / 'step_00000006' / '__0_0.distcp'}: truncated" in said
    assert metrics(out, "train_loss") == metrics(reference, "train_loss")
    assert [name for name in checkpoints(out) if name.startswith("step_00000006.damaged-")]

    # damage only the load notices: every rank gives up on it together and the next older one is loaded
    real_load = train_gpt2.dcp.load

    def failing_load(state, checkpoint_id, **kwargs):
        if checkpoint_id.endswith("step_00000006"):
            raise RuntimeError("unreadable shard")
        return real_load(state, checkpoint_id=checkpoint_id, **kwargs)
    monkeypatch.setattr(train_gpt2.dcp, "load", failing_load)
    shutil.rmtree(out / "hf")
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3))
    assert "failed to load (RuntimeError: unreadable shard)" in capsys.readouterr().out
    assert metrics(out, "train_loss") == metrics(reference, "train_loss")
    assert len([name for name in checkpoints(out) if ".damaged-" in name]) == 2



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
    assert (cfg.optimizer, cfg.muon_scalar_lr, cfg.min_lr / cfg.lr) == ("muon", 3 * adamw.lr, adamw.min_lr / adamw.lr)
    kept = lambda config: {k: v for k, v in vars(config).items() if "lr" not in k and "optimizer" not in k}  # noqa: E731
    assert kept(cfg) == dict(kept(adamw), out_dir="out_gpt2_124m_muon")


@pytest.mark.slow
def test_muon_ends_below_adamw_at_equal_steps_on_the_demo_model(tmp_path):
    """60 steps of the demo (its own settings, warmup 6): AdamW at the demo's lr against Muon with the optimizer keys
    of configs/gpt2_124m_muon.py, its AdamW part at the same multiple of the demo's lr (bench/bench_muon.py also
    compares them at equal wall time)."""
    data_dir = tmp_path / "shakespeare"
    subprocess.run([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), "--input",
                    os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--output-dir", str(data_dir), "--workers", "1"],
                   check=True, capture_output=True)
    demo, muon, recipe = (os.path.join(ROOT, "configs", name) for name in
                          ("demo_cpu.py", "gpt2_124m_muon.py", "gpt2_124m.py"))
    muon_cfg, recipe_cfg = train_gpt2.load_config([recipe, muon]), train_gpt2.load_config([recipe])
    scalar_lr = train_gpt2.load_config([demo]).lr * muon_cfg.muon_scalar_lr / recipe_cfg.lr
    val_loss = {}
    for name, extra in [("adamw", []), ("muon", ["--optimizer=muon", f"--lr={muon_cfg.lr}", f"--min_lr={muon_cfg.lr / 10}",
                                                 f"--muon_scalar_lr={scalar_lr}"])]:
        out = tmp_path / name
        train_gpt2.main([demo, f"--data_paths={str(data_dir / 'processed_data_0_text_document')!r}",
                         f"--out_dir={str(out)!r}", "--max_steps=60", "--lr_warmup_steps=6", "--val_every_steps=60",
                         "--sample_tokens=0", "--ckpt_every_steps=0", "--compile=False", *extra])
        val_loss[name] = metrics(out, "val_loss")[60]
    assert val_loss["muon"] < val_loss["adamw"], val_loss


def gpt2_token_dataset(prefix):
    """Shakespeare's first 2,000 paragraphs in GPT-2 tokens, each ending in EOT."""
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8").read()
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for block in text.split("\n\n")[:2000]:
        builder.add_document(np.array(gpt2_encoding().encode_ordinary(block) + [EOT_ID], np.uint16))
    builder.finalize(prefix + ".idx")
    return prefix


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


@pytest.fixture(scope="module")
def gpt2_vocab_run(tmp_path_factory):
    """Two steps of a 2-layer GPT-2 with the real vocabulary on Shakespeare tokens: its hf/ is what users load."""
    base = tmp_path_factory.mktemp("gpt2_vocab")
    prefix = gpt2_token_dataset(str(base / "shakespeare"))
    out = base / "out"
    assert train_gpt2.main(tiny(prefix, out, vocab_size=50257, max_steps=2, index_mapping_dir=str(base / "cache"))) == 0
    return out / "hf"


@pytest.mark.slow
def test_hf_export_holds_the_gpt2_tokenizer_and_transformers_pipeline_extends_a_prompt(gpt2_vocab_run):
    from transformers import AutoTokenizer, GenerationConfig, pipeline
    assert GenerationConfig.from_pretrained(gpt2_vocab_run).eos_token_id == EOT_ID
    tokenizer = AutoTokenizer.from_pretrained(gpt2_vocab_run)
    n_positions = json.loads((gpt2_vocab_run / "config.json").read_text())["n_positions"]
    assert tokenizer.model_max_length == n_positions == 32  # readers truncate to the model's context, not GPT-2's 1024
    assert len(tokenizer("ROMEO: " * 100, truncation=True)["input_ids"]) == n_positions
    for text in ("ROMEO:\nBut, soft! what light", "naïve café  \t<|endoftext|> 日本語"):
        assert tokenizer(text)["input_ids"] == gpt2_encoding().encode(text, allowed_special="all")
    generator = pipeline("text-generation", model=str(gpt2_vocab_run), device="cpu")
    out = generator("ROMEO:", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert out.startswith("ROMEO:") and len(tokenizer(out)["input_ids"]) > len(tokenizer("ROMEO:")["input_ids"])


@pytest.mark.slow
def test_hf_export_loads_the_way_lm_eval_harness_loads_it_and_scores_as_our_model(gpt2_vocab_run):
    """lm-eval's HFLM: AutoConfig, AutoTokenizer (fast), AutoModelForCausalLM, then a continuation's log-likelihood
    from the logits of context + continuation; here against model.py's own logits."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from model import load_model
    AutoConfig.from_pretrained(gpt2_vocab_run)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_vocab_run, use_fast=True)
    hf = AutoModelForCausalLM.from_pretrained(gpt2_vocab_run).eval()
    context, continuation = tokenizer("Good morrow,")["input_ids"], tokenizer(" sweet lady")["input_ids"]
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        ours = load_model(str(gpt2_vocab_run.parent))(tokens)[0]
        theirs = hf(tokens).logits
    loglik = [F.log_softmax(logits[0, len(context) - 1:-1], -1).gather(1, tokens[0, len(context):, None]).sum()
              for logits in (theirs, ours)]
    assert torch.allclose(loglik[0], loglik[1], atol=1e-4), loglik


@pytest.mark.slow
def test_a_blends_weights_are_said_at_every_start(data, tmp_path, capsys):
    other = str(tmp_path / "other")
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, other + suffix)
    blend = ["1", data, "3", other]
    for out in ("cold", "warm"):  # the second start finds the blend in the index cache
        train_gpt2.main(tiny(data, tmp_path / out, data_paths=blend, max_steps=2, val_tokens=0,
                             index_mapping_dir=str(tmp_path / "cache")))
        assert f"train blend: {data} 0.2500, {other} 0.7500" in capsys.readouterr().out


@pytest.mark.slow
def test_init_from_a_run_whose_newest_checkpoint_does_not_load_takes_the_one_before(finished, tmp_path, capsys):
    prefix, out = finished
    source = tmp_path / "source"
    shutil.copytree(out, source)
    metadata = source / "ckpt" / "step_00000020" / ".metadata"
    metadata.write_bytes(bytes(len(metadata.read_bytes())))  # the same size, so only loading finds it out
    args = tiny(prefix, tmp_path / "out", max_steps=2, index_mapping_dir=str(tmp_path / "cache"))
    assert train_gpt2.main(args + [f"--init_from={source}", "--n_layer=3", "--n_embd=64"]) == 0
    said = capsys.readouterr()
    assert re.search(r"init_from: skipping .*step_00000020: ", said.out)
    assert (source / "ckpt" / "step_00000020").is_dir()  # left in place: not this run's to set aside
    assert f"init_from: loaded the weights of {source / 'ckpt' / 'step_00000010'}" in said.out
    assert f"n_layer 2 from {source} (the config's 3 does not apply)" in said.out
    trained = json.loads((tmp_path / "out" / "train_config.json").read_text())
    assert (trained["n_layer"], trained["n_embd"]) == (2, 32)  # the model's sizes, not the config's
    with pytest.raises(ValueError, match=r"init_from .*step_00000020: no checkpoint loads") as error:
        train_gpt2.main(args + [f"--init_from={source / 'ckpt' / 'step_00000020'}", f"--out_dir={tmp_path / 'b'}"])
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_max_steps_can_change_on_a_glob_while_the_samples_consumed_stay_the_same(tmp_path, capsys):
    glob = small_byte_datasets(str(tmp_path), blocks_each=30)  # two prefixes, one epoch is more than 14 steps
    common = dict(split="100,0,0", val_tokens=0, ckpt_every_steps=5, index_mapping_dir=str(tmp_path / "cache"))
    out = tmp_path / "out"
    train_gpt2.main(tiny(glob, out, max_steps=10, **common))
    shutil.rmtree(out / "ckpt" / "step_00000010")
    shutil.rmtree(out / "hf")
    refused = tmp_path / "refused"
    shutil.copytree(out, refused)
    capsys.readouterr()
    assert train_gpt2.main(tiny(glob, out, max_steps=14, **common)) == 0  # resumes at step 5
    assert list(metrics(out, "train_loss")) == list(range(14))
    # past one epoch the glob is blended by token count: the 40 samples consumed are others
    with pytest.raises(ValueError, match=r"max_steps 10 -> 200 \(the train split is then built in other epochs or "
                                         r"blended otherwise: the 40 samples consumed differ\)"):
        train_gpt2.main(tiny(glob, refused, max_steps=200, **common))


@pytest.mark.slow
def test_init_from_and_eval_only_of_a_live_run_that_deletes_the_chosen_checkpoint_take_its_newer_one(
        finished, tmp_path, monkeypatch, capsys):
    prefix, out = finished
    source = tmp_path / "live"
    shutil.copytree(out, source)
    real_load_weights = train_gpt2.load_weights

    def load_while_the_run_moves_on(path, model):  # the live run (ckpt_keep=1) writes step 30, deletes step 20
        if path.endswith("step_00000020"):
            os.rename(path, source / "ckpt" / "step_00000030")
        return real_load_weights(path, model)

    monkeypatch.setattr(train_gpt2, "load_weights", load_while_the_run_moves_on)
    args = tiny(prefix, tmp_path / "out", max_steps=2, init_from=str(source), index_mapping_dir=str(tmp_path / "c"))
    for extra in ([], ["--eval_only=True", f"--out_dir={tmp_path / 'eval'}"]):
        assert train_gpt2.main(args + extra) == 0
        assert f"init_from: loaded the weights of {source / 'ckpt' / 'step_00000030'}" in capsys.readouterr().out
        os.rename(source / "ckpt" / "step_00000030", source / "ckpt" / "step_00000020")


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
    cfg = train_gpt2.load_config(["--optimizer=muon", "--lr=0.02", "--muon_scalar_lr=0.01", "--weight_decay=0.1"])
    model = GPT(GPTConfig(block_size=16, vocab_size=64, padded_vocab_size=None, n_layer=2, n_head=2, n_embd=16))
    muon, adamw = train_gpt2.build_optimizer(model, cfg, torch.device("cpu"))
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    matrices = [p for p in model.transformer.h.parameters() if p.dim() == 2]
    assert [p for group in muon.param_groups for p in group["params"]] == matrices
    held = [p for opt in (muon, adamw) for group in opt.param_groups for p in group["params"]]
    assert len(held) == len({id(p) for p in held}) == len(list(model.parameters()))
    scalar, embedding = adamw.param_groups
    assert (scalar["lr_scale"], scalar["weight_decay"], embedding["lr_scale"], embedding["weight_decay"]) == \
        (0.5, 0.1, 0.5, 0.0)
    assert embedding["params"] == [model.transformer.wte.weight, model.transformer.wpe.weight]
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


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to mount")
def test_a_really_full_disk_during_a_checkpoint_says_the_disk_is_full(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(out)], check=True)
    try:
        result = script(*tiny(data, out, index_mapping_dir=str(tmp_path / "cache")))
        last = result.stderr.splitlines()[-1]
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "step_00000010 failed" in last and "No space left on device" in last, last
        assert last.endswith("the disk is full: free some space or choose another out_dir")
        assert os.listdir(out / "ckpt") == []
    finally:
        subprocess.run(["umount", str(out)], check=True)


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
def test_every_checkpoint_failing_its_size_check_is_refused_not_restarted(finished, tmp_path):
    prefix, out = finished
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "hf")
    for name in checkpoints(copy):
        with open(copy / "ckpt" / name / "train_state.json", "a") as f:
            f.write(" ")  # its size no longer matches the marker's
    args = tiny(prefix, copy, max_steps=20, index_mapping_dir=str(tmp_path / "cache"))
    for _ in range(2):  # refused again on the rerun, when the damaged ones are already aside
        with pytest.raises(ValueError, match="no checkpoint is usable"):
            train_gpt2.main(args)
    assert metrics(copy, "train_loss") == metrics(out, "train_loss")


@pytest.mark.slow
def test_a_data_error_mid_run_saves_the_last_good_step_and_the_rerun_resumes_it(
        data, tmp_path, monkeypatch):
    args = tiny(data, tmp_path / "out", max_steps=20, index_mapping_dir=str(tmp_path / "c"))
    reference = tmp_path / "reference"
    train_gpt2.main(tiny(data, reference, max_steps=20, index_mapping_dir=str(tmp_path / "c")))
    real_host_batch, calls = train_gpt2.host_batch, []

    def fails_once(dataset, indices, *rest):
        if threading.current_thread() is not threading.main_thread():  # the training batches
            calls.append(1)
            if len(calls) == 28:  # the 14th step's batches: the file shrank under the run
                raise ValueError("data/x.bin: shrank from 100 to 50 bytes while the run read it")
        return real_host_batch(dataset, indices, *rest)

    monkeypatch.setattr(train_gpt2, "host_batch", fails_once)
    with pytest.raises(ValueError, match="shrank"):
        train_gpt2.main(args)
    saved = checkpoints(tmp_path / "out")
    assert saved[-1] > "step_00000010", saved  # past the periodic checkpoint
    monkeypatch.setattr(train_gpt2, "host_batch", real_host_batch)
    assert train_gpt2.main(args) == 0
    assert metrics(tmp_path / "out", "train_loss") == metrics(reference, "train_loss")


def test_out_of_gpu_memory_is_one_line_saying_what_to_lower(data, tmp_path, monkeypatch):
    def out_of_memory(cfg, restore_signals=True):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_gpt2, "run", out_of_memory)
    with pytest.raises(SystemExit) as stopped:
        train_gpt2.cli(tiny(data, tmp_path / "out"))
    assert str(stopped.value).startswith("train_gpt2.py: error: out of GPU memory; lower "
                                         "local_batch_size")


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
    from model import load_model
    theirs = GPT2LMHeadModel.from_pretrained(out / "hf").eval()
    ours = load_model(str(out / "hf"))
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], theirs(tokens).logits)
    plain = tmp_path / "plain"
    train_gpt2.main(tiny(data, plain, max_steps=20, index_mapping_dir=str(tmp_path / "c")))
    assert metrics(plain, "train_loss")[19] != full[19]
