"""run_dir.py: an out_dir that is not a run's is refused, and one run at a time trains in it (its lock); a fresh
run moves older logs aside, a resumed one appends and cuts a torn last line; a finished run's rerun does nothing;
wandb; the final hf/ export (replacing only an hf/ it wrote; the GPT-2 tokenizer; loaded as lm-eval-harness does)."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import plot_log
import train_gpt2
from checkpoint import load_model
from conftest import ROOT, gpt2_token_dataset, metrics, script, tiny, vislog
from processes import SPACE, error_line
from run_dir import RunLog, cut_torn_line, lock_out_dir, prepare_out_dir, unlock_out_dirs
from tokenizer import EOT_ID, gpt2_encoding

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ----------------------------------------------------------------------------- the out_dir and its lock

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


def test_one_lock_per_out_dir_naming_its_holder_until_it_is_dropped(tmp_path):
    """flock: a second taker is refused even in the same process (another open file); unlock_out_dirs, as run()
    calls it on the way out, lets the next run in."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    lock_out_dir(out)
    try:
        with pytest.raises(ValueError) as refused:
            lock_out_dir(out)
        assert str(refused.value) == (
            f"{out}: another run is training in this out_dir ({out}/.lock is held by pid {os.getpid()} on host "
            f"{os.uname().nodename}); wait for it to end, stop it, or choose another out_dir")
    finally:
        unlock_out_dirs()
    lock_out_dir(out)
    unlock_out_dirs()


@pytest.mark.slow
def test_second_run_on_a_locked_out_dir_fails_naming_the_holder(data, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"import run_dir, time; run_dir.lock_out_dir({str(out)!r}); "
                               f"print('locked', flush=True); time.sleep(120)"], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ValueError, match=rf"another run is training in this out_dir .*held by pid {holder.pid} "
                                             rf"on host"):
            train_gpt2.main(tiny(data, out, max_steps=1, lr_warmup_steps=1))
    finally:
        holder.send_signal(signal.SIGKILL)  # the OS drops the lock of a killed holder: no stale lock
        holder.wait()
    assert train_gpt2.main(tiny(data, out, max_steps=1, lr_warmup_steps=1)) == 0


# ----------------------------------------------------------------------------- the logs

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


def test_a_torn_last_line_is_cut_and_a_whole_one_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert cut_torn_line(str(path)) is None  # no file yet
    path.write_text('{"step": 5}\n{"step": 6, "train_lo')
    assert cut_torn_line(str(path)) == (f"{path}: cut its partial last line (the run was killed while writing it): "
                                        "b'{\"step\": 6, \"train_lo'")
    assert path.read_text() == '{"step": 5}\n'
    assert cut_torn_line(str(path)) is None and path.read_text() == '{"step": 5}\n'


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


# ----------------------------------------------------------------------------- a finished run

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


# ----------------------------------------------------------------------------- the hf/ export

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


@pytest.fixture(scope="module")
def gpt2_vocab_run(tmp_path_factory):
    """Two steps of a 2-layer GPT-2 with the real vocabulary on Shakespeare tokens: its hf/ is what users load."""
    base = tmp_path_factory.mktemp("gpt2_vocab")
    prefix = gpt2_token_dataset(str(base / "shakespeare"))
    out = base / "out"
    assert train_gpt2.main(tiny(prefix, out, vocab_size=50257, max_steps=2, index_mapping_dir=str(base / "cache"))) == 0
    return out / "hf"


@pytest.mark.gpt2
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


@pytest.mark.gpt2
@pytest.mark.slow
def test_hf_export_loads_the_way_lm_eval_harness_loads_it_and_scores_as_our_model(gpt2_vocab_run):
    """lm-eval's HFLM: AutoConfig, AutoTokenizer (fast), AutoModelForCausalLM, then a continuation's log-likelihood
    from the logits of context + continuation; here against model.py's own logits."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
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


@pytest.mark.parametrize("name", ["main.log", "metrics.jsonl"])
def test_a_full_disk_while_a_log_is_appended_names_the_file(tmp_path, name):
    os.symlink("/dev/full", tmp_path / name)  # every write to /dev/full fails as a full disk does
    with pytest.raises(OSError) as excinfo:
        RunLog(str(tmp_path))("step 1", "s:1 trl:1.0000", step=1, train_loss=1.0)
    assert error_line(excinfo.value) == f"{tmp_path / name}: No space left on device; {SPACE}"


def test_a_file_named_like_an_interrupted_checkpoint_is_removed_and_the_run_starts(tmp_path):
    (tmp_path / "out" / "ckpt").mkdir(parents=True)
    (tmp_path / "out" / "ckpt" / "step_00000004.tmp").write_text("not a checkpoint directory")
    try:
        assert prepare_out_dir(str(tmp_path / "out"), eval_only=False) is None
    finally:
        unlock_out_dirs()
    assert os.listdir(tmp_path / "out" / "ckpt") == []
