#!/usr/bin/env bash
# GPT-2 124M at 1024 context on one H200 (or any single GPU), synthetic tokens, estimated 6 minutes: one table of
# tok/s, MFU and peak memory, each against the first row (bf16 autocast, 524,288-token steps as configs/gpt2_124m.py):
#   ours                   model.GPT, blocks and loss-head chunks compiled: a bare forward/backward/AdamW loop
#   ours, plain head       the same with the full-logits head (nanoGPT's); ours, compile off: no torch.compile
#   nanoGPT-style GPT      a plain GPT written below (full logits over the padded vocabulary), the whole model
#                          compiled: the peer a user would pick instead
#   train_gpt2.py          the whole training loop (data, logging, loss sync), one process, autocast
#   train_gpt2.py FSDP2    the same under torchrun with one rank: the path every multi-GPU run takes (bf16 params,
#                          fp32 reduction)
# MFU counts llm.c's 6N + 6*L*C*T FLOPs per token (0.80 GFLOP for 124M at T=1024) against a dense bf16 peak of
# 989 TFLOP/s (H200 NVL: 835). Goal: at least 50% MFU (615K tok/s); llm.c's 124M run reached 468K tok/s per H100
# (8xH100, Oct 2024).
# torch.compile on a GPU needs a C compiler and the Python headers (Triton builds its launcher with them): both are
# checked first. Each row is printed as soon as it is measured; the logs, rows.jsonl and table.txt stay in OUT.
#   bash bench/gpu_h200.sh
#   OUT=h200_run1 bash bench/gpu_h200.sh
# Environment, defaults for the H200 run (tests/test_gpu_h200.py runs a tiny model on CPU through the same lines):
#   OUT=gpu_h200_<date-time>  the directory of the logs and the table (its synthetic tokens are removed at exit)
#   DEVICE=cuda      cpu: no nvidia-smi, float32, compile off
#   MODEL="12 12 768" layers, heads, width;  SEQ=1024 tokens per sequence;  BATCH=64 sequences per forward
#   STEPS=20         optimizer steps (8 forwards each) of each training run; the bare loops run half as many
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DEVICE=${DEVICE:-cuda} MODEL=${MODEL:-12 12 768} SEQ=${SEQ:-1024} BATCH=${BATCH:-64} \
    STEPS=${STEPS:-20} OUT=${OUT:-gpu_h200_$(date +%Y%m%d-%H%M%S)}
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
synthetic_dataset('$data/synthetic', 50257, max(int(1.3 * $STEPS * 8 * $BATCH * $SEQ), 500_000))"

# the table's rows: python3 -c "$table" bare (the bare loops), run OUT_NAME LABEL (a train_gpt2.py run), table (the end)
table=$(cat <<'EOF'
import json
import os
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


def add_row(name, tok_s, mfu, mem):
    """Print the row now (tok/s, x ours, MFU, peak GiB, x ours: against the first row) and keep it in OUT."""
    with open(rows_path, "a") as f:
        f.write(json.dumps([name, tok_s, mfu, mem]) + "\n")
    with open(rows_path) as f:
        first = json.loads(f.readline())
    text = (f"{name:34s} {tok_s:12,.0f} {tok_s / first[1]:7.2f} {f'{100 * mfu:.1f}%' if mfu else 'n/a':>6s} "
            f"{mem:9.2f} {mem / first[3]:7.2f}")
    print(text, flush=True)
    with open(table_path, "a") as f:
        f.write(text + "\n")


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
                train_gpt2.peak_memory(device)[0])

    title = (f"GPT-2 {n_layer}x{n_embd}, {n_head} heads, T={seq}, {batch} x {seq} tokens x 8 forwards per step, "
             f"{dtype}, {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    header = f"{'':34s} {'tok/s':>12s} {'x ours':>7s} {'MFU':>6s} {'peak GiB':>9s} {'x ours':>7s}"
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


def run_row(run, name):  # a train_gpt2.py run's medians from its metrics.jsonl, after compile and warm-up
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "train_loss" in r][steps // 4:]
    add_row(name, statistics.median(r["tokens_per_s"] for r in records),
            statistics.median(r["mfu"] for r in records) if records[0]["mfu"] is not None else None,
            max(r["peak_mem_gib"] for r in records))


if sys.argv[1] == "bare":
    bare_rows()
elif sys.argv[1] == "run":
    run_row(*sys.argv[2:])
else:
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f]
    print(f"llm.c per H100: 468,000 tok/s; ours is x{rows[0][1] / 468000:.2f} of it, train_gpt2.py FSDP2 "
          f"x{rows[-1][1] / 468000:.2f}")
EOF
)

echo "== bare loops, a row as each is measured"
python3 -c "$table" bare

# train_gpt2.py on the reference recipe, its data and evaluation replaced: synthetic tokens, validation on their 1%
train=(train_gpt2.py configs/gpt2_124m.py --data_paths="$data/synthetic" --index_mapping_dir="$data/cache"
       --split=99,1,0 --val_data_paths=None --val_tokens=$((SEQ * BATCH)) --hellaswag=None --ckpt_every_steps=0
       --n_layer="$n_layer" --n_head="$n_head" --n_embd="$n_embd" --seq_length="$SEQ" --local_batch_size="$BATCH"
       --global_batch_size=$((8 * BATCH)) --max_steps="$STEPS" --lr_warmup_steps=1 --device="$DEVICE"
       --dtype=$dtype --compile=$compile)
run() {  # out_dir name, the row's label, then the launcher; the log stays in OUT and is shown when the run fails
    local name=$1 label=$2
    shift 2
    echo "== train_gpt2.py ($name): $* ${train[*]} --out_dir=$OUT/$name (log: $OUT/$name.log)"
    "$@" "${train[@]}" --out_dir="$OUT/$name" > "$OUT/$name.log" 2>&1 || { tail -40 "$OUT/$name.log"; exit 1; }
    python3 -c "$table" run "$name" "$label"
}
run single "train_gpt2.py, one process" python3
run fsdp "train_gpt2.py, FSDP2 1 rank" python3 -m torch.distributed.run --standalone --nproc_per_node 1
python3 -c "$table" table
echo "== the table: $OUT/table.txt"
