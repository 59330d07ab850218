"""What a run does with the out_dir it is given and the checkpoints it finds there: refuses directories that are not
its own, moves an earlier run's logs aside, counts a checkpoint only when its completeness marker is there, skips damaged checkpoints and keeps them, and turns config-file
mistakes into one line naming file:line. Single-process runs of the 2-layer byte model from test_train."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from model import MARKER, check_checkpoint, complete_checkpoints
import train_gpt2
from conftest import checkpoints, metrics, tiny, vislog

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted 6-step run, a checkpoint every 2 steps, all kept."""
    out = tmp_path_factory.mktemp("reference")
    assert train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3)) == 0
    return out


def test_out_dir_that_is_not_a_run_directory_is_refused(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("the user's")
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_text("x")
    cases = {"": "out_dir is empty", ".": "current directory", str(tmp_path): "current directory",
             # the project's parent may hold the working directory too (a clone under /tmp): either reason will do
             os.path.dirname(ROOT): "(project|current) directory", str(foreign): "not a training run's directory",
             str(foreign / "cat.jpg"): "is a file"}
    for out_dir, message in cases.items():
        with pytest.raises(ValueError, match=message):
            train_gpt2.main(tiny(data, out_dir, max_steps=1))
    assert (tmp_path / "hf" / "mine.txt").read_text() == "the user's"
    assert sorted(os.listdir(foreign)) == ["cat.jpg"]


def test_export_replaces_only_an_hf_dir_it_wrote(data, tmp_path):
    out = tmp_path / "run"
    train_gpt2.main(tiny(data, out, max_steps=2))
    assert os.path.isfile(out / "hf" / ".train_gpt2.json")
    (out / "hf" / "notes.txt").write_text("mine")  # the marker is still there: a later export replaces the whole hf/
    train_gpt2.main(tiny(data, out, max_steps=3))
    assert not os.path.exists(out / "hf" / "notes.txt")
    shutil.rmtree(out / "hf")
    (out / "hf").mkdir()
    (out / "hf" / "notes.txt").write_text("mine")  # no marker: moved aside, never deleted
    train_gpt2.main(tiny(data, out, max_steps=4))
    moved = [name for name in os.listdir(out) if name.startswith("hf.moved-")]
    assert len(moved) == 1 and (out / moved[0] / "notes.txt").read_text() == "mine"
    assert os.path.isfile(out / "hf" / "model.safetensors")
    assert not [name for name in os.listdir(out) if name.startswith(".hf.")]


def test_fresh_run_moves_old_logs_aside_and_a_resumed_run_appends(data, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "main.log").write_text("s:0 trl:9.0000 lr:0.001 norm:1.00\n")
    (out / "main.log.1").write_text("older\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "train_loss": 9.0}\n')
    train_gpt2.main(tiny(data, out, max_steps=2))
    said = capsys.readouterr().out
    assert f"{out / 'main.log'} of an earlier run moved to {out / 'main.log.2'}" in said
    assert (out / "main.log.2").read_text() == "s:0 trl:9.0000 lr:0.001 norm:1.00\n"
    assert (out / "metrics.jsonl.1").read_text() == '{"step": 0, "train_loss": 9.0}\n'
    assert sorted(vislog(out / "main.log")["trl"]) == [0, 1]
    train_gpt2.main(tiny(data, out, max_steps=4))  # resumes from step 2: the same log goes on
    assert sorted(vislog(out / "main.log")["trl"]) == [0, 1, 2, 3] and not os.path.exists(out / "main.log.3")


def test_incomplete_checkpoint_is_moved_aside_and_rewritten(data, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "hf")
    os.remove(out / "ckpt" / "step_00000006" / MARKER)  # as if the write stopped before its marker
    assert [os.path.basename(p) for p in complete_checkpoints(str(out / "ckpt"))] == [
        "step_00000002", "step_00000004"]
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3))
    assert metrics(out, "train_loss") == metrics(reference, "train_loss")
    assert os.path.isfile(out / "ckpt" / "step_00000006" / MARKER)
    aside = [name for name in checkpoints(out) if name.startswith("step_00000006.incomplete-")]
    assert len(aside) == 1


@pytest.mark.parametrize("damage", ["truncated shard", "missing shard", "empty rng.pt", "bad train_state.json",
                                    "no .metadata"])
def test_check_checkpoint_names_the_damaged_file(reference, tmp_path, damage):
    path = tmp_path / "step"
    shutil.copytree(reference / "ckpt" / "step_00000006", path)
    assert check_checkpoint(str(path)) is None
    name, text = {"truncated shard": ("__0_0.distcp", None), "missing shard": ("__0_0.distcp", None),
                  "empty rng.pt": ("rng.pt", b""), "bad train_state.json": ("train_state.json", b"{\"step\": 6,"),
                  "no .metadata": (".metadata", None)}[damage]
    if damage == "truncated shard":
        os.truncate(path / name, os.path.getsize(path / name) // 2)
    elif text is None:
        os.remove(path / name)
    else:
        (path / name).write_bytes(text)
    assert str(path / name) in check_checkpoint(str(path))


def test_damaged_newest_checkpoint_is_skipped_named_and_kept(data, reference, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "hf")
    os.truncate(out / "ckpt" / "step_00000006" / "__0_0.distcp", 1000)
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3))
    said = capsys.readouterr().out
    assert f"skipping damaged checkpoint {out / 'ckpt' / 'step_00000006'}: " \
           f"{out / 'ckpt' / 'step_00000006' / '__0_0.distcp'}: truncated" in said
    assert metrics(out, "train_loss") == metrics(reference, "train_loss")
    assert [name for name in checkpoints(out) if name.startswith("step_00000006.damaged-")]

    # damage only the load notices: every rank gives up on it together and the next older one is loaded
    real_load = train_gpt2.dcp.load

    def failing_load(state, checkpoint_id, **kwargs):
        if checkpoint_id.endswith("step_00000006"):
            raise RuntimeError("unreadable shard")
        return real_load(state, checkpoint_id=checkpoint_id, **kwargs)
    monkeypatch.setattr(train_gpt2.dcp, "load", failing_load)
    shutil.rmtree(out / "hf")
    train_gpt2.main(tiny(data, out, max_steps=6, ckpt_every_steps=2, ckpt_keep=3))
    assert "failed to load (RuntimeError: unreadable shard)" in capsys.readouterr().out
    assert metrics(out, "train_loss") == metrics(reference, "train_loss")
    assert len([name for name in checkpoints(out) if ".damaged-" in name]) == 2


def test_config_file_errors_name_file_and_line(tmp_path):
    config = tmp_path / "config.py"
    config.write_text("max_steps = 5\nlr = 3e-4 *\n")
    with pytest.raises(ValueError, match=rf"{config}:2: syntax error"):
        train_gpt2.load_config([str(config)])
    config.write_text("import sys\nmax_steps = 5\nsys.exit(0)\n")
    with pytest.raises(ValueError, match=r"config\.py: the config file called sys\.exit\(0\)"):
        train_gpt2.load_config([str(config)])
    config.write_text("max_steps = 5\nlr = learning_rate\n")
    with pytest.raises(ValueError, match=rf"{config}:2: NameError"):
        train_gpt2.load_config([str(config)])
    with pytest.raises(ValueError, match="lr must be a finite number, got inf"):
        train_gpt2.load_config(["--lr=1e400"])
    # on the command line: exit status 1, one line
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), str(config)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"train_gpt2.py: error: {config}:2: NameError: name 'learning_rate' is not defined" in result.stderr
