"""bench/gpu_h200.sh as written, on CPU with a tiny model: its train_gpt2.py command lines (one process, torchrun with
one rank: the FSDP2 path, Muon, the checks' runs with their SIGTERM and resume), its bare loops and the nanoGPT-style
peer run and print every row of the table, so the GPU check can no longer break unseen (it once died on the reference
config's val_data_paths before training)."""
import json
import os
import re
import subprocess

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_gpu_script_runs_on_cpu_with_a_tiny_model(tmp_path):
    env = dict(os.environ, DEVICE="cpu", MODEL="2 2 32", SEQ="32", BATCH="1", STEPS="2", CHECK_STEPS="6",
               OUT=str(tmp_path / "h200"))
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_h200.sh")], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    # the logs and the table stay in OUT (the synthetic tokens do not); each row was printed as it was measured,
    # the bare loops' before the train_gpt2.py runs started
    kept = sorted(os.listdir(tmp_path / "h200"))
    runs = {"single", "fsdp", "muon", "python", "torchrun", "resumed", "deterministic", "deterministic_resumed"}
    assert runs | {f"{run}.log" for run in runs} | {"table.txt", "rows.jsonl"} == set(kept), kept
    assert out.index("nanoGPT-style GPT") < out.index("== train_gpt2.py (single)") < \
        out.index("train_gpt2.py, one process ") < out.index("== train_gpt2.py (fsdp)")
    table = (tmp_path / "h200" / "table.txt").read_text()
    assert table.startswith("GPT-2 2x32, 2 heads") and len(table.splitlines()) == 2 + 6 + 6
    assert "--val_data_paths=None" in out and "torch.distributed.run --standalone --nproc_per_node 1" in out
    assert "GPT-2 2x32, 2 heads, T=32, 1 x 32 tokens x 8 forwards per step, float32, cpu" in out
    for row in ("ours (compile off: cpu)", "ours, plain head", "nanoGPT-style GPT", "train_gpt2.py, one process",
                "train_gpt2.py, FSDP2 1 rank", "train_gpt2.py, Muon"):
        # tok/s, x ours, MFU (none on a CPU), peak allocated GiB, x ours, reserved GiB (none on a CPU)
        assert re.search(rf"^{re.escape(row)} +[\d,]+ +\d+\.\d\d +n/a +\d+\.\d\d +\d+\.\d\d +n/a$", out, re.M), out
    assert re.search(r"^ours \(compile off: cpu\) +[\d,]+ +1\.00 ", out, re.M)
    checks = [r"python vs torchrun 1 rank, 6 steps, float32, train loss +max relative difference \d\.\de[+-]\d\d",
              r"recompiles, runs evaluating every 10 steps \(python / torchrun\) +0 / 0 \(compile off: cpu\)",
              # the run stopped by SIGTERM at step 3 (exit 143) and its rerun retrace the run bit for bit on a CPU
              r"SIGTERM at step 3 and resume, default, train loss +bit for bit yes, max difference 0\.0e\+00",
              r"SIGTERM at step 3 and resume, --deterministic=True, train loss +bit for bit yes, "
              r"max difference 0\.0e\+00",
              r"deterministic=True step time / default +\d+\.\d\dx \(median step times\)",
              r"Muon step time / AdamW's \(train_gpt2.py, one process\) +\d+\.\d\dx \(median step times\)"]
    for check in checks:
        assert re.search(rf"^{check}$", out, re.M), (check, out[-3000:])
    assert "stopped by a signal at step 4" in (tmp_path / "h200" / "resumed.log").read_text()
    rows = [json.loads(line) for line in open(tmp_path / "h200" / "rows.jsonl")]
    assert [row.get("bit_for_bit") for row in rows if "bit_for_bit" in row] == [True, True]


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
