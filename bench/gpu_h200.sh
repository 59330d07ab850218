#!/usr/bin/env bash
# The first-GPU check: GPT-2 124M at 1024 context on one H100 or H200 (or any single GPU), synthetic tokens, one
# command, about 8 minutes (estimated; no GPU has run it yet), printing one table as it goes.
# Speed: tok/s, MFU, peak allocated and reserved memory, each against the first row (bf16 autocast, 524,288-token steps
# as configs/gpt2_124m.py):
#   ours                   model.GPT, blocks and loss-head chunks compiled: a bare forward/backward/AdamW loop
#   ours, plain head       the same with the full-logits head (nanoGPT's); ours, compile off: no torch.compile
#   nanoGPT-style GPT      a plain GPT written below (full logits over the padded vocabulary), the whole model
#                          compiled: the peer a user would pick instead
#   train_gpt2.py          the whole training loop (data, logging, loss sync), one process, autocast
#   train_gpt2.py FSDP2    the same under torchrun with one rank: the path every multi-GPU run takes (bf16 params,
#                          fp32 reduction)
#   train_gpt2.py, Muon    the one-process run with --optimizer=muon
# Checks, on runs of CHECK_STEPS steps of one micro-batch each, evaluating (validation, HellaSwag on the tests'
# fixture, a sample) every 10 steps:
#   python vs torchrun     the train losses of `python` (autocast over fp32 weights) and `torchrun --nproc_per_node 1`
#                          (FSDP2's bf16 parameters): their largest relative difference (4e-4 on a CPU in bf16)
#   recompiles             "Recompiling function" lines of both runs under TORCH_LOGS=recompiles: expected 0, as
#                          evaluation runs the model uncompiled
#   SIGTERM and resume     the run sends itself SIGTERM as step CHECK_STEPS/2 ends, checkpoints, and is rerun: are its
#                          losses the uninterrupted run's, bit for bit? Default, then --deterministic=True
#   deterministic, Muon    step time against the default run's, and Muon's against AdamW's (the speed rows)
# MFU counts llm.c's 6N + 6*L*C*T FLOPs per token (0.80 GFLOP for 124M at T=1024) against a dense bf16 peak of
# 989 TFLOP/s (H200 NVL: 835). Goal: at least 50% MFU (615K tok/s); llm.c's 124M run reached 468K tok/s per H100
# (8xH100, Oct 2024).
# Time on one H100, estimated per row (compiles are cold the first time a graph is seen, then read from Inductor's
# cache): setup and synthetic tokens 15 s; bare loops 45 + 20 + 15 + 50 s; train_gpt2.py one process 35 s, FSDP2
# 60 s (its bf16 graphs compile cold), Muon 35 s; checks: python 25 s, torchrun 30 s, SIGTERM and resume 45 s,
# deterministic 50 s (Inductor's deterministic graphs compile cold), deterministic SIGTERM and resume 45 s. About
# 470 s in all.
# torch.compile on a GPU needs a C compiler and the Python headers (Triton builds its launcher with them): both are
# checked first. Each row is printed as soon as it is measured; the logs, rows.jsonl and table.txt stay in OUT.
#   bash bench/gpu_h200.sh
#   OUT=h200_run1 bash bench/gpu_h200.sh
# Environment, defaults for the GPU run (tests/test_gpu_h200.py runs a tiny model on CPU through the same lines):
#   OUT=gpu_h200_<date-time>  the directory of the logs and the table (its synthetic tokens are removed at exit)
#   DEVICE=cuda      cpu: no nvidia-smi, float32, compile off
#   MODEL="12 12 768" layers, heads, width;  SEQ=1024 tokens per sequence;  BATCH=64 sequences per forward
#   STEPS=12         optimizer steps (8 forwards each) of each speed run; the bare loops run half as many
#   CHECK_STEPS=50   optimizer steps (1 forward each) of each check run
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DEVICE=${DEVICE:-cuda} MODEL=${MODEL:-12 12 768} SEQ=${SEQ:-1024} BATCH=${BATCH:-64} \
    STEPS=${STEPS:-12} CHECK_STEPS=${CHECK_STEPS:-50} OUT=${OUT:-gpu_h200_$(date +%Y%m%d-%H%M%S)}
