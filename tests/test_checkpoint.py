"""checkpoint.py: what it writes (whole or not at all, in the background or not, on a full disk), what it reads back
(damaged files, non-finite numbers, a live run that moves on while a checkpoint is read), the checks of a resume (the
tokens and their order) and init_from a run or one of its checkpoints."""
import dataclasses
import errno
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
import train_gpt2
from atomic_io import lock_file
from conftest import ROOT, checkpoints, metrics, randomize, rerun, script, small_byte_datasets, tiny
from checkpoint import (MARKER, check_checkpoint, complete_checkpoints, load_model, load_weights,
                        newest_usable_checkpoint)
from indexed_dataset import IndexedDatasetBuilder
from model import GPT, GPTConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ----------------------------------------------------------------------------- a run's checkpoints, read-only

def write_checkpoint(run, step, model):
    """A checkpoint laid out as train_gpt2.py writes it: DCP model files, rng.pt, train_state.json, then the marker
    with every file's size and CRC-32."""
    path = run / "ckpt" / f"step_{step:08d}"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path))
    torch.save({"torch": torch.get_rng_state()}, path / "rng.pt")
    (path / "train_state.json").write_text(json.dumps(dict(step=step, consumed_samples=8 * step,
                                                           model_config=dataclasses.asdict(model.config))))
    (path / MARKER).write_text(json.dumps(dict(step=step, files=checkpoint.fsync_tree(str(path)))))
    return path


def gpt2_vocab_model(seed):
    return randomize(GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)), seed)


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("damage", ["truncated", "nan"])
def test_load_model_skips_a_damaged_newest_checkpoint_and_renames_nothing(tmp_path, capsys, damage):
    run = tmp_path / "run"
    good = gpt2_vocab_model(1)
    write_checkpoint(run, 10, good)
    bad = gpt2_vocab_model(2)
    if damage == "nan":
        with torch.no_grad():
            bad.transformer.h[0].mlp.c_fc.weight[3, 4] = float("nan")
    newest = write_checkpoint(run, 20, bad)
    if damage == "truncated":
        shard = next(newest.glob("*.distcp"))
        os.truncate(shard, os.path.getsize(shard) // 2)
    before = sorted(os.listdir(run / "ckpt"))
    assert same_weights(load_model(str(run)), good)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"skipping damaged checkpoint {newest}: ")
    assert said[0].endswith("left in place") and ("truncated" if damage == "truncated" else "NaN or inf") in said[0]
    assert sorted(os.listdir(run / "ckpt")) == before
    # named directly, the checkpoint is loaded as named, and refused in one line when it cannot be
    if damage == "nan":
        with pytest.raises(ValueError, match=r"step_00000020: the weights hold NaN or inf \(transformer\.h\.0\.mlp"):
            load_model(str(newest))
        # the resume path (not read-only) renames it aside, like any damaged checkpoint
        found, messages = newest_usable_checkpoint(str(run / "ckpt"), load=lambda path: load_weights(path, bad))
        assert found == str(run / "ckpt" / "step_00000010") and "kept as" in messages[0]
        assert [name for name in os.listdir(run / "ckpt") if name.startswith("step_00000020.damaged-")]


def test_a_checkpoint_deleted_while_it_is_read_sends_the_reader_to_the_newer_one(tmp_path, capsys):
    """A live run with ckpt_keep=1 writes step 20 and deletes step 10 while a reader loads step 10: the reader
    looks again and loads step 20, and calls nothing damaged."""
    run = tmp_path / "run"
    write_checkpoint(run, 10, gpt2_vocab_model(1))
    newer = gpt2_vocab_model(2)
    tried = []

    def load(path):
        tried.append(os.path.basename(path))
        if len(tried) == 1:  # the run moves on in the middle of this read
            write_checkpoint(run, 20, newer)
            shutil.rmtree(path)
            raise RuntimeError(f"{path}/.metadata: No such file or directory (metadata is None)")
        return load_weights(path, model)

    model = gpt2_vocab_model(3)
    found, messages = newest_usable_checkpoint(str(run / "ckpt"), read_only=True, load=load)
    assert found.endswith("step_00000020") and messages == [] and tried == ["step_00000010", "step_00000020"]
    assert same_weights(model, newer)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_sample_cli_with_a_damaged_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run, 10, gpt2_vocab_model(1))
    newest = write_checkpoint(run, 20, gpt2_vocab_model(2))
    (newest / "rng.pt").write_bytes(b"")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--model", str(run), "--prompt", "Hi",
                             "--num-samples", "1", "--max-new-tokens", "3", "--device", "cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--- sample 1/1 ---" in result.stdout and "Traceback" not in result.stderr
    said = result.stderr.strip().splitlines()
    assert len(said) == 1
    assert said[0].startswith(f"skipping damaged checkpoint {newest}: {newest / 'rng.pt'}: truncated")
    assert said[0].endswith("left in place")
    assert os.path.isdir(newest)


