# GPT-2 124M on FineWeb-Edu sample-10BT, build-nanogpt's run (train_gpt2.py in karpathy/build-nanogpt: max_steps
# 19073, warmup_steps 715, max_lr 6e-4 decaying by cosine to min_lr = 0.1 x max_lr, 524,288 tokens per step):
#   python prepare_fineweb.py --workers 32     # fineweb_edu/megatron_gpt2/{val,processed_data_*}_text_document
#   torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py
# Validation is llm.c's and build-nanogpt's: the first 10,485,760 tokens of their val shard (the first 100M tokens of
# the sample, which prepare_fineweb.py writes as val_text_document), read as 10,240 windows of 1024. Training uses
# every other document; 19,073 steps x 524,288 tokens is a little more than one epoch of them, which repeats the
# documents (blended by token count, each file in whole shuffled epochs).

data_paths = "fineweb_edu/megatron_gpt2/processed_data_*_text_document"
split = "100,0,0"  # no Megatron validation split: validation comes from val_data_paths
val_data_paths = "fineweb_edu/megatron_gpt2/val_text_document"
seq_length = 1024

n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50257
padded_vocab_size = 50304

global_batch_size = 512
local_batch_size = 64  # 80 GB GPUs; use 32 or 16 with less memory (gradient accumulation makes up the rest)
max_steps = 19073
lr = 6e-4
min_lr = 6e-5
lr_warmup_steps = 715
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

# llm.c's run instead (scripts/run_gpt2_124M.sh: -x 18865 steps, -u 700 warmup, -q 0.0 final lr fraction):
# max_steps = 18865
# lr_warmup_steps = 700
# min_lr = 0.0

val_every_steps = 250
val_tokens = 10_485_760
hellaswag = "download"
ckpt_every_steps = 1000
out_dir = "out_gpt2_124m"

dtype = "bfloat16"
compile = True
