# Quick start: a tiny GPT-2 with the real GPT-2 vocabulary, trained on Shakespeare on a CPU in a few minutes.
#   python prepare_fineweb.py --input data/tinyshakespeare.txt --output-dir data/shakespeare
#   python train_gpt2.py configs/demo_cpu.py
# The loss falls from about 10.9 (uniform over 50,257 tokens) to below 6; a short sample is printed at every
# validation, the last one after the final step. Then: python sample.py --model out_demo --prompt "ROMEO:"

data_paths = "data/shakespeare/processed_data_0_text_document"
split = "969,30,1"
seq_length = 64

n_layer = 4
n_head = 4
n_embd = 128
vocab_size = 50257
padded_vocab_size = None  # padding only pays on GPUs

global_batch_size = 8
local_batch_size = 8
max_steps = 400
lr = 3e-3
min_lr = 3e-4
lr_warmup_steps = 30

val_every_steps = 100
val_tokens = 8192
sample_tokens = 48
ckpt_every_steps = 200
out_dir = "out_demo"

device = "cpu"
# fp32: on a CPU the 50,257-way softmax and the casts around bf16 matmuls cost more than bf16 saves (measured)
dtype = "float32"
compile = False  # compiling takes longer than this whole run saves
