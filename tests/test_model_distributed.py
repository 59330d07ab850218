"""model.py's sharded init on 2 gloo ranks (torchrun) against the oracle: init_weights after torch.manual_seed, on a
full model, as torch gathers the shards. hf_files.py's sharded load and export are test_hf_files_distributed.py's."""
import pytest
import torch

from conftest import launch_worker, worker_results
from model import GPT, GPTConfig, init_sharded, materialize, parameters_on_meta

@pytest.fixture(scope="module")
def launches():
    """init_sharded on 2 ranks and on 1, both launched at once."""
    started = {ranks: launch_worker("model_distributed_worker.py", ranks, "init") for ranks in (2, 1)}
    try:
        return {ranks: worker_results(launch) for ranks, launch in started.items()}
    finally:
        for launch in started.values():
            launch.kill()


def init_results(ranks):
    return [dict(check="init", vocab=vocab, ranks=ranks, equal=True) for vocab in (50257, 30)]


@pytest.mark.slow  # torchrun launches
def test_init_on_two_ranks_is_init_weights_after_manual_seed(launches):
    assert launches[2] == init_results(2)


@pytest.mark.slow  # torchrun launches
def test_init_on_one_rank_is_the_same(launches):
    assert launches[1] == init_results(1)


def test_init_sharded_on_a_plain_model_leaves_the_global_rng_alone():
    config = GPTConfig(block_size=16, vocab_size=50, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    reference = GPT(config)
    torch.manual_seed(5)
    reference.init_weights()
    tied = reference.lm_head.weight is reference.transformer.wte.weight
    reference = reference.state_dict()
    with parameters_on_meta():
        model = GPT(config)
    materialize(model, "cpu")
    torch.manual_seed(99)
    before = torch.get_rng_state()
    init_sharded(model, 5)
    assert torch.equal(torch.get_rng_state(), before)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied  # as __init__ made it
    assert all(torch.equal(model.state_dict()[k], reference[k]) for k in reference)
