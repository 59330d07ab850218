"""train_gpt2.py on one process: --help, the seed recipe's YAML, wandb, resume refusals, a finished run's rerun, token
ids outside the vocabulary, checkpoints that do not load, full disks, and the memory plan against measurement.
Runs use the byte-level Shakespeare dataset and the 2-layer model of conftest.tiny."""
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import train_gpt2
from conftest import ROOT, metrics, tiny, torchrun, write_byte_dataset
from indexed_dataset import IndexedDatasetBuilder
from model import MARKER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def script(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=None if env is None else {**os.environ, **env})


def test_help_lists_every_key_with_its_default_and_comment_in_groups():
    result = script("--help")
    assert result.returncode == 0, result.stderr
    for field in dataclasses.fields(train_gpt2.TrainConfig):
        assert re.search(rf"^  --{field.name}: .* = ", result.stdout, re.M), field.name
    assert "  --ckpt_keep: int = 2  # complete checkpoints kept, newest first" in result.stdout
    assert result.stdout.index("# data:") < result.stdout.index("--data_paths") < result.stdout.index("# outputs")


RECIPE = """
step_scheduler:
  global_batch_size: 512
  local_batch_size: 32
  ckpt_every_steps: 1000
  val_every_steps: 250  # will run every x number of gradient steps
  num_epochs: 1
  max_steps: 18500
dist_env:
  backend: nccl
  timeout_minutes: 1
rng:
  _target_: nemo_automodel.components.training.rng.StatefulRNG
  seed: 1111
  ranked: true
model:
  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_config
  is_meta_device: true
  config:
    _target_: transformers.AutoConfig.from_pretrained
    pretrained_model_name_or_path: openai-community/gpt2
checkpoint:
  enabled: true
  checkpoint_dir: checkpoints/
  model_save_format: torch_save
  save_consolidated: false
distributed:
  _target_: nemo_automodel.components.distributed.fsdp2.FSDP2Manager
  dp_size: none
  dp_replicate_size: 1
  tp_size: 1
  cp_size: 1
  sequence_parallel: false
loss_fn:
  _target_: nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy
dataset:
  _target_: nemo_automodel.components.datasets.llm.megatron_dataset.MegatronPretraining
  paths: fineweb_edu/megatron_gpt2/processed_data_*_text_document*
  index_mapping_dir: fineweb_edu/megatron_gpt2/mapping_dir
  tokenizer:
    _target_: transformers.AutoTokenizer.from_pretrained
    pretrained_model_name_or_path: openai-community/gpt2
  seq_length: 1024
  split: "0.99, 0.01, 0.00"
  splits_to_build: "train"
dataloader:
  _target_: torchdata.stateful_dataloader.StatefulDataLoader
  collate_fn: torch.utils.data.default_collate
validation_dataset:
  _target_: nemo_automodel.components.datasets.llm.megatron_dataset.MegatronPretraining
  paths: fineweb_edu/megatron_gpt2/processed_data_*_text_document*
  index_mapping_dir: fineweb_edu/megatron_gpt2/mapping_dir
  tokenizer:
    _target_: transformers.AutoTokenizer.from_pretrained
    pretrained_model_name_or_path: openai-community/gpt2
  seq_length: 1024
  split: "0.99, 0.01, 0.00"
  splits_to_build: "validation"
  num_val_samples: 1024
validation_dataloader:
  _target_: torchdata.stateful_dataloader.StatefulDataLoader
  collate_fn: torch.utils.data.default_collate
optimizer:
  _target_: torch.optim.AdamW
  betas: [0.9, 0.95]
  lr: 0.0006
  weight_decay: 0.1
lr_scheduler:
  lr_decay_style: cosine
  lr_warmup_steps: 700
  min_lr: 0.0
wandb:
  project: gpt2-pretrain
  name: seed-recipe
"""


