# GPT-2 124M on FineWeb-Edu 10B, the llm.c / build-nanogpt recipe:
#   torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py
# 524,288 tokens per step (512 x 1024) for one epoch of the train split (about 9.7B of sample-10BT's 10B tokens,
# about 18,500 steps; 19,073 steps = 10.0B tokens would need more than one epoch of the glob, which Megatron caps);
# val loss and HellaSwag every 250 steps.
# Data: python prepare_fineweb.py (writes fineweb_edu/megatron_gpt2/processed_data_*_text_document.{bin,idx}).

data_paths = "fineweb_edu/megatron_gpt2/processed_data_*_text_document"
split = "969,30,1"
seq_length = 1024

n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50257
padded_vocab_size = 50304

global_batch_size = 512
local_batch_size = 64  # 80 GB GPUs; use 32 or 16 with less memory (gradient accumulation makes up the rest)
max_steps = None  # one epoch of the train split; set a number to stop earlier
lr = 6e-4
min_lr = 0.0
lr_warmup_steps = 700
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

val_every_steps = 250
val_tokens = 10_485_760
hellaswag = "download"
ckpt_every_steps = 1000
out_dir = "out_gpt2_124m"

dtype = "bfloat16"
compile = True
