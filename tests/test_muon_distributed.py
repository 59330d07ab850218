"""muon.py's ShardedMuon on 2 gloo ranks (torchrun) with real FSDP2, against the oracle: torch.optim.Muon on the whole
model in one process; the collectives of its step, counted by torch's CommDebugMode; and a Muon run of train_gpt2.py
checkpointed on 2 ranks and resumed on 1 (the momentum resharded per parameter name)."""
import shutil

import pytest

import train_gpt2
from conftest import checkpoints, launch_worker, metrics, run, tiny, torchrun, worker_results

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def results():
    launch = launch_worker("muon_distributed_worker.py", 2)
    try:
        return {result.pop("check"): result for result in worker_results(launch)}
    finally:
        launch.kill()


def test_two_fsdp2_ranks_step_as_torchs_muon_does_on_one_process(results):
    """5 steps, each rank on half of each batch: the matrices as one process's torch.optim.Muon leaves them (to
    1e-4; FSDP2 averages the gradients in another order), and the momentum a DTensor sharded as its matrix."""
    steps = results["steps"]
    assert steps["ranks"] == 2 and steps["moved"] > 1e-2
    assert steps["params"] <= 1e-4 and steps["momentum"] <= 1e-4, steps
    assert steps["momentum_sharded"]


def test_a_step_makes_two_collectives_whatever_the_matrices_and_newton_schulz_steps(results):
    """Two all-to-alls for 4 matrices at 5 or 10 Newton-Schulz iterations, where torch.optim.Muon makes more than 10
    a matrix."""
    counts = results["collectives"]
    assert counts["sharded_5"] == counts["sharded_10"] == 2, counts
    assert counts["torch_5_of_3"] > 10 * 3, counts


def test_a_muon_run_checkpointed_on_two_ranks_resumes_on_one_process(data, tmp_path):
    """The run resumed from step 10 on 1 process follows the 2-rank run to rounding (1e-7 relative, measured), where
    a resume with the momentum zeroed is 1.2e-4 off: the momentum came back, resharded."""
    def args(out):
        return tiny(data, out, max_steps=20, optimizer="muon", lr=0.02, muon_scalar_lr=3e-3)

    run(torchrun(args(tmp_path / "two")))
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "hf")
    shutil.rmtree(tmp_path / "resumed" / "ckpt" / "step_00000020")
    assert checkpoints(tmp_path / "resumed") == ["step_00000010"]
    assert train_gpt2.main(args(tmp_path / "resumed")) == 0
    two, resumed = metrics(tmp_path / "two", "train_loss"), metrics(tmp_path / "resumed", "train_loss")
    assert two.keys() == resumed.keys() == set(range(20))
    worst = max(abs(two[step] - resumed[step]) / two[step] for step in range(10, 20))
    assert worst <= 1e-5, worst