def test_the_seed_recipes_yaml_maps_to_our_keys_and_overrides_still_win(tmp_path, capsys):
    recipe = tmp_path / "megatron_pretrain_gpt2.yaml"
    recipe.write_text(RECIPE)
    cfg = train_gpt2.load_config([str(recipe), "--max_steps=10"])
    expected = dict(global_batch_size=512, local_batch_size=32, ckpt_every_steps=1000, val_every_steps=250,
                    max_steps=10, dist_timeout_s=60, seed=1111, n_layer=12, n_head=12, n_embd=768,
                    out_dir="checkpoints/", data_paths="fineweb_edu/megatron_gpt2/processed_data_*_text_document*",
                    index_mapping_dir="fineweb_edu/megatron_gpt2/mapping_dir", seq_length=1024,
                    split="0.99, 0.01, 0.00", val_tokens=1024 * 1024, beta1=0.9, beta2=0.95, lr=6e-4,
                    weight_decay=0.1, lr_warmup_steps=700, min_lr=0.0, wandb_log=True, wandb_project="gpt2-pretrain",
                    wandb_run_name="seed-recipe")
    assert {key: getattr(cfg, key) for key in expected} == expected
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "--global_batch_size=512" in said[0] and "dataloader.collate_fn" in said[0]


@pytest.mark.parametrize("edit, named", [
    (("tp_size: 1", "tp_size: 2"), "distributed.tp_size=2"),
    (("lr_decay_style: cosine", "lr_decay_style: WSD"), "lr_scheduler.lr_decay_style='WSD'"),
    (("  num_val_samples: 1024", "  num_val_samples: 1024\n  paths_extra: 1"), "validation_dataset.paths_extra=1"),
])
def test_a_recipe_key_that_would_change_the_run_is_named_in_one_error(tmp_path, edit, named):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace(*edit))
    with pytest.raises(ValueError, match=re.escape(named)) as error:
        train_gpt2.load_config([str(recipe)])
    assert "\n" not in str(error.value)


def test_val_data_paths_takes_a_blend_list():
    cfg = train_gpt2.load_config(["--val_data_paths=['1', 'a', '2', 'b']"])
    assert cfg.val_data_paths == ["1", "a", "2", "b"]


def test_a_batch_that_does_not_divide_is_one_error_printed_once_under_torchrun(data, tmp_path):
    result = subprocess.run(torchrun(tiny(data, tmp_path / "out", global_batch_size=8, local_batch_size=3)),
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "is not divisible" in line]
    assert errors == ["train_gpt2.py: error: config: global_batch_size 8 is not divisible by local_batch_size 3 x "
                      "world size 2 = 6"], result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """A 20-step run with checkpoints at 10 and 20, on its own copy of the data (tests replace it)."""
    base = tmp_path_factory.mktemp("finished")
    prefix = str(base / "data" / "bytes")
    os.makedirs(os.path.dirname(prefix))
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, prefix + suffix)
    out = base / "out"
    assert train_gpt2.main(tiny(prefix, out, max_steps=20, index_mapping_dir=str(base / "cache"))) == 0
    return prefix, out


def rerun(finished, tmp_path, **overrides):
    """A copy of the finished run's out_dir (its step-10 checkpoint newest), rerun with overrides."""
    prefix, out = finished
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "ckpt" / "step_00000020")
    shutil.rmtree(copy / "hf")
    config = (copy / "train_config.json").read_text()
    args = tiny(prefix, copy, max_steps=20, index_mapping_dir=os.path.join(os.path.dirname(prefix), "..", "cache"))
    return copy, config, [*args, *[f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in overrides.items()]]


@pytest.mark.parametrize("overrides, message", [
    (dict(split="80,20,0"), "split '90,10,0' -> '80,20,0'"),
    (dict(seed=7), "seed 1234 -> 7"),
    (dict(seq_length=16), "seq_length 32 -> 16"),
    (dict(max_steps=30_000), r"max_steps 20 -> 30000 \(the train split is then built in other epochs"),
])
def test_a_resume_refuses_what_would_change_the_tokens_or_their_order(finished, tmp_path, overrides, message):
    copy, config, args = rerun(finished, tmp_path, **overrides)
    with pytest.raises(ValueError, match=message) as error:
        train_gpt2.main(args)
    assert "resume_allow_data_change=True" in str(error.value) and "\n" not in str(error.value)
    assert (copy / "train_config.json").read_text() == config  # a refused run rewrites nothing