read -r n_layer n_head n_embd <<< "$MODEL"
if [ "$DEVICE" = cpu ]; then dtype=float32 compile=False; else dtype=bfloat16 compile=True; fi
export DTYPE=$dtype COMPILE=$compile
if [ "$compile" = True ]; then  # what Triton needs before it compiles anything, said before minutes of setup
  compiler=${CC:-$(command -v gcc || command -v clang || true)}  # Triton's choice: $CC, else gcc, else clang
  if [ -z "$compiler" ] || ! command -v "$compiler" > /dev/null; then
    echo "gpu_h200.sh: error: no C compiler (${CC:+CC=$CC, }gcc or clang): torch.compile's Triton builds its" \
         "launcher with one; install gcc (build-essential on Debian/Ubuntu) or set CC" >&2
    exit 1
  fi
  if ! python3 -c "import os, sys, sysconfig; sys.exit(not os.path.isfile(sysconfig.get_paths()['include'] + '/Python.h'))"
  then
    echo "gpu_h200.sh: error: no Python headers (Python.h) for $(python3 -c 'import sys; print(sys.executable)'):" \
         "Triton compiles against them; install python3-dev (python3-devel on RHEL) for this Python" >&2
    exit 1
  fi
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
data=$OUT/synthetic_data  # gigabytes of tokens and their index cache: removed at exit, the logs are kept
mkdir -p "$data"
trap 'rm -rf "$data"' EXIT
echo "== logs and the table in $OUT"

[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name()
                                if torch.cuda.is_available() else 'CPU')"
python3 -c "
import sys
sys.path.insert(0, 'bench')
from bench_train import synthetic_dataset
synthetic_dataset('$data/synthetic', 50257, max(int(1.3 * ($STEPS * 8 + $CHECK_STEPS) * $BATCH * $SEQ), 500_000))"

