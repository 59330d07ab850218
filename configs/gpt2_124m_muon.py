# GPT-2 124M with Muon in place of AdamW: give it after the AdamW recipe, whose data, model, batch, schedule and
# weight decay (0.1) it keeps:
#   torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py configs/gpt2_124m_muon.py
# torch.optim.Muon trains the blocks' matrices at lr (dion's spectral_norm scaling, sqrt(fan_out/fan_in)); AdamW
# trains the biases, LayerNorms and embeddings (wte is also the head) at muon_scalar_lr, the AdamW recipe's lr
# (docs/training.md#muon). lr was chosen by a short sweep on the demo model (configs/demo_cpu.py for 60 steps, Muon
# lr 0.01, 0.02 and 0.04 with the AdamW part at the demo's lr: docs/benchmarks.md#muon), not on this model; min_lr
# stays the recipe's 0.1 x lr.

optimizer = "muon"
lr = 0.02
min_lr = 0.002
muon_momentum = 0.95
muon_adjust_lr = "spectral_norm"
muon_scalar_lr = 6e-4
out_dir = "out_gpt2_124m_muon"
