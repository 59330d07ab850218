"""train_gpt2.py on CPU: 1 rank == 2 ranks (FSDP2, gloo), accumulation, exact resume after kill -9 / SIGTERM / a kill
during a checkpoint write, resume on another world size, NaN stop, init from Hugging Face weights and export back,
config errors, and the quick-start demo end to end with main.log read the way llm.c's vislog reads it.

Most runs use a byte-level Shakespeare dataset (vocabulary 512) and a 2-layer model: the tokenizer is not the subject.
Tolerances: the same run resumed on the same world size is bit-identical. Across world sizes (or accumulation
splits) fp32 sums are reduced in another order: losses and grad norms agree to 1e-5 absolute over the 60 steps
(measured: under 1e-6; at lr 1e-2 this tiny model has loss spikes that amplify last-bit differences, so lr is 3e-3).
"""
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, checkpoints, metrics, process_tree, run, tiny, torchrun, vislog, wait_for_line
from model import load_model, resolve_checkpoint
import train_gpt2
from indexed_dataset import sequential_samples

# single-process runs save and load checkpoints without a process group on purpose
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# 1 process vs 2 FSDP2 ranks sum gradients and losses in another order; the largest difference measured on this test
# was 1.43e-5 (train loss after a cross-world-size resume), so runs on different world sizes agree to 2e-5
CROSS_WORLD_TOL = 2e-5
def assert_close(a, b, tol):
    assert a.keys() == b.keys()
    worst = max(abs(a[k] - b[k]) for k in a)
    assert worst <= tol, f"max difference {worst} > {tol}"


def assert_same_trajectory(run_a, run_b, keys=("train_loss", "val_loss", "grad_norm")):
    for key in keys:
        assert_close(metrics(run_a, key), metrics(run_b, key), CROSS_WORLD_TOL)


@pytest.fixture(scope="module")
def one_process_run(data, tmp_path_factory):
    """The reference single-process run (local batch 4, accumulation 2)."""
    out = tmp_path_factory.mktemp("one_process")
    train_gpt2.main(tiny(data, out))
    return str(out)


@pytest.fixture(scope="module")
def two_rank_run(data, tmp_path_factory):
    """The reference 2-rank FSDP2 run (local batch 4, no accumulation)."""
    out = tmp_path_factory.mktemp("two_ranks")
    run(torchrun(tiny(data, out)))
    return str(out)


def test_one_and_two_ranks_give_the_same_run(one_process_run, two_rank_run):
    one = vislog(os.path.join(one_process_run, "main.log"))
    assert sorted(one["trl"]) == list(range(60)) and sorted(one["tel"]) == [0, 10, 20, 30, 40, 50, 60]
    assert one["trl"][0] == pytest.approx(np.log(512), abs=0.1) and one["trl"][59] < one["trl"][0] - 2
    assert_same_trajectory(one_process_run, two_rank_run)

    # the schedule is torch's own warmup + cosine: linear (step + 1) / 2 for 2 steps, then cosine to min_lr 0
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=3e-3)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, end_factor=1.0, total_iters=1),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=58, eta_min=0.0)], milestones=[2])
    expected = {}
    for step in range(60):
        expected[step] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    assert_close(metrics(one_process_run, "lr"), expected, 1e-12)
    # llm.c's exact line formats
    with open(os.path.join(one_process_run, "main.log")) as f:
        lines = f.read().splitlines()
    train_lines = [re.fullmatch(r"s:(\d+) trl:\d+\.\d{4} lr:(\d\.\d{6}) norm:\d+\.\d{2}", line) for line in lines
                   if " trl:" in line]
    assert all(train_lines) and len(train_lines) == 60
    assert {int(m.group(1)): float(m.group(2)) for m in train_lines} == {s: round(v, 6) for s, v in expected.items()}
    assert all(re.fullmatch(r"s:\d+ tel:\d+\.\d{4}", line) for line in lines if " trl:" not in line)

    # the final weights, exported for transformers, give the logits of the final checkpoint
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(os.path.join(two_rank_run, "hf")).eval()
    ours = load_model(two_rank_run).eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens)[0], atol=1e-5, rtol=1e-5)
    assert checkpoints(two_rank_run) == ["step_00000050", "step_00000060"]  # ckpt_keep = 2


def test_gradient_accumulation_4x1_equals_1x4_and_padding_changes_nothing(data, tmp_path):
    train_gpt2.main(tiny(data, tmp_path / "a", global_batch_size=4, local_batch_size=4, max_steps=12))
    train_gpt2.main(tiny(data, tmp_path / "b", global_batch_size=4, local_batch_size=1, max_steps=12))
    assert_same_trajectory(tmp_path / "a", tmp_path / "b")
    # padded_vocab_size only adds never-used rows to wte/lm_head: same init, same run
    train_gpt2.main(tiny(data, tmp_path / "c", global_batch_size=4, local_batch_size=4, max_steps=12,
                         padded_vocab_size=576))
    assert_same_trajectory(tmp_path / "a", tmp_path / "c")


