#!/usr/bin/env bash
# GPT-2 124M at 1024 context on one H200 (or any single GPU): tokens/s, MFU and peak memory of train_gpt2.py, on
# synthetic tokens, in about 5 minutes. Nothing is written outside a temporary directory.
#   bash bench/gpu_h200.sh
# 1. bench_train.py: one process (bf16 autocast), the full training loop against a bare forward/backward/step loop
#    on the same model and batch (the loop's overhead), 64 x 1024 tokens per forward, 8 forwards per step.
# 2. torchrun with one rank: the FSDP2 path (bf16 params, fp32 reduction) every multi-GPU run takes, with the
#    reference recipe's 524,288-token steps (configs/gpt2_124m.py).
# 3. the bare loop with the chunked loss head against the plain full-logits head (nanoGPT's): tok/s, MFU, peak
#    memory, as ratios.
# MFU counts llm.c's 6N + 6*L*C*T FLOPs per token (0.80 GFLOP for 124M at T=1024) against a dense bf16 peak of
# 989 TFLOP/s. Goal: at least 50% MFU (615K tok/s); llm.c's 124M run reached 468K tok/s per H100 (8xH100, Oct 2024).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"

echo "== 1. train_gpt2.py loop vs bare loop, one process"
python3 bench/bench_train.py --n-layer 12 --n-head 12 --n-embd 768 --seq-length 1024 --batch-size 64 \
    --grad-accum 8 --padded-vocab-size 50304 --dtype bfloat16 --compile --rounds 1 --steps 20 --warmup 6 2>&1 \
    | grep -v '^step\|^  "\|^[{}]'

echo "== 2. torchrun, 1 rank (FSDP2), configs/gpt2_124m.py, 20 steps"
python3 -c "
import sys; sys.path.insert(0, 'bench')
from bench_train import synthetic_dataset
synthetic_dataset('$work/synthetic', 50257, 13_000_000)"
python3 -m torch.distributed.run --standalone --nproc_per_node 1 train_gpt2.py configs/gpt2_124m.py \
    --data_paths="$work/synthetic" --index_mapping_dir="$work/cache" --split=99,1,0 --out_dir="$work/out" \
    --max_steps=20 --val_tokens=65536 --hellaswag=None --ckpt_every_steps=0 2>&1 | grep -v '^  "\|^[{}]'
python3 - "$work/out/metrics.jsonl" <<'EOF'
import json, statistics, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if "train_loss" in r][5:]  # after compile and warm-up
tok_s = statistics.median(r["tokens_per_s"] for r in steps)
mfu = statistics.median(r["mfu"] for r in steps) if steps[0]["mfu"] is not None else None
print(f"FSDP2 1 rank, steps 5-19: median {tok_s:,.0f} tok/s, MFU " + (f"{100 * mfu:.1f}%" if mfu else "n/a")
      + f" (llm.c's FLOP count), peak memory {max(r['peak_mem_gib'] for r in steps):.1f} GiB; llm.c per H100: 468,000 tok/s "
      f"(x{tok_s / 468000:.2f})")
EOF

echo "== 3. loss heads: chunked (ours) vs plain full logits, bare loop, 64 x 1024 tokens per step"
python3 bench/bench_train.py --loss-heads --n-layer 12 --n-head 12 --n-embd 768 --seq-length 1024 --batch-size 64 \
    --padded-vocab-size 50304 --dtype bfloat16 --compile --rounds 1 --steps 12 --warmup 4
