# GPT-2 124M with Muon in place of AdamW: give it after the AdamW recipe, whose data, model, batch, schedule and
# weight decay (0.1) it keeps:
#   torchrun --standalone --nproc_per_node 8 train_gpt2.py configs/gpt2_124m.py configs/gpt2_124m_muon.py
# torch.optim.Muon trains the blocks' matrices at muon_lr (dion's spectral_norm scaling, sqrt(fan_out/fan_in)); AdamW
# trains the biases, LayerNorms and embeddings (wte is also the head) at muon_scalar_lr, 5 x the recipe's lr. Both are
# TrainConfig's defaults, chosen by a sweep on the demo model (docs/benchmarks.md#muon), not on this model; the
# schedule decays each to the recipe's min_lr / lr of its peak.

optimizer = "muon"
out_dir = "out_gpt2_124m_muon"