# python3 -c "$table" WHAT: bare (the bare loops' rows), train ARGS (a train_gpt2.py run), speed NAME LABEL (a
# train_gpt2.py run's row), checks (the checks' rows), table (the end)
table=$(cat <<'EOF'
import json
import os
import signal
import statistics
import sys
import types

sys.path.insert(0, "bench")
import torch
import torch.nn as nn
import torch.nn.functional as F
import bench_train
import train_gpt2
from model import GPT, GPTConfig

out, dtype, compile_ = os.environ["OUT"], os.environ["DTYPE"], os.environ["COMPILE"] == "True"
n_layer, n_head, n_embd = map(int, os.environ["MODEL"].split())
seq, batch, steps, device = int(os.environ["SEQ"]), int(os.environ["BATCH"]), int(os.environ["STEPS"]), \
    torch.device(os.environ["DEVICE"])
rows_path, table_path = os.path.join(out, "rows.jsonl"), os.path.join(out, "table.txt")


def say(text, row):
    """Print a line of the table now, and keep it in table.txt and its numbers in rows.jsonl."""
    print(text, flush=True)
    with open(table_path, "a") as f:
        f.write(text + "\n")
    with open(rows_path, "a") as f:
        f.write(json.dumps(row) + "\n")


def gib(value):
    return "n/a" if value is None else f"{value:.2f}"


def add_row(name, tok_s, mfu, mem, reserved):
    """A speed row: tok/s, x ours, MFU, peak allocated GiB, x ours, reserved GiB (against the first row)."""
    first = None
    if os.path.exists(rows_path):
        with open(rows_path) as f:
            first = json.loads(f.readline())
    first = first or dict(tok_s=tok_s, mem=mem)
    say(f"{name:34s} {tok_s:12,.0f} {tok_s / first['tok_s']:7.2f} {f'{100 * mfu:.1f}%' if mfu else 'n/a':>6s} "
        f"{mem:9.2f} {mem / first['mem']:7.2f} {gib(reserved):>9s}",
        dict(row=name, tok_s=tok_s, mfu=mfu, mem=mem, reserved=reserved))


def reserved_gib():  # the caching allocator never hands memory back, so what it holds at the end is its peak
    if device.type != "cuda":
        return None
    return max(torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()) / 2**30


class PlainBlock(nn.Module):  # nanoGPT's Block: pre-LayerNorm, fused qkv, causal SDPA, tanh GELU
    def __init__(self, c, n_head):
        super().__init__()
        self.n_head, self.ln_1, self.ln_2 = n_head, nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.c_proj, self.c_fc, self.mlp_proj = (nn.Linear(c, 3 * c), nn.Linear(c, c),
                                                              nn.Linear(c, 4 * c), nn.Linear(4 * c, c))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):  # nanoGPT's GPT: tied embedding, logits over all padded rows, then the loss from them
    def __init__(self, cfg):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(PlainBlock(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bare_rows():
    bare_steps = max(steps // 2, 3)
    args = types.SimpleNamespace(n_layer=n_layer, n_head=n_head, n_embd=n_embd, seq_length=seq, vocab_size=50257,
                                 padded_vocab_size=50304, batch_size=batch, grad_accum=8, dtype=dtype, seed=1234,
                                 warmup=bare_steps // 3)
    tokens = batch * 8 * seq
    with torch.device("meta"):
        flops = GPT(GPTConfig(block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)).flops_per_token(seq)
    peak = train_gpt2.peak_flops(device)

    def ours(cfg, compile_loss=compile_):  # the loss head's chunks compiled with the blocks
        model = GPT(cfg)
        model.compile_loss = compile_loss
        return model

    def bare(name, plain_head=False, compile=compile_, model=ours):
        bench_train.GPT = model  # bare_loop builds its model from this name
        train_gpt2.peak_memory(device, reset=True)
        seconds = bench_train.bare_loop(types.SimpleNamespace(**vars(args), compile=compile), device, bare_steps,
                                        plain_head=plain_head)
        add_row(name, tokens / seconds, tokens / seconds * flops / peak if peak else None,
                train_gpt2.peak_memory(device)[0], reserved_gib())
        if device.type == "cuda":  # the next row's reserved memory is its own
            torch.cuda.empty_cache()

    title = (f"GPT-2 {n_layer}x{n_embd}, {n_head} heads, T={seq}, {batch} x {seq} tokens x 8 forwards per step, "
             f"{dtype}, {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    header = f"{'':34s} {'tok/s':>12s} {'x ours':>7s} {'MFU':>6s} {'peak GiB':>9s} {'x ours':>7s} {'reserved':>9s}"
    if os.path.exists(rows_path):
        os.remove(rows_path)
    with open(table_path, "w") as f:
        f.write(f"{title}\n{header}\n")
    print(f"\n{title}\n{header}", flush=True)
    bare("ours" + ("" if compile_ else " (compile off: cpu)"))
    bare("ours, plain head", plain_head=True)
    if compile_:
        bare("ours, compile off", compile=False, model=lambda cfg: ours(cfg, compile_loss=False))
    bare("nanoGPT-style GPT" + (", whole model compiled" if compile_ else ""), compile=False,
         model=lambda cfg: torch.compile(PlainGPT(cfg), disable=not compile_))


def train_run(argv):
    """train_gpt2.py's command line run as `python train_gpt2.py` runs it (train_gpt2.cli), in this process, so that
    the memory the run reserved can be read at its end. SIGTERM_AT=N: the run sends itself SIGTERM as step N ends (a
    CPU's quick steps could outrun a signal sent from outside)."""
    if os.environ.get("SIGTERM_AT"):
        real_end_step = train_gpt2.StepLog.end_step

        def end_step(self, step, *rest):
            if step == int(os.environ["SIGTERM_AT"]):
                os.kill(os.getpid(), signal.SIGTERM)
            return real_end_step(self, step, *rest)

        train_gpt2.StepLog.end_step = end_step
    out_dir = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--out_dir=")][-1]
    try:
        train_gpt2.cli(argv)
    finally:
        if device.type == "cuda" and int(os.environ.get("RANK", 0)) == 0:
            with open(os.path.join(out_dir, "reserved_gib"), "w") as f:
                f.write(str(reserved_gib()))


def records(name, key):
    """{step: value} of `key` in run NAME's metrics.jsonl (later records win, as after a resume); None if it failed."""
    path = os.path.join(out, name, "metrics.jsonl")
    if os.path.exists(os.path.join(out, name + ".failed")) or not os.path.exists(path):
        return None
    with open(path) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


def speed_row(name, label):  # a train_gpt2.py run's medians from its metrics.jsonl, after compile and warm-up
    step_ms = records(name, "step_ms")
    if step_ms is None:
        return say(f"{label:34s} failed: see {name}.log", dict(row=label, failed=True))
    kept = sorted(step_ms)[steps // 4:]
    tok_s, mfu, mem = (records(name, key) for key in ("tokens_per_s", "mfu", "run_peak_mem_gib"))
    reserved = None
    if os.path.exists(os.path.join(out, name, "reserved_gib")):
        reserved = float(open(os.path.join(out, name, "reserved_gib")).read())
    add_row(label, statistics.median(tok_s[s] for s in kept),
            statistics.median(mfu[s] for s in kept) if mfu[kept[0]] is not None else None, max(mem.values()), reserved)


def check_row(name, value, row):
    say(f"{name:64s} {value}", dict(check=name, **row))


def launchers(a, b):
    ours, theirs = records(a, "train_loss"), records(b, "train_loss")
    if not ours or not theirs:
        return check_row(f"python vs torchrun, {dtype}, train loss", f"failed: see {a}.log, {b}.log", {})
    difference = max(abs(ours[s] - theirs[s]) / abs(ours[s]) for s in ours)
    check_row(f"python vs torchrun 1 rank, {len(ours)} steps, {dtype}, train loss",
              f"max relative difference {difference:.1e}", dict(difference=difference))


def recompiles(*names):
    counts = []
    for name in names:
        with open(os.path.join(out, name + ".log")) as f:
            counts.append(sum("Recompiling function" in line for line in f))
    check_row(f"recompiles, runs evaluating every 10 steps ({' / '.join(names)})",
              " / ".join(map(str, counts)) + (" (expected 0)" if compile_ else " (compile off: cpu)"),
              dict(recompiles=counts))


def resume(reference, resumed, label):
    ours, theirs = records(reference, "train_loss"), records(resumed, "train_loss")
    if not ours or not theirs or ours.keys() != theirs.keys():
        return check_row(f"SIGTERM and resume, {label}", f"failed: see {reference}.log, {resumed}.log", {})
    difference = max(abs(ours[s] - theirs[s]) for s in ours)
    check_row(f"SIGTERM at step {int(os.environ['CHECK_STEPS']) // 2} and resume, {label}, train loss",
              f"bit for bit {'yes' if ours == theirs else 'no'}, max difference {difference:.1e}",
              dict(bit_for_bit=ours == theirs, difference=difference))


def time_ratio(a, b, label):
    ours, theirs = records(a, "step_ms"), records(b, "step_ms")
    if not ours or not theirs:
        return check_row(label, f"failed: see {a}.log, {b}.log", {})
    ratio = statistics.median(list(ours.values())[steps // 4:]) / statistics.median(list(theirs.values())[steps // 4:])
    check_row(label, f"{ratio:.2f}x (median step times)", dict(ratio=ratio))


what, args = sys.argv[1], sys.argv[2:]
if what == "bare":
    bare_rows()
elif what == "train":
    train_run(args)
elif what == "speed":
    speed_row(*args)
elif what == "checks":
    print(flush=True)
    launchers("python", "torchrun")
    recompiles("python", "torchrun")
    resume("python", "resumed", "default")
    resume("deterministic", "deterministic_resumed", "--deterministic=True")
    time_ratio("deterministic", "python", "deterministic=True step time / default")
    time_ratio("muon", "single", "Muon step time / AdamW's (train_gpt2.py, one process)")
else:
    with open(rows_path) as f:
        rows = {row["row"]: row for row in map(json.loads, f) if "tok_s" in row}
    first, fsdp = list(rows.values())[0], rows.get("train_gpt2.py, FSDP2 1 rank", dict(tok_s=0))
    print(f"llm.c per H100: 468,000 tok/s; ours is x{first['tok_s'] / 468000:.2f} of it, train_gpt2.py FSDP2 "
          f"x{fsdp['tok_s'] / 468000:.2f}")
EOF
)

echo "== bare loops, a row as each is measured"
python3 -c "$table" bare

# train_gpt2.py on the reference recipe, its data and evaluation replaced: synthetic tokens, validation on their 1%
train=(configs/gpt2_124m.py --data_paths="$data/synthetic" --index_mapping_dir="$data/cache" --split=99,1,0
       --val_data_paths=None --val_tokens=$((SEQ * BATCH)) --hellaswag=None --ckpt_every_steps=0 --hf_export=off
       --n_layer="$n_layer" --n_head="$n_head" --n_embd="$n_embd" --seq_length="$SEQ" --local_batch_size="$BATCH"
       --global_batch_size=$((8 * BATCH)) --max_steps="$STEPS" --lr_warmup_steps=1 --device="$DEVICE"
       --dtype=$dtype --compile=$compile)
python=(python3 -c "$table" train)  # train_gpt2.cli() in the table's process, which then reads the memory reserved
torchrun=(python3 -m torch.distributed.run --standalone --nproc_per_node 1 --no-python "${python[@]}")
failed=""
launch() {  # out_dir name, the exit status expected, then the command; a failure is said, kept in OUT, and counted
    local name=$1 expected=$2 status=0
    shift 2
    echo "== train_gpt2.py ($name): ${*//"$table"/\"\$table\"} --out_dir=$OUT/$name (log: $OUT/$name.log)"
    "$@" --out_dir="$OUT/$name" >> "$OUT/$name.log" 2>&1 || status=$?
    if [ "$status" != "$expected" ]; then
      tail -40 "$OUT/$name.log"
      echo "== train_gpt2.py ($name) exited $status, not $expected: its rows say failed" | tee "$OUT/$name.failed"
      failed="$failed $name"
    fi
}
speed() {  # out_dir name, the row's label, then the command: a speed row
    local name=$1 label=$2
    shift 2
    launch "$name" 0 "$@"
    python3 -c "$table" speed "$name" "$label"
}
speed single "train_gpt2.py, one process" "${python[@]}" "${train[@]}"
speed fsdp "train_gpt2.py, FSDP2 1 rank" "${torchrun[@]}" "${train[@]}"
speed muon "train_gpt2.py, Muon" "${python[@]}" "${train[@]}" --optimizer=muon

# The checks' runs: one forward a step, evaluating every 10 steps with HellaSwag (the tests' small file) and a sample
check=("${train[@]}" --global_batch_size="$BATCH" --max_steps="$CHECK_STEPS" --val_every_steps=10
       --hellaswag=tests/fixtures/hellaswag_small.jsonl --sample_tokens=16)
half=$((CHECK_STEPS / 2))
echo "== checks: runs of $CHECK_STEPS steps, one forward each, evaluating every 10 steps"
TORCH_LOGS=recompiles launch python 0 "${python[@]}" "${check[@]}"
TORCH_LOGS=recompiles launch torchrun 0 "${torchrun[@]}" "${check[@]}"
SIGTERM_AT=$half launch resumed 143 "${python[@]}" "${check[@]}"  # stopped and checkpointed as step $half ends
launch resumed 0 "${python[@]}" "${check[@]}"  # the same command resumes it
launch deterministic 0 "${python[@]}" "${check[@]}" --deterministic=True
SIGTERM_AT=$half launch deterministic_resumed 143 "${python[@]}" "${check[@]}" --deterministic=True
launch deterministic_resumed 0 "${python[@]}" "${check[@]}" --deterministic=True
python3 -c "$table" checks
python3 -c "$table" table
echo "== the table: $OUT/table.txt"
if [ -n "$failed" ]; then
  echo "gpu_h200.sh: error: these runs failed:$failed (their logs are in $OUT)" >&2
  exit 1
fi
