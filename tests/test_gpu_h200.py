"""bench/gpu_h200.sh as written, on CPU with a tiny model: its train_gpt2.py command lines (one process, and torchrun
with one rank: the FSDP2 path), its bare loops and the nanoGPT-style peer run and print every row of the table, so the
GPU check can no longer break unseen (it once died on the reference config's val_data_paths before training)."""
import os
import re
import subprocess

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_gpu_script_runs_on_cpu_with_a_tiny_model(tmp_path):
    env = dict(os.environ, DEVICE="cpu", MODEL="2 2 32", SEQ="32", BATCH="1", STEPS="2", OUT=str(tmp_path / "h200"))
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_h200.sh")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    # the logs and the table stay in OUT (the synthetic tokens do not); each row was printed as it was measured,
    # the bare loops' before the train_gpt2.py runs started
    kept = sorted(os.listdir(tmp_path / "h200"))
    assert {"single.log", "fsdp.log", "table.txt", "rows.jsonl", "single", "fsdp"} <= set(kept), kept
    assert "synthetic_data" not in kept
    assert out.index("nanoGPT-style GPT") < out.index("== train_gpt2.py (single)") < \
        out.index("train_gpt2.py, one process ") < out.index("== train_gpt2.py (fsdp)")
    table = (tmp_path / "h200" / "table.txt").read_text()
    assert table.startswith("GPT-2 2x32, 2 heads") and len(table.splitlines()) == 2 + 5
    assert "--val_data_paths=None" in out and "torch.distributed.run --standalone --nproc_per_node 1" in out
    assert "GPT-2 2x32, 2 heads, T=32, 1 x 32 tokens x 8 forwards per step, float32, cpu" in out
    for row in ("ours (compile off: cpu)", "ours, plain head", "nanoGPT-style GPT", "train_gpt2.py, one process",
                "train_gpt2.py, FSDP2 1 rank"):  # tok/s, x ours, MFU (none on a CPU), peak GiB, x ours
        assert re.search(rf"^{re.escape(row)} +[\d,]+ +\d+\.\d\d +n/a +\d+\.\d\d +\d+\.\d\d$", out, re.M), out
    assert re.search(r"^ours \(compile off: cpu\) +[\d,]+ +1\.00 ", out, re.M)


def test_a_missing_c_compiler_is_said_first():
    """torch.compile's Triton needs a C compiler: without one the script stops before any work, in one line."""
    env = dict(os.environ, DEVICE="cuda", CC="/nonexistent/cc")
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_h200.sh")], env=env, capture_output=True,
                            text=True, timeout=60)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == ("gpu_h200.sh: error: no C compiler (CC=/nonexistent/cc, gcc or clang): torch.compile's "
                             "Triton builds its launcher with one; install gcc (build-essential on Debian/Ubuntu) or "
                             "set CC\n")


def test_gpu_script_is_valid_bash():
    script = os.path.join(ROOT, "bench", "gpu_h200.sh")
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
