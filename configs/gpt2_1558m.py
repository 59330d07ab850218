# GPT-2 1558M (d48), following llm.c's scripts/run_gpt2_1558M.sh: 48 layers, 25 heads, 1600 wide, on FineWeb-Edu
# sample-100BT; 32,000 steps of 1,048,576 tokens (~33.6B tokens), lr 6e-4 with 700 warmup steps and cosine decay to
# 0.1 x lr, weight decay 0.1, local batch 16 (8 x H100 80 GB).
#   python prepare_fineweb.py --sample 100BT --data-dir fineweb_edu_100b --workers 32
#   torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_1558m.py
# With less GPU memory: activation_checkpointing = True, or a smaller local_batch_size (the memory plan printed
# before the first step says whether it fits).
data_paths = "fineweb_edu_100b/megatron_gpt2/processed_data_*_text_document"
split = "100,0,0"  # no Megatron validation split: validation comes from val_data_paths
val_data_paths = "fineweb_edu_100b/megatron_gpt2/val_text_document"
seq_length = 1024

n_layer, n_head, n_embd = 48, 25, 1600
vocab_size = 50257
padded_vocab_size = 50304

global_batch_size = 1024  # 1,048,576 tokens per step
local_batch_size = 16
max_steps = 32_000
lr, min_lr = 6e-4, 6e-5
lr_warmup_steps = 700
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

val_every_steps = 250
val_tokens = 10_485_760
hellaswag = "download"
ckpt_every_steps = 2000
out_dir = "out_gpt2_1558m"

dtype = "bfloat16"
compile = True
