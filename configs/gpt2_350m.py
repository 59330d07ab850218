# GPT-2 350M (d24), following llm.c's scripts/run_gpt2_350M.sh: 24 layers, 16 heads, 1024 wide; 60,000 steps of
# 524,288 tokens (~31.5B tokens), lr 3e-4 with 700 warmup steps and cosine decay to 0, weight decay 0.1.
# llm.c trains it on FineWeb sample-100BT; this config uses FineWeb-Edu sample-100BT (the whole project's data):
#   python prepare_fineweb.py --sample 100BT --data-dir fineweb_edu_100b --workers 32
#   torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_350m.py
data_paths = "fineweb_edu_100b/megatron_gpt2/processed_data_*_text_document"
split = "100,0,0"  # no Megatron validation split: validation comes from val_data_paths
val_data_paths = "fineweb_edu_100b/megatron_gpt2/val_text_document"
seq_length = 1024

n_layer, n_head, n_embd = 24, 16, 1024
vocab_size = 50257
padded_vocab_size = 50304

global_batch_size = 512
local_batch_size = 64  # llm.c: -b 64 on 8 x 80 GB
max_steps = 60_000
lr, min_lr = 3e-4, 0.0
lr_warmup_steps = 700
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

val_every_steps = 250
val_tokens = 10_485_760
hellaswag = "download"
ckpt_every_steps = 2000
out_dir = "out_gpt2_350m"

dtype = "bfloat16"
compile = True
