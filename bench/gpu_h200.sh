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
# 989 TFLOP/s. Goal: at least 50% MFU (615K tok/s); llm.c's 124M run reached 468K tok/s per H100 (8xH100, Oct 2024).
# torch.compile on a GPU needs a C compiler and the Python headers (Triton builds its launcher with them).
#   bash bench/gpu_h200.sh
# Environment, defaults for the H200 run (tests/test_gpu_h200.py runs a tiny model on CPU through the same lines):
#   DEVICE=cuda      cpu: no nvidia-smi, float32, compile off
#   MODEL="12 12 768" layers, heads, width;  SEQ=1024 tokens per sequence;  BATCH=64 sequences per forward
#   STEPS=20         optimizer steps (8 forwards each) of each training run; the bare loops run half as many
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DEVICE=${DEVICE:-cuda} MODEL=${MODEL:-12 12 768} SEQ=${SEQ:-1024} BATCH=${BATCH:-64} \
    STEPS=${STEPS:-20}
read -r n_layer n_head n_embd <<< "$MODEL"
if [ "$DEVICE" = cpu ]; then dtype=float32 compile=False; else dtype=bfloat16 compile=True; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name()
                                if torch.cuda.is_available() else 'CPU')"
python3 -c "
import sys
sys.path.insert(0, 'bench')
from bench_train import synthetic_dataset
synthetic_dataset('$work/synthetic', 50257, max(int(1.3 * $STEPS * 8 * $BATCH * $SEQ), 500_000))"

# train_gpt2.py on the reference recipe, its data and evaluation replaced: synthetic tokens, validation on their 1%
train=(train_gpt2.py configs/gpt2_124m.py --data_paths="$work/synthetic" --index_mapping_dir="$work/cache"
       --split=99,1,0 --val_data_paths=None --val_tokens=$((SEQ * BATCH)) --hellaswag=None --ckpt_every_steps=0
       --n_layer="$n_layer" --n_head="$n_head" --n_embd="$n_embd" --seq_length="$SEQ" --local_batch_size="$BATCH"
       --global_batch_size=$((8 * BATCH)) --max_steps="$STEPS" --device="$DEVICE" --dtype=$dtype --compile=$compile)
run() {  # out_dir name, then the launcher; the log is shown only when the run fails
    local name=$1
    shift
    echo "== train_gpt2.py ($name): $* ${train[*]} --out_dir=$work/$name"
    "$@" "${train[@]}" --out_dir="$work/$name" > "$work/$name.log" 2>&1 || { tail -40 "$work/$name.log"; exit 1; }
}
run single python3
run fsdp python3 -m torch.distributed.run --standalone --nproc_per_node 1

echo "== bare loops, then the table"
python3 - "$work" "$dtype" "$compile" <<'EOF'
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

work, dtype, compile_ = sys.argv[1], sys.argv[2], sys.argv[3] == "True"
n_layer, n_head, n_embd = map(int, os.environ["MODEL"].split())
seq, batch, steps, device = int(os.environ["SEQ"]), int(os.environ["BATCH"]), int(os.environ["STEPS"]), \
    torch.device(os.environ["DEVICE"])


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


bare_steps = max(steps // 2, 3)
args = types.SimpleNamespace(n_layer=n_layer, n_head=n_head, n_embd=n_embd, seq_length=seq, vocab_size=50257,
                             padded_vocab_size=50304, batch_size=batch, grad_accum=8, dtype=dtype, seed=1234,
                             warmup=bare_steps // 3)
tokens = batch * 8 * seq
with torch.device("meta"):
    flops = GPT(GPTConfig(block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)).flops_per_token(seq)
peak = train_gpt2.peak_flops(device)
rows = []  # (name, tok/s, MFU or None, peak GiB)


def ours(cfg, compile_loss=compile_):  # the loss head's chunks compiled with the blocks, as bench_step_vs_nanogpt.py
    model = GPT(cfg)
    model.compile_loss = compile_loss
    return model


def bare(name, plain_head=False, compile=compile_, model=ours):
    bench_train.GPT = model  # bare_loop builds its model from this name
    train_gpt2.peak_memory(device, reset=True)
    seconds = bench_train.bare_loop(types.SimpleNamespace(**vars(args), compile=compile), device, bare_steps,
                                    plain_head=plain_head)
    rows.append((name, tokens / seconds, tokens / seconds * flops / peak if peak else None,
                 train_gpt2.peak_memory(device)[0]))
    print(f"{name}: {tokens / seconds:,.0f} tok/s", flush=True)


bare("ours" + ("" if compile_ else " (compile off: cpu)"))
bare("ours, plain head", plain_head=True)
if compile_:
    bare("ours, compile off", compile=False, model=lambda cfg: ours(cfg, compile_loss=False))
bare("nanoGPT-style GPT" + (", whole model compiled" if compile_ else ""), compile=False,
     model=lambda cfg: torch.compile(PlainGPT(cfg), disable=not compile_))
for run, name in (("single", "train_gpt2.py, one process"), ("fsdp", "train_gpt2.py, FSDP2 1 rank")):
    with open(os.path.join(work, run, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "train_loss" in r][steps // 4:]  # after compile and warm-up
    rows.append((name, statistics.median(r["tokens_per_s"] for r in records),
                 statistics.median(r["mfu"] for r in records) if records[0]["mfu"] is not None else None,
                 max(r["peak_mem_gib"] for r in records)))

print(f"\nGPT-2 {n_layer}x{n_embd}, {n_head} heads, T={seq}, {batch} x {seq} tokens x 8 forwards per step, {dtype}, "
      f"{device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
print(f"{'':34s} {'tok/s':>12s} {'x ours':>7s} {'MFU':>6s} {'peak GiB':>9s} {'x ours':>7s}")
for name, tok_s, mfu, mem in rows:
    print(f"{name:34s} {tok_s:12,.0f} {tok_s / rows[0][1]:7.2f} {f'{100 * mfu:.1f}%' if mfu else 'n/a':>6s} "
          f"{mem:9.2f} {mem / rows[0][3]:7.2f}")
print(f"llm.c per H100: 468,000 tok/s; ours is x{rows[0][1] / 468000:.2f} of it, train_gpt2.py FSDP2 "
      f"x{rows[-1][1] / 468000:.2f}")
EOF
