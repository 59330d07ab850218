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

# 8 sequences per step as 1, 2 or 4 ranks x 2 (x 4, 2 or 1 accumulation steps): torchrun --nproc_per_node 1/2/4
global_batch_size = 8
local_batch_size = 2
max_steps = 400
lr = 1e-3  # 3e-3 trains faster at first but spikes (loss 12.5, grad norm 67 near step 25); 1e-3 does not
min_lr = 1e-4
lr_warmup_steps = 10

val_every_steps = 100
val_tokens = 7680  # 120 windows of 64: the whole validation split of the bundled text (969,30,1)
sample_tokens = 48
ckpt_every_steps = 200
out_dir = "out_demo"

device = "cpu"
# fp32: on a CPU the 50,257-way softmax and the casts around bf16 matmuls cost more than bf16 saves (measured)
dtype = "float32"
compile = False  # compiling takes longer than this whole run saves
