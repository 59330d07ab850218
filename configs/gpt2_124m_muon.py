# GPT-2 124M with Muon in place of AdamW: give it after the AdamW recipe, whose data, model, batch, schedule and
# weight decay (0.1) it keeps:
#   torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py configs/gpt2_124m_muon.py
# torch.optim.Muon trains the blocks' matrices at lr (dion's spectral_norm scaling, sqrt(fan_out/fan_in)); AdamW
# trains the biases, LayerNorms and embeddings (wte is also the head) at muon_scalar_lr (docs/training.md#muon).
# Both were chosen by a short sweep on the demo model (configs/demo_cpu.py for 60 steps: docs/benchmarks.md#muon),
# not on this model: Muon's lr 0.02 of 0.01, 0.02 and 0.04 (weight decay 0.1, 0.01 or 0 made no difference there);
# the AdamW part at 3x the AdamW recipe's lr, as Muon's AdamW part did far better at 3x the demo's lr than at 1x
# (at 1x, Muon did not beat AdamW there; AdamW alone at 3x gained far less). min_lr stays the recipe's 0.1 x lr.

optimizer = "muon"
lr = 0.02
min_lr = 0.002
muon_momentum = 0.95
muon_adjust_lr = "spectral_norm"
muon_scalar_lr = 1.8e-3  # 3 x 6e-4
out_dir = "out_gpt2_124m_muon"