@pytest.mark.parametrize("cli", ["sample.py", "hellaswag.py"])
@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_damaged_checkpoint_named_outright_is_one_line(tmp_path, cli, damage):
    """Named outright, there is nothing older to fall back on: one line naming it and what is wrong."""
    step = write_checkpoint(tmp_path / "run", 10, gpt2_vocab_model(1))
    shard = step / "__0_0.distcp"
    if damage == "truncated":
        os.truncate(shard, 100)
    else:  # its size and the marker as written, its bytes not: DCP alone would fail with a traceback
        shard.write_bytes(bytes(os.path.getsize(shard)))
        (step / MARKER).unlink()
        (step / MARKER).write_text(json.dumps(dict(step=10, files=checkpoint.fsync_tree(str(step)))))
    example = dict(ctx="A man", endings=["sits.", "runs.", "eats.", "sleeps."], label=0)
    (tmp_path / "hellaswag.jsonl").write_text(json.dumps(example) + "\n")
    args = ["--prompt", "Hi", "--max-new-tokens", "3"]
    if cli == "hellaswag.py":
        args = ["--data", str(tmp_path / "hellaswag.jsonl")]
    result = subprocess.run([sys.executable, os.path.join(ROOT, cli), "--model", str(step), "--device", "cpu", *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"{cli}: error: {step}: not a usable checkpoint: ")


# ----------------------------------------------------------------------------- writing checkpoints

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


@pytest.mark.slow
def test_sigterm_while_a_background_write_is_in_flight_finishes_it_then_checkpoints_the_stop(
        data, tmp_path, monkeypatch):
    """A preemption (or a requeue) that lands while checkpoint step 20 is still being written: the write is
    finished first, the stop step is checkpointed, and the rerun gives the uninterrupted run."""
    import torch.distributed.checkpoint.filesystem as fs
    reference, out = tmp_path / "reference", tmp_path / "stopped"
    args = dict(max_steps=30, index_mapping_dir=str(tmp_path / "c"))
    assert train_gpt2.main(tiny(data, reference, **args)) == 0
    real_write, real_step, steps = fs._write_item, torch.optim.AdamW.step, [0]
    inside, release = threading.Event(), threading.Event()

    def write_item(transforms, stream, *rest, **kwargs):
        if "step_00000020.tmp" in stream.name:
            inside.set()
            release.wait(60)  # held until after the signal
        return real_write(transforms, stream, *rest, **kwargs)

    def step(self, *rest, **kwargs):
        result = real_step(self, *rest, **kwargs)
        steps[0] += 1
        if steps[0] == 22:  # two steps trained since the write began
            assert inside.wait(60)
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Timer(0.5, release.set).start()
        return result

    monkeypatch.setattr(fs, "_write_item", write_item)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert train_gpt2.main(tiny(data, out, **args)) == 128 + signal.SIGTERM
    assert checkpoints(out) == ["step_00000020", "step_00000022"]
    assert all(check_checkpoint(str(out / "ckpt" / name)) is None for name in checkpoints(out))
    monkeypatch.undo()
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
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to mount")
@pytest.mark.parametrize("size, failed, kept", [("300k", 10, []), ("1100k", 20, ["step_00000010"])])
def test_a_really_full_disk_during_a_background_checkpoint_says_the_disk_is_full(data, tmp_path, size, failed, kept):
    """The disk fills during the first checkpoint, or during the second with the first kept: either way one line
    naming the checkpoint and the full disk (the error is read before the failed write's files are removed, which
    frees the space), and the run moved to a larger disk resumes to the uninterrupted losses."""
    out = tmp_path / "out"
    out.mkdir()
    args = tiny(data, out, index_mapping_dir=str(tmp_path / "cache"), max_steps=30)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(out)], check=True)
    try:
        result = script(*args)
        last = result.stderr.splitlines()[-1]
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert f"step_{failed:08d} failed" in last and "No space left on device" in last, last
        assert last.endswith("the disk is full: free some space or choose another out_dir")
        assert sorted(os.listdir(out / "ckpt")) == kept
        shutil.copytree(out, tmp_path / "larger")
    finally:
        subprocess.run(["umount", str(out)], check=True)
    moved = tiny(data, tmp_path / "larger", index_mapping_dir=str(tmp_path / "cache"), max_steps=30)
    assert script(*moved).returncode == 0
    whole = tiny(data, tmp_path / "whole", index_mapping_dir=str(tmp_path / "cache"), max_steps=30)
    assert script(*whole).returncode == 0
    assert metrics(tmp_path / "larger", "val_loss")[30] == metrics(tmp_path / "whole", "val_loss")[30]