def test_a_resume_refuses_other_data_at_the_same_path_unless_allowed(finished, tmp_path, capsys):
    prefix, out = finished
    other = str(tmp_path / "other" / "bytes")
    os.makedirs(os.path.dirname(other))
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, other + suffix)
    with open(other + ".bin", "r+b") as f:  # the same sizes, other tokens
        f.seek(100)
        f.write(b"\x07\x00" * 50)
    builder = IndexedDatasetBuilder(other + "2.bin", np.uint16)
    builder.add_document(np.full(40, 3, np.uint16))
    builder.finalize(other + "2.idx")
    copy, _, args = rerun(finished, tmp_path, data_paths=other)
    with pytest.raises(ValueError, match=r"data_paths .* -> .*; data .*bytes fingerprint"):
        train_gpt2.main(args)
    assert train_gpt2.main(args + ["--resume_allow_data_change=True"]) == 0
    assert "resuming with changed data (resume_allow_data_change)" in capsys.readouterr().out


def test_a_shorter_max_steps_within_the_plan_is_allowed_and_its_schedule_logged(finished, tmp_path, capsys):
    copy, _, args = rerun(finished, tmp_path, max_steps=15)
    assert train_gpt2.main(args) == 0
    assert "max_steps 20 -> 15: the cosine decay to min_lr 0 now ends at step 15" in capsys.readouterr().out
    assert 15 in metrics(copy, "val_loss") and (copy / "hf").is_dir()  # the final evaluation and export at step 15


def test_eval_only_past_max_steps_and_a_finished_rerun_does_nothing(finished, tmp_path, capsys):
    prefix, out = finished
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    args = tiny(prefix, copy, max_steps=20, index_mapping_dir=os.path.join(os.path.dirname(prefix), "..", "cache"))
    before = {name: (copy / name).read_bytes() for name in ("metrics.jsonl", "main.log", "train_config.json")}
    assert train_gpt2.main(args) == 0
    assert "this run is already complete" in capsys.readouterr().out
    assert {name: (copy / name).read_bytes() for name in before} == before
    assert train_gpt2.main(args + ["--eval_only=True", "--max_steps=5"]) == 0  # evaluation needs no step budget


def test_a_token_id_outside_the_vocabulary_names_the_dataset_and_document(tmp_path):
    prefix = str(tmp_path / "bad")
    write_byte_dataset(prefix)
    tokens = np.memmap(prefix + ".bin", np.uint16, "r+")
    tokens[::5000] = 600  # bit rot: beyond the 512-token vocabulary
    tokens.flush()
    with pytest.raises(ValueError, match=r"token id 600 in .*bad: documents? \d+.* \(sample \d+\) is outside the "
                                         r"model's vocabulary \(vocab_size 512\)"):
        train_gpt2.main(tiny(prefix, tmp_path / "out", max_steps=400, val_tokens=0, val_every_steps=1000,
                             index_mapping_dir=str(tmp_path / "cache")))