def test_kill9_then_resume_is_exact_and_resumes_on_another_world_size(data, two_rank_run, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(torchrun(tiny(data, out)), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_line(out / "main.log", r"^s:25 trl", proc)
    finally:
        for pid in reversed(process_tree(proc.pid)):  # the workers, then torchrun
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    logged = vislog(out / "main.log")["trl"]
    assert 25 <= max(logged) < 59
    resume_step = int(checkpoints(out)[-1][len("step_"):])
    assert resume_step >= 20
    shutil.copytree(out, tmp_path / "killed_copy")

    run(torchrun(tiny(data, out)))
    reference = metrics(two_rank_run, "train_loss")
    assert metrics(out, "train_loss") == reference  # bit for bit, also the steps logged twice
    assert vislog(out / "main.log") == vislog(os.path.join(two_rank_run, "main.log"))
    with open(out / "main.log") as f:
        assert f.read().count(f"s:{resume_step} trl:") == 2  # appended, never rewritten

    train_gpt2.main(tiny(data, tmp_path / "killed_copy"))  # 2 ranks -> 1 process
    assert_same_trajectory(tmp_path / "killed_copy", two_rank_run)


def test_sigterm_checkpoints_at_the_next_step_and_resumes_exactly(data, one_process_run, tmp_path):
    out = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *tiny(data, out, ckpt_every_steps=0)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(out / "main.log", r"^s:15 trl", proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]  # interrupted: a scheduler requeues it
    last = max(vislog(out / "main.log")["trl"])
    assert last < 59 and checkpoints(out) == [f"step_{last + 1:08d}"]
    assert f"stopped by a signal at step {last + 1}," in stdout and "Traceback" not in stderr  # 0-based: its checkpoint

    train_gpt2.main(tiny(data, out, ckpt_every_steps=0))
    assert metrics(out, "train_loss") == metrics(one_process_run, "train_loss")
    assert metrics(out, "val_loss") == metrics(one_process_run, "val_loss")


KILL_IN_SECOND_CHECKPOINT_WRITE = """
import os, signal, sys
import train_gpt2
real_save = train_gpt2.dcp.save
def save_then_die(state_dict, checkpoint_id, **kwargs):
    real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
    if checkpoint_id.endswith("step_00000020.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
train_gpt2.dcp.save = save_then_die
train_gpt2.main(sys.argv[1:])
"""


def test_kill_during_checkpoint_write_keeps_the_previous_one(data, one_process_run, tmp_path, capsys):
    out = tmp_path / "killed_in_write"
    result = subprocess.run([sys.executable, "-c", KILL_IN_SECOND_CHECKPOINT_WRITE, *tiny(data, out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert checkpoints(out) == ["step_00000010", "step_00000020.tmp"]
    assert resolve_checkpoint(str(out)).endswith("step_00000010")

    train_gpt2.main(tiny(data, out))
    assert "removing incomplete checkpoint" in capsys.readouterr().out
    assert metrics(out, "train_loss") == metrics(one_process_run, "train_loss")
    assert checkpoints(out) == ["step_00000050", "step_00000060"]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(data, tmp_path):
    out = tmp_path / "nan"
    train_gpt2.main(tiny(data, out, max_steps=4, ckpt_every_steps=2))
    # an absurd learning rate overflows the weights at step 4's update; step 5's loss is not finite
    with pytest.raises(FloatingPointError, match=r"step 5: train loss .* not finite.*step_00000004"):
        train_gpt2.main(tiny(data, out, max_steps=8, ckpt_every_steps=2, lr=1e38))
    assert checkpoints(out) == ["step_00000002", "step_00000004"]
    assert 5 not in vislog(out / "main.log")["trl"]
    model = load_model(str(out))
    assert all(torch.isfinite(p).all() for p in model.parameters())

    with pytest.raises(ValueError, match=r"step_00000004: .*n_layer 2 \(config: 3\)"):
        train_gpt2.main(tiny(data, out, n_layer=3))


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("hf_tiny"))
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(path)
    return path


def hf_val_loss(hf_dir, data, windows):
    """transformers' mean cross-entropy over the first `windows` validation windows."""
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    val = sequential_samples(data, seq_length=32, split="90,10,0", split_index=1, max_samples=windows)
    tokens = torch.from_numpy(np.stack([val[i]["tokens"] for i in range(len(val))]))
    labels = torch.from_numpy(np.stack([val[i]["labels"] for i in range(len(val))]))
    with torch.no_grad():
        logits = model(tokens).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def test_init_from_hf_starts_at_the_hf_model_and_exports_back(data, hf_tiny, tmp_path):
    from transformers import GPT2LMHeadModel
    reference = hf_val_loss(hf_tiny, data, 16)

    out = tmp_path / "from_hf"
    train_gpt2.main(tiny(data, out, init_from=hf_tiny, max_steps=3, n_layer=7))  # the architecture comes from hf_tiny
    assert metrics(out, "val_loss")[0] == pytest.approx(reference, abs=1e-5)
    exported = GPT2LMHeadModel.from_pretrained(str(out / "hf")).eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, load_model(str(out))(tokens)[0],
                                   atol=1e-5, rtol=1e-5)
        assert not torch.allclose(exported(tokens).logits, GPT2LMHeadModel.from_pretrained(hf_tiny)(tokens).logits)

    # init_from a train_gpt2 run starts from its newest checkpoint: the final model of `out`, with a fresh optimizer
    train_gpt2.main(tiny(data, tmp_path / "from_run", init_from=str(out), max_steps=2))
    assert metrics(tmp_path / "from_run", "val_loss")[0] == metrics(out, "val_loss")[3]

    # 2 ranks, bf16 parameters through FSDP2's mixed precision: rank 0 reads the weights and broadcasts them
    out2 = tmp_path / "from_hf_2ranks"
    run(torchrun(tiny(data, out2, init_from=hf_tiny, max_steps=3, dtype="bfloat16")))
    assert metrics(out2, "val_loss")[0] == pytest.approx(reference, abs=0.03)
    assert sorted(vislog(out2 / "main.log")["trl"]) == [0, 1, 2]
    with torch.no_grad():
        torch.testing.assert_close(GPT2LMHeadModel.from_pretrained(str(out2 / "hf"))(tokens).logits,
                                   load_model(str(out2))(tokens)[0], atol=1e-5, rtol=1e-5)


def test_config_errors_name_the_key(tmp_path, data):
    config = tmp_path / "config.py"
    config.write_text("import math\nmax_steps = 5\nlr = 3e-4 * math.sqrt(4)\nsplit = '90,10,0'\n")
    cfg = train_gpt2.load_config([str(config), "--max_steps=7", "--min_lr=0", "--hellaswag_limit=10",
                                  "--init_from=gpt2", "--data_paths=['30', 'a', '70', 'b']", "--split=98,2,0"])
    assert (cfg.max_steps, cfg.lr, cfg.min_lr, cfg.hellaswag_limit) == (7, 6e-4, 0.0, 10)
    assert (cfg.init_from, cfg.data_paths, cfg.split) == ("gpt2", ["30", "a", "70", "b"], "98,2,0")

    cases = {
        "--max_step=3": r"unknown config key 'max_step'; did you mean 'max_steps'\?",
        "--warmup_steps=3": r"did you mean 'lr_warmup_steps'\?",
        "--max_steps=1.5": r"max_steps must be int or None, got 1\.5",
        "--compile=yes": r"compile must be bool, got 'yes'",
        "--hellaswag_limit=ten": r"hellaswag_limit must be int or None",
        "--seq_length=0": r"seq_length must be >= 1",
        "--dtype=float16": r"dtype must be one of bfloat16, float32",
        "--max_steps": r"--key=value",
    }
    for arg, message in cases.items():
        with pytest.raises(ValueError, match=message):
            train_gpt2.load_config([arg])
    config.write_text("learning_rate = 1e-3\n")
    with pytest.raises(ValueError, match=r"config\.py: unknown config key 'learning_rate'"):
        train_gpt2.load_config([str(config)])
    with pytest.raises(FileNotFoundError, match="missing.py"):
        train_gpt2.load_config([str(tmp_path / "missing.py")])
    with pytest.raises(ValueError, match=r"global_batch_size 10 is not divisible by local_batch_size 4 x world size 1"):
        train_gpt2.main(tiny(data, tmp_path / "out", global_batch_size=10))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"))

    # on the command line: one line naming the problem, no traceback
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), "--max_step=3"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "train_gpt2.py: error: command line --max_step=3: unknown config key 'max_step'; did you mean " \
           "'max_steps'?" in result.stderr


def test_max_steps_none_trains_one_epoch_and_more_than_an_epoch_blends_by_tokens(data, tmp_path, capsys):
    # an unweighted glob is one epoch at most in Megatron; past it the files are blended by token count
    from indexed_dataset import build_gpt_datasets
    for i in range(2):  # two files, like prepare_fineweb.py's outputs (a glob of one file is not capped)
        for ext in (".bin", ".idx"):
            shutil.copy(data + ext, tmp_path / f"processed_data_{i}_text_document{ext}")
    glob = str(tmp_path / "processed_data_*_text_document*")
    train, _, _ = build_gpt_datasets(glob, seq_length=256, split="90,10,0", sizes=(None, 0, 0),
                                     cache_dir=str(tmp_path / "index_cache"))
    epoch_steps = len(train) // 512
    assert epoch_steps >= 2
    common = dict(data_paths=glob, seq_length=256, global_batch_size=512, local_batch_size=512, val_tokens=0,
                  ckpt_every_steps=0, lr_warmup_steps=1, index_mapping_dir=str(tmp_path / "index_cache"))
    train_gpt2.main(tiny(data, tmp_path / "epoch", max_steps=None, **common))
    steps = [int(m.group(1)) for m in re.finditer(r"s:(\d+) trl:", (tmp_path / "epoch" / "main.log").read_text())]
    assert steps == list(range(epoch_steps))
    train_gpt2.main(tiny(data, tmp_path / "longer", max_steps=epoch_steps + 1, **common))
    assert "more than one epoch" in capsys.readouterr().out
    steps = [int(m.group(1)) for m in re.finditer(r"s:(\d+) trl:", (tmp_path / "longer" / "main.log").read_text())]
    assert steps == list(range(epoch_steps + 1))


def test_mfu_peak_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names.pop(0))
    names = ["NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA B200",
             "NVIDIA GeForce RTX 4090"]
    peaks = [train_gpt2.peak_flops(torch.device("cuda", 0)) for _ in range(6)]
    assert peaks == [756e12, 989e12, 989e12, 312e12, 2250e12, None]
    assert train_gpt2.peak_flops(torch.device("cpu")) is None


def test_demo_end_to_end(tmp_path):
    """The quick start: tokenize the bundled text with prepare_fineweb.py, train configs/demo_cpu.py (fewer steps),
    with HellaSwag on a few examples."""
    data_dir = tmp_path / "shakespeare"
    run([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), "--input",
         os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--output-dir", str(data_dir), "--workers", "1"])
    out = tmp_path / "demo"
    result = run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), os.path.join(ROOT, "configs", "demo_cpu.py"),
                  f"--data_paths={str(data_dir / 'processed_data_0_text_document')!r}", f"--out_dir={str(out)!r}",
                  "--max_steps=30", "--val_every_steps=15", "--sample_tokens=16", "--ckpt_every_steps=0",
                  f"--hellaswag={os.path.join(ROOT, 'tests', 'fixtures', 'hellaswag_small.jsonl')!r}"])
    log = vislog(out / "main.log")
    assert sorted(log["trl"]) == list(range(30)) and sorted(log["tel"]) == [0, 15, 30]
    assert sorted(log["eval"]) == [15, 30] and all(0 <= acc <= 1 for acc in log["eval"].values())  # HellaSwag
    assert log["trl"][0] == pytest.approx(10.9, abs=0.3)  # about ln(50257) at init
    assert log["trl"][29] < log["trl"][0] - 3 and log["tel"][30] < log["tel"][0] - 2
    assert len(re.findall(r"sample: ", result.stdout)) == 2  # at step 15 and at the end
    assert set(metrics(out, "sample")) == {15, 30}


def test_token_ids_outside_the_vocabulary_stop_before_the_first_step(data, tmp_path):
    # the byte dataset holds ids up to 511 (its end-of-document token); a 300-token model cannot embed them
    with pytest.raises(ValueError, match=rf"token id 511 in {re.escape(data)}: documents? [\d, ]+ \((sample|window) \d+\) is "
                                         rf"outside the model's vocabulary \(vocab_size 300\)"):
        train_gpt2.main(tiny(data, tmp_path / "out", vocab_size=300))
    assert metrics(tmp_path / "out", "train_loss") == {}  # no step ran


def test_resume_with_another_global_batch_size_is_refused_naming_both_values(data, tmp_path):
    out = tmp_path / "out"
    train_gpt2.main(tiny(data, out, max_steps=4, ckpt_every_steps=2))
    with pytest.raises(ValueError, match=r"trained with global_batch_size 8, the config now says 16; resume with "
                                         r"--global_batch_size=8"):
        train_gpt2.main(tiny(data, out, max_steps=6, global_batch_size=16))
    train_gpt2.main(tiny(data, out, max_steps=6, local_batch_size=2))  # another local batch size is fine
    assert sorted(metrics(out, "train_loss")) == list(range(6))
