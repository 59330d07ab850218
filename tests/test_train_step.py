"""The training step: no host-device synchronisation in a step that does not log, and torch.compile gives the eager
losses on one process and on 2 ranks with FSDP2."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
import train_gpt2
from conftest import metrics, tiny

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PROJECT_FILES = tuple(os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.endswith(".py"))


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


def test_compile_gives_the_eager_losses_on_one_process(data, tmp_path):
    train_gpt2.main(compile_args(data, tmp_path / "eager", False))
    train_gpt2.main(compile_args(data, tmp_path / "compiled", True))
    assert_losses_close(tmp_path / "eager", tmp_path / "compiled")


def test_compile_gives_the_eager_losses_on_two_ranks_with_fsdp2(data, tmp_path):
    for name, flag in (("eager", False), ("compiled", True)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(ROOT, "train_gpt2.py"), *compile_args(data, tmp_path / name, flag)]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_losses_close(tmp_path / "eager", tmp_path / "compiled")


def test_activation_checkpointing_trains_the_same_run(data, tmp_path):
    train_gpt2.main(tiny(data, tmp_path / "plain", max_steps=4, ckpt_every_steps=0))
    train_gpt2.main(tiny(data, tmp_path / "recomputed", max_steps=4, ckpt_every_steps=0, activation_checkpointing=True))
    for key in ("train_loss", "val_loss", "grad_norm"):
        a, b = metrics(tmp_path / "plain", key), metrics(tmp_path / "recomputed", key)
        assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) <= 1e-6


def test_memory_plan_counts_per_rank_and_names_the_keys_when_it_will_not_fit(monkeypatch):
    from model import GPTConfig

    cfg = train_gpt2.load_config(["--n_layer=12", "--n_head=12", "--n_embd=768", "--local_batch_size=64"])
    model_config = GPTConfig(n_layer=12, n_head=12, n_embd=768, padded_vocab_size=50304)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 80 * 2**30))
    plan, _ = train_gpt2.memory_plan(model_config, cfg, 8, torch.device("cuda", 0))
    n = 124_475_904  # GPT-2 124M with the vocabulary padded to 50304: 4 bytes each, sharded over 8 ranks
    assert f"parameters {4 * n / 8 / 2**30:.2f} GiB" in plan and f"optimizer {8 * n / 8 / 2**30:.2f} GiB" in plan
    assert "WARNING" not in plan
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * 2**30, 80 * 2**30))
    plan, _ = train_gpt2.memory_plan(model_config, cfg, 8, torch.device("cuda", 0))
    assert "WARNING" in plan and "local_batch_size" in plan and "activation_checkpointing=True" in plan