def test_a_nonfinite_checkpoint_is_set_aside_and_the_older_one_resumed(finished, tmp_path, capsys):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    copy, _, args = rerun(finished, tmp_path)
    step10, step15 = copy / "ckpt" / "step_00000010", copy / "ckpt" / "step_00000015"
    shutil.copytree(step10, step15)
    dcp_to_torch_save(str(step10), str(tmp_path / "state.pt"))
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    next(iter(state["optim"]["state"].values()))["exp_avg_sq"].fill_(-1.0)  # AdamW would take its square root
    shutil.rmtree(step15)
    shutil.copytree(step10, step15, ignore=shutil.ignore_patterns("*.distcp", ".metadata"))
    torch.save(state, tmp_path / "state.pt")
    torch_save_to_dcp(str(tmp_path / "state.pt"), str(step15))
    train_state = json.loads((step10 / "train_state.json").read_text())
    train_state["step"], train_state["consumed_samples"] = 15, 15 * 8
    (step15 / "train_state.json").write_text(json.dumps(train_state))
    (step15 / MARKER).unlink()
    (step15 / MARKER).write_text(json.dumps(dict(step=15, sizes=train_gpt2.fsync_tree(str(step15)))))
    assert train_gpt2.main(args) == 0
    said = capsys.readouterr().out
    assert re.search(r"skipping checkpoint .*step_00000015: .*negative or non-finite Adam moment", said)
    assert glob.glob(str(copy / "ckpt" / "step_00000015.damaged*"))


FULL_DISK = """
import resource, signal, sys
import train_gpt2
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))  # the index cache fits, a checkpoint not
train_gpt2.cli(sys.argv[1:])
"""


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_it(data, tmp_path):
    result = subprocess.run([sys.executable, "-c", FULL_DISK, *tiny(data, tmp_path / "out", n_embd=64)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert re.fullmatch(r"train_gpt2\.py: error: writing checkpoint .*step_00000010 failed( on rank 0)?: .*",
                        result.stderr.splitlines()[-1]), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path / "out" / "ckpt") == []


def test_wandb_gets_every_metric_and_a_resumed_run_continues_the_same_wandb_run(data, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    env = dict(WANDB_MODE="offline", WANDB_SILENT="true")
    args = tiny(data, out, max_steps=20, wandb_log=True, wandb_project="tiny")
    assert script(*args, env=env).returncode == 0
    shutil.rmtree(out / "hf")
    shutil.rmtree(out / "ckpt" / "step_00000020")
    result = script(*args, "--max_steps=30", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and len({os.path.basename(r) for r in runs}) == 1  # one run id, resumed
    history = {}
    for path in runs:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {item.key: json.loads(item.value_json) for item in record.history.item}
                if "train_loss" in row:
                    history[row["step"]] = row["train_loss"]
    assert history == metrics(out, "train_loss") and len(history) == 30


def wandb_records(path):
    """The protobuf records of a .wandb file: a 7-byte header, then 32 KiB blocks of (crc32, length, type, data)
    chunks, the LevelDB log format; a record split over blocks is FIRST, MIDDLE..., LAST."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_memory_plan_is_within_30_percent_of_the_measured_peak_on_1_and_2_ranks(tmp_path):
    """A model whose weights, not torch's libraries, fill the memory: 50,257-token vocabulary, 4 x 256-wide layers,
    4 micro-batches per step; measured = the run's peak RSS minus the RSS before the model was built."""
    prefix = str(tmp_path / "tokens")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(300):
        builder.add_document(rng.integers(0, 50257, 300).astype(np.uint16))
    builder.finalize(prefix + ".idx")
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}"
        args = tiny(prefix, out, n_layer=4, n_head=4, n_embd=256, vocab_size=50257, seq_length=128,
                    global_batch_size=32, local_batch_size=8 // nproc, max_steps=3, val_tokens=0,
                    ckpt_every_steps=0, split="99,1,0", index_mapping_dir=str(tmp_path / "cache"))
        cmd = torchrun(args, nproc) if nproc > 1 else [sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in open(out / "metrics.jsonl")]
        plan = next(r for r in records if "memory_plan_gib" in r)
        measured = max(r["run_peak_mem_gib"] for r in records if "run_peak_mem_gib" in r) - plan["memory_baseline_gib"]
        print(f"{nproc} rank(s): plan {plan['memory_plan_gib']:.3f} GiB, measured {measured:.3f} GiB "
              f"(x{plan['memory_plan_gib'] / measured:.2f})")
        assert abs(plan["memory_plan_gib"] - measured) <= 0.3 * measured
