"""muon.py on one process against its oracle, torch.optim.Muon: the same steps bit for bit, the same state; and the
plan a sharded step follows (each rank's rows, each matrix's owner). The sharded step itself, on 2 FSDP2 ranks, is
test_muon_distributed.py's."""
import copy

import pytest
import torch

from muon import ShardedMuon, assign_owners, shard_rows

# tall, wide, square, one row, and the MLP's c_proj of GPT-2 (its matrices are (fan_out, fan_in), as nn.Linear's)
SHAPES = [(40, 24), (24, 40), (32, 32), (1, 64), (16, 64)]


def optimizers(make, **options):
    """(torch.optim.Muon, ShardedMuon) over equal matrices, one group per matrix as train_gpt2.build_optimizer makes
    them (each its own lr and weight decay), and the matrices of each."""
    torch.manual_seed(0)
    oracle = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in oracle]

    def groups(params):
        return [dict(params=[p], lr=0.01 * (1 + i), weight_decay=0.1 * (i % 3)) for i, p in enumerate(params)]

    return (torch.optim.Muon(groups(oracle), **options), make(groups(ours), **options)), (oracle, ours)


def train(optimizer, params, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_one_process_steps_are_torchs_muon_bit_for_bit(adjust_lr_fn, nesterov):
    (oracle, ours), (oracle_params, our_params) = optimizers(ShardedMuon, momentum=0.95, nesterov=nesterov,
                                                             adjust_lr_fn=adjust_lr_fn)
    train(oracle, oracle_params, steps=4, seed=1)
    train(ours, our_params, steps=4, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(oracle_params, our_params))
    assert all(torch.equal(oracle.state[a]["momentum_buffer"], ours.state[b]["momentum_buffer"])
               for a, b in zip(oracle_params, our_params))
    assert not torch.equal(our_params[0], optimizers(ShardedMuon)[1][1][0])  # the steps moved the matrices


def test_the_state_is_torchs_both_ways():
    """A state saved by torch.optim.Muon (an older run's checkpoint) goes on under ShardedMuon, and back."""
    (oracle, ours), (oracle_params, our_params) = optimizers(ShardedMuon, momentum=0.9)
    train(oracle, oracle_params, steps=2, seed=1)
    train(ours, our_params, steps=2, seed=1)
    saved = copy.deepcopy(oracle.state_dict())  # load_state_dict keeps the tensors it is given
    oracle.load_state_dict(copy.deepcopy(ours.state_dict()))
    ours.load_state_dict(saved)
    train(oracle, oracle_params, steps=2, seed=2)
    train(ours, our_params, steps=2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(oracle_params, our_params))


@pytest.mark.parametrize("num_rows", [1, 5, 27, 768, 2304])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_each_rank_gets_the_rows_torch_chunk_gives_it_as_shard_0_does(num_rows, world_size):
    chunks = torch.arange(num_rows).chunk(world_size)
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    expected += [(num_rows, num_rows)] * (world_size - len(chunks))  # the ranks past the last chunk hold none
    assert shard_rows(num_rows, world_size) == expected


def test_gpt2_124ms_48_matrices_spread_evenly_over_8_ranks():
    n = 768
    shapes = [(3 * n, n), (n, n), (4 * n, n), (n, 4 * n)] * 12  # per block: c_attn, c_proj, c_fc, mlp.c_proj
    owners = assign_owners(shapes, 8)
    assert owners == assign_owners(shapes, 8)  # every rank plans the same
    work = [0] * 8
    for (rows, cols), owner in zip(shapes, owners):
        work[owner] += rows * cols * min(rows, cols)
    assert max(work) <= 1.1 * sum(work) / 8, work
    assert assign_owners(shapes, 1) == [0] * 48
