"""train_gpt2.py under torchrun (2 gloo ranks) and the faults a run must survive: 1 rank == 2 ranks (FSDP2),
accumulation, exact resume after kill -9 / SIGTERM / a kill during a checkpoint write, resume on another world size,
SIGKILL of one rank at seeded points, a SIGTERM checkpointed within a step and never behind an evaluation, NaN stops,
init from Hugging Face weights and export back, init_from a live run, paths that are files or read-only, and the
quick-start demo end to end with main.log read the way llm.c's vislog reads it.

Tolerances: the same run resumed on the same world size is bit-identical. Across world sizes (or accumulation
splits) fp32 sums are reduced in another order: losses and grad norms agree to 2e-5 absolute over the 60 steps of
this tiny model at lr 3e-3 (at lr 1e-2 it has loss spikes that amplify last-bit differences)."""
import errno
import os
import random
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import plot_log
import sample
import train_gpt2
from atomic_io import lock_file
from conftest import (ROOT, checkpoints, hf_difference, metrics, process_tree, run, save_tiny_hf_gpt2, start_nodes,
                      tiny, torchrun, vislog, wait_for_line, wait_nodes)
from indexed_dataset import sequential_samples
from checkpoint import MARKER, check_checkpoint, complete_checkpoints, load_model, resolve_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def signal_and_time_the_checkpoint(args, out, ready_path, ready_pattern):
    """Start a 2-rank run with its output in out.parent/run.out, SIGTERM torchrun once `ready_pattern` is in
    `ready_path`; (seconds from the signal to a complete checkpoint, torchrun's exit status, the run's output)."""
    log_path = out.parent / "run.out"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(torchrun(args), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_line(ready_path, ready_pattern, proc)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
        done = lambda: os.path.isdir(out / "ckpt") and any(  # noqa: E731
            os.path.exists(out / "ckpt" / name / MARKER) for name in checkpoints(out))
        while not done():
            assert proc.poll() is None, "the run ended without a checkpoint:\n" + log_path.read_text()[-3000:]
            time.sleep(0.01)
        elapsed = time.perf_counter() - sent
        proc.wait(timeout=120)
    finally:
        proc.kill()
    return elapsed, proc.returncode, log_path.read_text()


@pytest.mark.slow
def test_sigterm_under_torchrun_is_checkpointed_within_a_step_though_logging_is_rare(data, tmp_path):
    out = tmp_path / "out"
    args = tiny(data, out, max_steps=5000, log_every_steps=150, ckpt_every_steps=0, val_every_steps=10_000)
    elapsed, status, output = signal_and_time_the_checkpoint(args, out, out / "main.log", r"^s:0 tel")
    print(f"SIGTERM -> checkpoint complete on 2 ranks: {elapsed:.2f} s (torchrun's SIGKILL follows at 30 s)")
    assert elapsed < 10, output[-3000:]
    step = int(checkpoints(out)[-1].split("_")[1])
    assert 0 < step < 150  # within a step of the signal, not at the next log_every_steps boundary
    assert f"stopped by a signal at step {step}" in output
    assert status != 0  # torchrun itself exits 1 when signalled: requeue scripts read the out_dir, not this


@pytest.mark.slow
def test_sigterm_during_a_long_validation_is_checkpointed_at_once(data, tmp_path):
    out = tmp_path / "out"
    args = tiny(data, out, max_steps=100, val_tokens=80_000, n_embd=128, ckpt_every_steps=0)
    elapsed, status, output = signal_and_time_the_checkpoint(args, out, tmp_path / "run.out", r"^model: ")
    print(f"SIGTERM during validation -> checkpoint complete on 2 ranks: {elapsed:.2f} s")
    assert checkpoints(out) == ["step_00000000"] and "stopped by a signal at step 0" in output, output[-3000:]
    assert "val loss" not in output  # the evaluation was cut short, not finished first


@pytest.mark.slow
def test_fsdp2_shards_on_a_mesh_of_the_runs_device(data, tmp_path):
    result = subprocess.run(torchrun(tiny(data, tmp_path / "out", max_steps=1, lr_warmup_steps=1, val_tokens=0)), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FSDP2 over a cpu mesh of 2 ranks" in result.stdout


# single-process runs save and load checkpoints without a process group on purpose

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


@pytest.mark.gpt2
@pytest.mark.slow
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


@pytest.mark.slow
def test_muon_on_two_fsdp2_ranks_equals_one_process(data, tmp_path):
    """ShardedMuon orthogonalizes each sharded (DTensor) matrix whole on one of 2 ranks: 1 process's run, to rounding.
    Its Newton-Schulz steps run in bf16 and sum in another order on 2 ranks: the losses agree to 1e-5 relative (measured),
    the grad norms, which are more sensitive to the weights, to 2.5e-4."""
    def args(out):
        return tiny(data, out, max_steps=10, optimizer="muon", lr=0.02, muon_scalar_lr=3e-3)

    train_gpt2.main(args(tmp_path / "one"))
    run(torchrun(args(tmp_path / "two")))
    for key, tol in (("train_loss", 1e-4), ("val_loss", 1e-4), ("grad_norm", 1e-3)):
        one, two = metrics(tmp_path / "one", key), metrics(tmp_path / "two", key)
        assert one.keys() == two.keys() and len(one) >= 2
        worst = max(abs(one[step] - two[step]) / abs(one[step]) for step in one)
        assert worst <= tol, (key, worst)
    assert metrics(tmp_path / "one", "train_loss")[9] < metrics(tmp_path / "one", "train_loss")[0] - 0.5


@pytest.mark.slow
def test_gradient_accumulation_4x1_equals_1x4_and_padding_changes_nothing(data, tmp_path):
    train_gpt2.main(tiny(data, tmp_path / "a", global_batch_size=4, local_batch_size=4, max_steps=12))
    train_gpt2.main(tiny(data, tmp_path / "b", global_batch_size=4, local_batch_size=1, max_steps=12))
    assert_same_trajectory(tmp_path / "a", tmp_path / "b")
    # padded_vocab_size only adds never-used rows to wte/lm_head: same init, same run
    train_gpt2.main(tiny(data, tmp_path / "c", global_batch_size=4, local_batch_size=4, max_steps=12,
                         padded_vocab_size=576))
    assert_same_trajectory(tmp_path / "a", tmp_path / "c")


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_lost_peer_ends_each_survivor_with_one_line_saying_a_rerun_resumes(data, tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = torchrun(tiny(data, out, dist_timeout_s=20))
    cmd[3:3] = ["--log-dir", str(logs), "--redirects", "3"]  # each worker's stdout and stderr in a file of its own
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_line(out / "main.log", r"^s:5 trl", proc)
        for pid in process_tree(proc.pid)[1:]:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"RANK=1" in f.read().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    [stderr_path] = logs.glob("*/attempt_0/0/stderr.log")
    lines = [line for line in stderr_path.read_text().splitlines() if not line.startswith("indexed_dataset:")]
    assert len(lines) == 1, "\n".join(lines[-50:])
    assert re.fullmatch(r"\[rank 0\] train_gpt2.py: error: lost another rank of the run \(it was killed, .*\); "
                        r"rerun the same command to resume from the last checkpoint", lines[0]), lines[0]


def sigterm_one_process(args, out, pattern):
    """Run train_gpt2.py in one process, SIGTERM it once `pattern` is in its main.log; (process, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(out / "main.log", pattern, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc, stdout, stderr


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_resumes_exactly(data, one_process_run, tmp_path):
    out = tmp_path / "preempted"
    proc, stdout, stderr = sigterm_one_process(tiny(data, out, ckpt_every_steps=0), out, r"^s:15 trl")
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]  # interrupted: a scheduler requeues it
    last = max(vislog(out / "main.log")["trl"])
    assert last < 59 and checkpoints(out) == [f"step_{last + 1:08d}"]
    assert f"stopped by a signal at step {last + 1}," in stdout and "Traceback" not in stderr  # 0-based: its checkpoint

    train_gpt2.main(tiny(data, out, ckpt_every_steps=0))
    assert metrics(out, "train_loss") == metrics(one_process_run, "train_loss")
    assert metrics(out, "val_loss") == metrics(one_process_run, "val_loss")


@pytest.mark.slow
def test_a_schedulers_double_sigterm_still_checkpoints_at_the_stop_step_and_resumes_exactly(data, two_rank_run,
                                                                                             tmp_path):
    # Slurm signals every process of the job, then torchrun forwards its own SIGTERM: the second must not kill
    out = tmp_path / "preempted"
    log_path = tmp_path / "run.out"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(torchrun(tiny(data, out)), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_line(out / "main.log", r"^s:13 trl", proc)
        for pid in process_tree(proc.pid)[1:]:  # the workers
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    output = log_path.read_text()
    stopped = re.search(r"stopped by a signal at step (\d+)", output)
    assert stopped, output[-3000:]
    step = int(stopped.group(1))
    assert step > 13 and checkpoints(out)[-1] == f"step_{step:08d}", output[-3000:]
    assert output.count("SIGTERM again while stopping") <= 1
    # torchrun reports the signal it got with a traceback of its own; the workers print none
    assert output.count("Traceback") == output.count("elastic.multiprocessing.api.SignalException: Process"), output

    run(torchrun(tiny(data, out)))
    assert metrics(out, "train_loss") == metrics(two_rank_run, "train_loss")
    assert metrics(out, "val_loss") == metrics(two_rank_run, "val_loss")


KILL_IN_SECOND_CHECKPOINT_WRITE = """
import os, signal, sys
import checkpoint
import train_gpt2
real_write = checkpoint.write_checkpoint
def write_then_die(cfg, final, write_shards, *rest):  # killed once the DCP shards are written
    def shards_then_die():
        write_shards()
        if final.endswith("step_00000020"):
            os.kill(os.getpid(), signal.SIGKILL)
    return real_write(cfg, final, shards_then_die, *rest)
checkpoint.write_checkpoint = write_then_die
train_gpt2.main(sys.argv[1:])
"""


@pytest.mark.slow
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
    return save_tiny_hf_gpt2(str(tmp_path_factory.mktemp("hf_tiny")), vocab_size=512)


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


@pytest.mark.gpt2
@pytest.mark.slow
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


@pytest.mark.slow
def test_init_from_a_hub_id_is_downloaded_by_each_nodes_first_rank_into_its_own_cache(data, hf_tiny, tmp_path):
    launcher = tmp_path / "launch_with_fault.py"
    launcher.write_text(LAUNCHER)
    args = tiny(data, tmp_path / "out", init_from="someone/tiny-gpt2", max_steps=2)

    def env(home):
        os.makedirs(home, exist_ok=True)
        return dict(os.environ, FAULT="fake_hub", FAKE_HUB_MODEL=hf_tiny, HF_HOME=str(home), PYTHONPATH=ROOT)

    def downloaded_by(home):
        return (home / "downloaded_by_ranks").read_text().split()

    # one node, two ranks: local rank 0 downloads, rank 1 waits and reads the node's cache
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(launcher), *args], cwd=ROOT, env=env(tmp_path / "home"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert downloaded_by(tmp_path / "home") == ["0"]

    # two nodes without a shared home: each node's first rank downloads into its own cache
    def two_nodes(out, offline_node=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                                   "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                                   str(launcher), *args, f"--out_dir={out}"], cwd=ROOT,
                                  env=dict(env(tmp_path / f"{out.name}_home{node}"), **({"FAKE_HUB_OFFLINE": "1"}
                                                                         if node == offline_node else {})),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        try:
            return [node.communicate(timeout=300)[0] for node in nodes], [node.returncode for node in nodes]
        finally:
            for node in nodes:
                node.kill()

    outputs, status = two_nodes(tmp_path / "two_nodes")
    assert status == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert downloaded_by(tmp_path / "two_nodes_home0") == ["0"]
    assert downloaded_by(tmp_path / "two_nodes_home1") == ["1"]
    # a node that cannot download: every rank says so at once, none waits in a collective until the timeout
    outputs, status = two_nodes(tmp_path / "offline", offline_node=1)
    assert status == [1, 1], outputs[0][-2000:] + outputs[1][-2000:]
    for node, output in enumerate(outputs):
        assert re.search(rf"\[rank {node}\] train_gpt2.py: error: someone/tiny-gpt2: no such local directory, and "
                         r"not available online", output), output[-2000:]
        assert output.count("Traceback") == 1 and "raise ChildFailedError" in output  # torchrun's report only


@pytest.mark.slow
def test_config_errors_name_the_key(tmp_path, data):
    config = tmp_path / "config.py"
    config.write_text("import math\nmax_steps = 5\nlr = 3e-4 * math.sqrt(4)\nsplit = '90,10,0'\n")
    cfg = train_gpt2.load_config([str(config), "--max_steps=7", "--lr_warmup_steps=2", "--min_lr=0", "--hellaswag_limit=10",
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
    with pytest.raises(ValueError, match=r"config\.py: 'learning_rate' is nanoGPT's name; here it is --lr"):
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


@pytest.mark.slow
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
    assert "more than one epoch" in capsys.readouterr().err
    steps = [int(m.group(1)) for m in re.finditer(r"s:(\d+) trl:", (tmp_path / "longer" / "main.log").read_text())]
    assert steps == list(range(epoch_steps + 1))


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    """The quick start: tokenize the bundled text with prepare_fineweb.py, train configs/demo_cpu.py (fewer steps),
    with HellaSwag on a few examples."""
    data_dir = tmp_path / "shakespeare"
    run([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), "--input",
         os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--output-dir", str(data_dir), "--workers", "1"])
    out = tmp_path / "demo"
    result = run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), os.path.join(ROOT, "configs", "demo_cpu.py"),
                  f"--data_paths={str(data_dir / 'processed_data_0_text_document')!r}", f"--out_dir={str(out)!r}",
                  "--max_steps=50", "--val_every_steps=25", "--sample_tokens=16", "--ckpt_every_steps=0",
                  f"--hellaswag={os.path.join(ROOT, 'tests', 'fixtures', 'hellaswag_small.jsonl')!r}"])
    log = vislog(out / "main.log")
    assert sorted(log["trl"]) == list(range(50)) and sorted(log["tel"]) == [0, 25, 50]
    assert sorted(log["eval"]) == [25, 50] and all(0 <= acc <= 1 for acc in log["eval"].values())  # HellaSwag
    assert log["trl"][0] == pytest.approx(10.9, abs=0.3)  # about ln(50257) at init
    # lr 1e-3 (the demo's, without the spikes of 3e-3) needs 50 steps for the 3-nat fall 3e-3 made in 30
    assert log["trl"][49] < log["trl"][0] - 3 and log["tel"][50] < log["tel"][0] - 2
    assert len(re.findall(r"sample: ", result.stdout)) == 2  # at step 25 and at the end
    assert set(metrics(out, "sample")) == {25, 50}


def test_token_ids_outside_the_vocabulary_stop_before_the_first_step(data, tmp_path):
    # the byte dataset holds ids up to 511 (its end-of-document token); a 300-token model cannot embed them
    with pytest.raises(ValueError, match=rf"token id 511 in {re.escape(data)}: documents? [\d, ]+ \((sample|window) "
                                         rf"\d+\) is outside the model's vocabulary \(vocab_size 300\)"):
        train_gpt2.main(tiny(data, tmp_path / "out", vocab_size=300))
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")  # no step ran


def test_resume_with_another_global_batch_size_is_refused_naming_both_values(data, tmp_path):
    out = tmp_path / "out"
    train_gpt2.main(tiny(data, out, max_steps=4, ckpt_every_steps=2))
    with pytest.raises(ValueError, match=r"trained with global_batch_size 8, the config now says 16; resume with "
                                         r"--global_batch_size=8"):
        train_gpt2.main(tiny(data, out, max_steps=6, global_batch_size=16))
    train_gpt2.main(tiny(data, out, max_steps=6, local_batch_size=2))  # another local batch size is fine
    assert sorted(metrics(out, "train_loss")) == list(range(6))


# the hooks live here, not in the product: FAULT=kind:args kills this process (SIGKILL) at one chosen point
LAUNCHER = """
import os, signal, sys
import torch
import torch.distributed.checkpoint.filesystem as fs
import checkpoint
import hf_files
import train_gpt2
kind, *args = os.environ.get("FAULT", "none").split(":")
args = [int(a) for a in args]
rank = int(os.environ.get("RANK", 0))
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if kind == "step" and rank == args[0]:  # after this process's args[1]-th optimizer step
    real_step, steps = torch.optim.AdamW.step, [0]
    def step(self, *a, **kw):
        result = real_step(self, *a, **kw)
        steps[0] += 1
        if steps[0] == args[1]:
            die()
        return result
    torch.optim.AdamW.step = step
if kind == "bytes" and rank == args[0]:  # once args[2] bytes of this rank's shard of checkpoint step args[1] are out
    real_write = fs._write_item
    def write_item(transforms, stream, *rest, **kwargs):
        result = real_write(transforms, stream, *rest, **kwargs)
        if f"step_{args[1]:08d}.tmp" in stream.name and stream.tell() >= args[2]:
            stream.flush()
            die()
        return result
    fs._write_item = write_item
if kind == "sigterm_at_eval":  # every rank signalled at the start of the evaluation at step args[0]
    real_evaluate = train_gpt2.Evaluator.__call__
    def evaluate(self, model, step, stop, *rest):
        if step == args[0]:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(self, model, step, stop, *rest)
    train_gpt2.Evaluator.__call__ = evaluate
if kind == "fake_hub":  # no network: a hub id is found in this node's own cache ($HF_HOME) once it is downloaded
    import shutil
    def snapshot_download(repo_id, **kwargs):  # a download: local rank 0 of the node copies $FAKE_HUB_MODEL
        cache = os.path.join(os.environ["HF_HOME"], "hub", repo_id)
        if os.environ["LOCAL_RANK"] == "0" and not os.path.isdir(cache) and not os.environ.get("FAKE_HUB_OFFLINE"):
            with open(os.path.join(os.environ["HF_HOME"], "downloaded_by_ranks"), "a") as f:
                f.write(f"{rank}\\n")
            shutil.copytree(os.environ["FAKE_HUB_MODEL"], cache)
        if not os.path.isdir(cache) or os.environ.get("FAKE_HUB_OFFLINE"):
            raise OSError(f"{repo_id}: not in this node's cache {cache}, and no network")
        return cache
    hf_files.huggingface_hub.snapshot_download = snapshot_download
if kind == "marker" and rank == 0:  # every file of checkpoint step args[0] written and synced, the marker not yet
    real_fsync_tree = checkpoint.fsync_tree
    def fsync_tree(path):
        sizes = real_fsync_tree(path)
        if path.endswith(f"step_{args[0]:08d}.tmp"):
            die()
        return sizes
    checkpoint.fsync_tree = fsync_tree
train_gpt2.cli()  # as `python train_gpt2.py ARGS`: exit status and error lines
"""


def launch(tmp_path, args, fault="none", nproc=2, timeout=300):
    launcher = tmp_path / "launch_with_fault.py"
    launcher.write_text(LAUNCHER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(launcher),
           *args]
    env = dict(os.environ, FAULT=fault, PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def kill_points(seed, max_steps, every):
    """Seeded faults: one inside a shard write, one before a marker, one between steps."""
    rng = random.Random(seed)
    ckpts = list(range(every, max_steps, every))
    return [f"bytes:{rng.randrange(2)}:{rng.choice(ckpts)}:{rng.randrange(1, 200_000)}",
            f"marker:{rng.choice(ckpts)}", f"step:{rng.randrange(2)}:{rng.randrange(1, every + 2)}"]


def assert_only_complete_checkpoints(out):
    """Every step_N directory is complete and readable; interrupted writes are only *.tmp directories."""
    ckpt_root = os.path.join(out, "ckpt")
    steps = [os.path.join(ckpt_root, n) for n in os.listdir(ckpt_root) if re.fullmatch(r"step_\d{8}", n)]
    assert sorted(steps) == complete_checkpoints(ckpt_root)
    assert all(check_checkpoint(path) is None for path in steps)


@pytest.mark.slow
def test_sigkill_at_seeded_points_then_rerun_gives_the_uninterrupted_run_bit_for_bit(data, tmp_path):
    config = dict(max_steps=16, ckpt_every_steps=4, val_every_steps=8)
    reference = launch(tmp_path, tiny(data, tmp_path / "reference", **config))
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "killed"
    for fault in kill_points(0, 16, 4):
        before = complete_checkpoints(str(out / "ckpt"))
        result = launch(tmp_path, tiny(data, out, **config), fault)
        assert result.returncode != 0, f"{fault}: the run was not killed"
        assert_only_complete_checkpoints(out)
        if before:  # it resumed from the newest complete checkpoint there was
            assert f"resuming from {before[-1]}" in result.stdout, fault
    result = launch(tmp_path, tiny(data, out, **config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(out, "train_loss") == metrics(tmp_path / "reference", "train_loss")
    assert metrics(out, "val_loss") == metrics(tmp_path / "reference", "val_loss")


def test_a_stop_before_the_first_update_resumes_bit_for_bit_on_one_process(data, tmp_path, monkeypatch):
    args = dict(max_steps=12, ckpt_every_steps=4)
    train_gpt2.main(tiny(data, tmp_path / "reference", **args))
    out = tmp_path / "stopped"
    real_build_optimizer = train_gpt2.build_optimizer

    def build_optimizer_and_signal(*a):  # a SIGTERM during setup, before the step-0 evaluation
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build_optimizer(*a)

    monkeypatch.setattr(train_gpt2, "build_optimizer", build_optimizer_and_signal)
    assert train_gpt2.main(tiny(data, out, **args)) == 128 + signal.SIGTERM
    assert checkpoints(out) == ["step_00000000"]
    monkeypatch.undo()
    assert train_gpt2.main(tiny(data, out, **args)) == 0
    for key in ("train_loss", "val_loss", "grad_norm"):
        assert metrics(out, key) == metrics(tmp_path / "reference", key)
    assert vislog(out / "main.log") == vislog(tmp_path / "reference" / "main.log")


@pytest.mark.slow
def test_a_stop_during_the_step_0_evaluation_resumes_bit_for_bit_on_two_ranks(data, tmp_path):
    args = dict(max_steps=12, ckpt_every_steps=4)
    assert launch(tmp_path, tiny(data, tmp_path / "reference", **args)).returncode == 0
    out = tmp_path / "stopped"
    result = launch(tmp_path, tiny(data, out, **args), "sigterm_at_eval:0")
    assert "stopped by a signal at step 0" in result.stdout, result.stderr[-3000:]
    assert checkpoints(out) == ["step_00000000"]
    assert launch(tmp_path, tiny(data, out, **args)).returncode == 0
    for key in ("train_loss", "val_loss", "grad_norm"):
        assert metrics(out, key) == metrics(tmp_path / "reference", key)


@pytest.mark.slow
def test_init_from_a_live_run_is_refused_on_every_rank_and_its_checkpoint_named_directly_loads(data, tmp_path):
    """The source run's out_dir/.lock held by this process, as the live run holds it: init_from naming the run ends
    every rank in the same line at once, nothing written; init_from naming its checkpoint loads on both ranks."""
    source = tmp_path / "source"
    assert launch(tmp_path, tiny(data, source, max_steps=4, ckpt_every_steps=2)).returncode == 0
    newest = source / "ckpt" / "step_00000004"
    lock = lock_file(str(source / ".lock"))
    try:
        out = tmp_path / "out"
        result = launch(tmp_path, tiny(data, out, max_steps=2, init_from=str(source)))
        assert result.returncode == 1, result.stderr[-3000:]
        line = (f"train_gpt2.py: error: init_from {source}: that run is still training (pid {os.getpid()} on host "
                f"{os.uname().nodename}) and may delete its checkpoints while they are read; name one, e.g. {newest}")
        for rank in (0, 1):
            assert f"[rank {rank}] {line}\n" in result.stderr, result.stderr[-3000:]
        assert os.listdir(out / "ckpt") == []
        result = launch(tmp_path, tiny(data, tmp_path / "named", max_steps=2, init_from=str(newest)))
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"init_from: loaded the weights of {newest}" in result.stdout
    finally:
        os.close(lock)


@pytest.mark.slow
def test_non_finite_weights_are_never_checkpointed_or_exported(data, tmp_path):
    # AdamW's decoupled weight decay p *= 1 - lr * weight_decay overflows float32 in the first update, after a
    # finite loss and grad norm: only the weights show it
    blow_up = dict(lr=1e30, weight_decay=1e10)
    out = tmp_path / "one"
    with pytest.raises(FloatingPointError, match=r"checkpoint at step 1: parameters hold NaN or inf "
                                                 r"\(transformer\..*\); nothing was written.*none"):
        train_gpt2.main(tiny(data, out, max_steps=1, lr_warmup_steps=1, **blow_up))
    assert os.listdir(out / "ckpt") == [] and not os.path.exists(out / "hf")
    # sharded: each rank checks its own shard and all ranks stop; the last good checkpoint stays the newest
    out = tmp_path / "two"
    assert launch(tmp_path, tiny(data, out, max_steps=2, ckpt_every_steps=1)).returncode == 0
    result = launch(tmp_path, tiny(data, out, max_steps=3, ckpt_every_steps=1, **blow_up))
    assert result.returncode == 1 and not re.search(r"\[rank\d\]: Traceback", result.stderr)  # torchrun has its own
    assert re.search(r"checkpoint at step 3: parameters hold NaN or inf .*step_00000002", result.stderr)
    assert sorted(os.listdir(out / "ckpt")) == ["step_00000001", "step_00000002"]


def run_main_as_script(monkeypatch, args):
    """train_gpt2.py's __main__ block in this process: (exit status or message, nothing printed as a traceback)."""
    monkeypatch.setattr(sys, "argv", ["train_gpt2.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(ROOT, "train_gpt2.py"), run_name="__main__")
    return exit_info.value.code


def test_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_checkpoint(data, tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs
    real_write, calls = fs._write_item, []

    def write_item(transforms, stream, *rest, **kwargs):
        calls.append(stream.name)
        if "step_00000004" in stream.name:
            raise OSError(errno.ENOSPC, "No space left on device", stream.name)
        return real_write(transforms, stream, *rest, **kwargs)
    monkeypatch.setattr(fs, "_write_item", write_item)
    out = tmp_path / "full"
    message = run_main_as_script(monkeypatch, tiny(data, out, max_steps=6, ckpt_every_steps=2))
    assert re.fullmatch(r"train_gpt2\.py: error: .*step_00000004\.tmp/__0_0\.distcp: writing checkpoint "
                        r".*step_00000004 failed on rank 0: No space left on device; the disk is full: free "
                        r"some space or choose another out_dir", message)
    assert os.listdir(out / "ckpt") == ["step_00000002"]


def test_os_errors_are_one_line_naming_the_path(data, tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    message = run_main_as_script(monkeypatch, tiny(data, a_file / "out", max_steps=1, lr_warmup_steps=1))
    assert message == f"train_gpt2.py: error: {a_file / 'out'}: Not a directory; a part of the path is a file, " \
                      f"not a directory; choose another path"
    message = run_main_as_script(monkeypatch, tiny(data, tmp_path / "out", index_mapping_dir=str(a_file / "cache"),
                                                   max_steps=1, lr_warmup_steps=1))
    assert message.startswith(f"train_gpt2.py: error: {a_file / 'cache'}") and "Not a directory" in message
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: make the directory refuse new entries as the kernel would
        real_makedirs = os.makedirs

        def makedirs(path, *args, **kwargs):
            if str(path).startswith(str(read_only)):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_makedirs(path, *args, **kwargs)

        monkeypatch.setattr(os, "makedirs", makedirs)
    message = run_main_as_script(monkeypatch, tiny(data, read_only, max_steps=1, lr_warmup_steps=1))
    assert "Permission denied; choose a directory you can write to" in message
    monkeypatch.undo()

    with open(tmp_path / "main.log", "w") as f:
        f.write("s:0 tel:6.0\ns:0 trl:6.1 lr:0.001 norm:1.0\ns:1 trl:5.0 lr:0.001 norm:1.0\n")
    with pytest.raises(SystemExit) as exit_info:
        plot_log.main([str(tmp_path / "main.log"), "-o", str(a_file / "curves.png")])
    assert str(exit_info.value.code).startswith(f"plot_log.py: error: -o {a_file / 'curves.png'}: ")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        sample.main(["--model", str(tmp_path / "nowhere"), "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: torch sees no CUDA GPU here; use --device cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_exits_143_after_its_checkpoint_and_a_finished_run_exits_0(data, tmp_path):
    out = tmp_path / "preempted"
    args = tiny(data, out, ckpt_every_steps=0, max_steps=30)
    proc, stdout, stderr = sigterm_one_process(args, out, r"^s:5 trl")
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by a signal" in stdout and "Traceback" not in stderr
    assert "Warning" not in stderr  # e.g. no FutureWarning from a decorated class
    assert len(complete_checkpoints(str(out / "ckpt"))) == 1
    assert train_gpt2.main(args) == 0


# -----------------------------------------------------------------------------
# two nodes: network namespaces joined by a veth pair, one torchrun (one rank) on each, c10d rendezvous

def worker_view(procs):
    """(HOME, network namespace) of each node's training process, read from /proc while it runs."""
    views = []
    for proc in procs:
        for pid in process_tree(proc.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
                namespace = os.readlink(f"/proc/{pid}/ns/net")
            except OSError:
                continue
            if b"LOCAL_RANK" in env:  # a worker: torchrun sets LOCAL_RANK for its workers alone
                views.append((env[b"HOME"].decode(), namespace))
    return views


@pytest.mark.slow
def test_two_nodes_give_the_two_rank_run_bit_for_bit_each_with_its_own_home(data, two_rank_run, two_nodes, tmp_path):
    out = tmp_path / "two_nodes"
    procs = start_nodes(two_nodes, tiny(data, out), tmp_path)
    try:
        wait_for_line(out / "main.log", r"^s:2 trl", procs[0])
        views = worker_view(procs)
    finally:
        status, outputs = wait_nodes(procs, tmp_path)
    assert status == [0, 0], "\n".join(output[-3000:] for output in outputs)
    # one worker per node, each in its node's network namespace with its node's HOME; out_dir is shared (a shared
    # filesystem), the homes are not: nothing a rank reads may live only in another node's HOME
    assert sorted(home for home, _ in views) == [two_nodes[0]["home"], two_nodes[1]["home"]], views
    assert len({namespace for _, namespace in views}) == 2, views
    assert os.listdir(two_nodes[0]["home"]) == os.listdir(two_nodes[1]["home"]) == []  # no cache left in a HOME
    assert "world size 2, device cpu" in "".join(outputs)
    assert (out / "main.log").read_text() == open(os.path.join(two_rank_run, "main.log")).read()
    for key in ("train_loss", "val_loss", "grad_norm"):
        assert metrics(out, key) == metrics(two_rank_run, key), key
    assert hf_difference(out, two_rank_run) == ""


@pytest.mark.slow
def test_sigterm_to_one_node_checkpoints_both_and_the_rerun_resumes_exactly(data, two_rank_run, two_nodes, tmp_path):
    out = tmp_path / "two_nodes"
    procs = start_nodes(two_nodes, tiny(data, out), tmp_path / "stopped", port=29400)
    try:
        wait_for_line(out / "main.log", r"^s:25 trl", procs[0])
        procs[0].send_signal(signal.SIGTERM)  # node 0's torchrun, which also hosts the rendezvous, forwards it
    finally:
        status, outputs = wait_nodes(procs, tmp_path / "stopped")
    output = "\n".join(outputs)
    last = max(vislog(out / "main.log")["trl"])
    assert 25 <= last < 59 and 0 not in status, output[-6000:]
    # both ranks stopped at the same step and wrote its checkpoint together; the worker of node 1, which heard of the
    # signal only through the training loop, exited 143 as the signalled one did (torchrun's failure summary says so)
    assert f"stopped by a signal at step {last + 1}," in output, output[-6000:]
    assert re.search(r"exitcode\s*: 143", outputs[1]), outputs[1][-3000:]
    stop_checkpoint = out / "ckpt" / f"step_{last + 1:08d}"
    assert checkpoints(out)[-1] == stop_checkpoint.name and check_checkpoint(str(stop_checkpoint)) is None

    procs = start_nodes(two_nodes, tiny(data, out), tmp_path / "resumed", port=29401)
    status, outputs = wait_nodes(procs, tmp_path / "resumed")
    assert status == [0, 0], "\n".join(output[-3000:] for output in outputs)
    assert f"resuming from {stop_checkpoint}" in "".join(outputs)
    assert vislog(out / "main.log") == vislog(os.path.join(two_rank_run, "main.log"))
    for key in ("train_loss", "val_loss", "grad_norm"):
        assert metrics(out, key) == metrics(two_rank_run, key), key
    assert hf_difference(out, two_rank_run) == ""


def two_localhost_nodes(args, homes, timeout=300):
    """train_gpt2.py as two one-process nodes on this machine (static rendezvous), node i with HOME homes[i] and no
    network (a dead proxy answers every download at once); their (exit status, output)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node_rank, home in enumerate(homes):
        env = {k: v for k, v in os.environ.items() if k != "HELLASWAG_CACHE"}
        env.update(HOME=str(home), https_proxy="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
               os.path.join(ROOT, "train_gpt2.py"), *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        return [(proc.wait(timeout=timeout), proc.stdout.read()) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.slow
def test_hellaswag_download_is_read_by_global_rank_0_alone_so_nodes_need_no_shared_home(data, tmp_path):
    """hellaswag="download" on two nodes with different HOMEs: rank 0 reads its cached copy and sends the examples,
    so the node without one (and without internet) needs none; a bad copy is one line on every rank, not a hang."""
    homes = [tmp_path / "home_node0", tmp_path / "home_node1"]
    cached = homes[0] / ".cache" / "hellaswag" / "hellaswag_val.jsonl"
    cached.parent.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "hellaswag_small.jsonl"), cached)
    homes[1].mkdir()
    out = tmp_path / "out"
    args = tiny(data, out, vocab_size=50257, max_steps=2, val_every_steps=2, ckpt_every_steps=0, hellaswag="download")
    for status, output in two_localhost_nodes(args, homes):
        assert status == 0, output[-3000:]
    assert sorted(vislog(out / "main.log")["eval"]) == [2]  # HellaSwag scored at step 2
    assert os.listdir(homes[1]) == []  # node 1 neither downloaded nor cached anything

    with open(cached, "a") as f:
        f.write('{"ctx": "cut short\n')
    bad_run = args + [f"--out_dir={str(tmp_path / 'bad')!r}"]
    for node_rank, (status, output) in enumerate(two_localhost_nodes(bad_run, homes)):
        errors = [line for line in output.splitlines() if "train_gpt2.py: error:" in line]
        frames = [line for line in output.splitlines() if re.search(r'File ".*(train_gpt2|hellaswag)\.py"', line)]
        assert status != 0 and len(errors) == 1 and not frames, output[-3000:]  # torchrun's own report aside
        assert f"[rank {node_rank}] train_gpt2.py: error: {cached}, line 12: not valid JSON" in errors[0]