# ----------------------------------------------------------------------------- a run's damaged checkpoints

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
    (step15 / MARKER).write_text(json.dumps(dict(step=15, files=checkpoint.fsync_tree(str(step15)))))
    assert train_gpt2.main(args) == 0
    said = capsys.readouterr().out
    assert re.search(r"skipping checkpoint .*step_00000015: .*negative or non-finite Adam moment", said)
    assert glob.glob(str(copy / "ckpt" / "step_00000015.damaged*"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted 6-step run, a checkpoint every 2 steps, all kept."""
    out = tmp_path_factory.mktemp("reference")
    assert train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3)) == 0
    return out


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
                                    "no .metadata", "bytes changed in a shard"])
def test_check_checkpoint_names_the_damaged_file(reference, tmp_path, damage):
    path = tmp_path / "step"
    shutil.copytree(reference / "ckpt" / "step_00000006", path)
    assert check_checkpoint(str(path)) is None
    name, text = {"truncated shard": ("__0_0.distcp", None), "missing shard": ("__0_0.distcp", None),
                  "empty rng.pt": ("rng.pt", b""), "bad train_state.json": ("train_state.json", b"{\"step\": 6,"),
                  "no .metadata": (".metadata", None), "bytes changed in a shard": ("__0_0.distcp", None)}[damage]
    if damage == "truncated shard":
        os.truncate(path / name, os.path.getsize(path / name) // 2)
    elif damage == "bytes changed in a shard":  # a bad disk block: the size stays, DCP would load it
        with open(path / name, "r+b") as f:
            f.seek(os.path.getsize(path / name) // 2)
            f.write(bytes(4096))
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
    real_load = checkpoint.dcp.load

    def failing_load(state, checkpoint_id, **kwargs):
        if checkpoint_id.endswith("step_00000006"):
            raise RuntimeError("unreadable shard")
        return real_load(state, checkpoint_id=checkpoint_id, **kwargs)
    monkeypatch.setattr(checkpoint.dcp, "load", failing_load)
    shutil.rmtree(out / "hf")
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3))
    assert "failed to load (RuntimeError: unreadable shard)" in capsys.readouterr().out
    assert metrics(out, "train_loss") == metrics(reference, "train_loss")
    assert len([name for name in checkpoints(out) if ".damaged-" in name]) == 2


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


# ----------------------------------------------------------------------------- a resume's checks of the data

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


# ----------------------------------------------------------------------------- init_from a run or a checkpoint

def test_init_from_a_live_run_is_refused_in_one_line_and_its_checkpoint_named_directly_loads(
        data, tmp_path, capsys):
    """A run still training may delete a checkpoint while another run reads it (ckpt_keep): init_from naming the run
    (here its out_dir/.lock is held by this process, as a live run holds it) is refused at once, for a training run
    and an evaluation alike, naming a checkpoint to take instead; that checkpoint, named, loads while the run goes
    on."""
    source = tmp_path / "live"
    assert train_gpt2.main(tiny(data, source, max_steps=4, ckpt_every_steps=2, val_tokens=0)) == 0
    newest = source / "ckpt" / "step_00000004"
    lock = lock_file(str(source / ".lock"))
    try:
        for extra in ([], ["--eval_only=True"]):
            out = tmp_path / f"out{len(extra)}"
            with pytest.raises(SystemExit) as stopped:  # sys.exit(line): the line on stderr, exit status 1
                train_gpt2.cli(tiny(data, out, max_steps=2, init_from=str(source)) + extra)
            assert stopped.value.code == (
                f"train_gpt2.py: error: init_from {source}: that run is still training (pid {os.getpid()} on host "
                f"{os.uname().nodename}) and may delete its checkpoints while they are read; name one, e.g. {newest}")
            assert os.listdir(out / "ckpt") == []
        capsys.readouterr()
        named = tmp_path / "named"
        assert train_gpt2.main(tiny(data, named, max_steps=2, init_from=str(newest))) == 0
        assert f"init_from: loaded the weights of {newest}" in capsys.readouterr().out
        assert checkpoints(named) == ["step_00000002"]
    finally:
        os.close(lock)


@pytest.mark.slow
def test_init_from_a_checkpoint_whose_weights_do_not_load_is_one_line_and_leaves_it_in_place(
        finished, tmp_path, capsys):
    """The run's newest checkpoint, or the same one named, whose weights fail to load stops the run in one line;
    the checkpoint is not this run's to set aside. An intact one named directly gives its architecture."""
    prefix, out = finished
    source = tmp_path / "source"
    shutil.copytree(out, source)
    newest = source / "ckpt" / "step_00000020"
    metadata = newest / ".metadata"
    metadata.write_bytes(bytes(len(metadata.read_bytes())))
    # The marker written over it again, as if the writer had written the zeros: only loading finds them out.
    (newest / MARKER).unlink()
    (newest / MARKER).write_text(json.dumps(dict(step=20, files=checkpoint.fsync_tree(str(newest)))))
    args = tiny(prefix, tmp_path / "out", max_steps=2, index_mapping_dir=str(tmp_path / "cache"))
    for init_from in (source, newest):
        with pytest.raises(ValueError, match=rf"^init_from {re.escape(str(newest))}: its weights do not load "
                                             r"\(.+\)$") as error:
            train_gpt2.main(args + [f"--init_from={init_from}", "--n_layer=3", "--n_embd=64"])
        assert "\n" not in str(error.value)
        assert os.listdir(tmp_path / "out" / "ckpt") == []
    assert newest.is_dir() and not glob.glob(str(newest) + ".damaged-*")  # left in place
    capsys.readouterr()
    older = source / "ckpt" / "step_00000010"
    assert train_gpt2.main(args + [f"--init_from={older}", "--n_layer=3", "--n_embd=64"]) == 0
    said = capsys.readouterr().out
    assert f"init_from: loaded the weights of {older}" in said
    assert f"n_layer 2 from {older} (the config's 3 does not apply)" in said
    trained = json.loads((tmp_path / "out" / "train_config.json").read_text())
    assert (trained["n_layer"], trained["n_embd"]) == (2, 32)  # the model's sizes, not the config's


@pytest.mark.slow
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_checkpoint_file_zeroed_in_place_is_named_and_never_loaded(finished, tmp_path, name):
    """The size stays, so only the CRC-32 in complete.json tells; DCP would load the shard's zeros, or log
    tracebacks of its own for the metadata. The run's only checkpoint: the rerun refuses in one line."""
    copy, _, args = rerun(finished, tmp_path)
    damaged = copy / "ckpt" / "step_00000010" / name
    damaged.write_bytes(bytes(os.path.getsize(damaged)))
    result = script(*args)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{damaged}: its bytes changed since it was written (CRC-32 differs)" in result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"train_gpt2.py: error: {copy / 'ckpt'}: no checkpoint is "
                                                     "usable (damaged ones were renamed")


def test_a_short_write_in_torchs_zip_writer_says_the_disk_is_full_whatever_the_free_space_is_by_then(tmp_path):
    """Rank 0 removes a failed write at once, which frees the space: another rank that looks at the disk after
    that still reads torch's words for a short write as the full disk they are."""
    from processes import SPACE, error_line
    final = str(tmp_path / "ckpt" / "step_00000004")
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert error_line(checkpoint.checkpoint_error(short, final)) == (
        f"writing checkpoint {final} failed: No space left on device; {SPACE}")
