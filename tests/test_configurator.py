"""The configurator: config files, --key=value overrides, --help, nanoGPT's names and NeMo
AutoModel's recipe YAML, read into train_gpt2.TrainConfig; and train_gpt2.check_config's ranges."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

import train_gpt2
from configurator import parse_config
from conftest import ROOT, metrics


def script(*args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *args], cwd=ROOT,
                          text=True, capture_output=True, timeout=timeout)


@pytest.mark.slow
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
    cfg = train_gpt2.load_config([str(recipe), "--max_steps=10", "--lr_warmup_steps=5"])
    expected = dict(global_batch_size=512, local_batch_size=32, ckpt_every_steps=1000, val_every_steps=250,
                    max_steps=10, dist_timeout_s=60, seed=1111, n_layer=12, n_head=12, n_embd=768,
                    out_dir="checkpoints/", data_paths="fineweb_edu/megatron_gpt2/processed_data_*_text_document*",
                    index_mapping_dir="fineweb_edu/megatron_gpt2/mapping_dir", seq_length=1024,
                    split="0.99, 0.01, 0.00", val_tokens=1024 * 1024, beta1=0.9, beta2=0.95, lr=6e-4,
                    weight_decay=0.1, lr_warmup_steps=5, min_lr=0.0, wandb_log=True, wandb_project="gpt2-pretrain",
                    wandb_run_name="seed-recipe")
    assert {key: getattr(cfg, key) for key in expected} == expected
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "--global_batch_size=512" in said[0] and "dataloader.collate_fn" in said[0]


TODAYS_RECIPE = os.path.join(ROOT, "tests", "fixtures", "megatron_pretrain_gpt2.yaml")


def todays_recipe(tmp_path, data, *edits):
    """The fixture (today's AutoModel recipe, sizes edited) with the byte dataset's paths and tmp_path's out_dir."""
    text = open(TODAYS_RECIPE).read()
    for old, new in [("fineweb_edu/megatron_gpt2/processed_data_*_text_document*", data),
                     ("fineweb_edu/megatron_gpt2/mapping_dir", str(tmp_path / "index_cache")),
                     ("checkpoint_dir: checkpoints/", f"checkpoint_dir: {tmp_path / 'out'}"), *edits]:
        assert old in text, old
        text = text.replace(old, new)
    recipe = tmp_path / "megatron_pretrain_gpt2.yaml"
    recipe.write_text(text)
    return str(recipe)


def test_todays_automodel_recipe_cut_shorter_than_its_warmup_is_a_valid_config(data, tmp_path):
    cfg = train_gpt2.load_config([todays_recipe(tmp_path, data, ("  max_steps: 10", "  max_steps: 1"))])
    assert (cfg.max_steps, cfg.lr_warmup_steps) == (1, 2)


@pytest.mark.slow
def test_todays_automodel_recipe_trains_as_written_and_says_every_key(data, tmp_path):
    """recipe:, FusedAdam's options and model.config's sizes are accepted; the run's model has model.config's sizes."""
    result = script(todays_recipe(tmp_path, data), "--device=cpu", "--compile=False")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    said = next(line for line in result.stdout.splitlines() if "AutoModel recipe read as" in line)
    for text in ("--n_layer=2", "--n_embd=32", "--vocab_size=512", "--padded_vocab_size=512", "--beta2=0.95",
                 "--dist_timeout_s=60", "--val_tokens=512", "recipe='TrainFinetuneRecipeForNextTokenPrediction'",
                 "optimizer.adam_w_mode=True", "optimizer.bias_correction=True", "optimizer.master_weights=True",
                 "optimizer.store_param_remainders=True", "optimizer.exp_avg_dtype='torch.float32'",
                 "optimizer.exp_avg_sq_dtype='torch.float32'", "dataloader.dataloader_type='single'",
                 "distributed.strategy='fsdp2'", "model.config.n_positions", "dropout 0.1"):
        assert text in said, text
    hf_config = json.loads((tmp_path / "out" / "hf" / "config.json").read_text())
    assert (hf_config["n_layer"], hf_config["n_embd"], hf_config["n_head"], hf_config["n_positions"],
            hf_config["vocab_size"]) == (2, 32, 2, 32, 512)
    assert sorted(metrics(tmp_path / "out", "val_loss")) == [0, 5, 10]


@pytest.mark.parametrize("edit, named", [
    (("tp_size: 1", "tp_size: 2"), "distributed.tp_size=2"),
    (("lr_decay_style: cosine", "lr_decay_style: WSD"), "lr_scheduler.lr_decay_style='WSD'"),
    (("  num_val_samples: 16", "  num_val_samples: 16\n  paths_extra: 1"), "validation_dataset.paths_extra=1"),
    (("recipe: TrainFinetuneRecipeForNextTokenPrediction", "recipe: KnowledgeDistillationRecipeForNextTokenPrediction"),
     "recipe='KnowledgeDistillationRecipeForNextTokenPrediction'"),
    (("adam_w_mode: true", "adam_w_mode: false"), "optimizer.adam_w_mode=False"),
    (("bias_correction: true", "bias_correction: false"), "optimizer.bias_correction=False"),
    (("master_weights: true", "master_weights: false"), "optimizer.master_weights=False"),
    (("exp_avg_dtype: torch.float32", "exp_avg_dtype: torch.bfloat16"), "optimizer.exp_avg_dtype='torch.bfloat16'"),
    (("exp_avg_sq_dtype: torch.float32", "exp_avg_sq_dtype: torch.uint8"), "optimizer.exp_avg_sq_dtype='torch.uint8'"),
    (("fused_adam.FusedAdam", "sgd.SGD"), "optimizer._target_='transformer_engine.pytorch.optimizers.sgd.SGD'"),
    (('dataloader_type: "single"', 'dataloader_type: "cyclic"'), "dataloader.dataloader_type='cyclic'"),
    (("strategy: fsdp2", "strategy: megatron_fsdp"), "distributed.strategy='megatron_fsdp'"),
    (("n_positions: 32", "n_positions: 1024"), "model.config.n_positions=1024 (the model's context here is "
                                               "dataset.seq_length, 32)"),
    (("vocab_size: 512", "vocab_size: 512\n    resid_pdrop: 0.1"), "model.config.resid_pdrop=0.1"),
    (("openai-community/gpt2\n    n_layer", "EleutherAI/gpt-neo-125m\n    n_layer"),
     "model.config.pretrained_model_name_or_path='EleutherAI/gpt-neo-125m' (neither a local "
     "Hugging Face config directory nor a GPT-2 size known here: gpt2, "),
])
def test_a_recipe_key_that_would_change_the_run_is_named_in_one_error(data, tmp_path, edit, named):
    with pytest.raises(ValueError, match=re.escape(named)) as error:
        train_gpt2.load_config([todays_recipe(tmp_path, data, edit)])
    assert "\n" not in str(error.value) and "not supported by train_gpt2.py" in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("edit, message", [
    (("betas: [0.9, 0.95]", "betas: 0.9"), "optimizer.betas must be a list of two numbers [beta1, beta2], got 0.9"),
    (("betas: [0.9, 0.95]", "betas: [0.9, x]"), "optimizer.betas must be a list of two numbers"),
    (("timeout_minutes: 1", "timeout_minutes: abc"), "dist_env.timeout_minutes must be a number of minutes, got 'abc'"),
    (("num_val_samples: 16", "num_val_samples: x"), "validation_dataset.num_val_samples must be an int (validation "
                                                    "sequences), got 'x' (str)"),
    (("lr: 0.0006", "lr: fast"), "optimizer.lr must be float, got 'fast' (str)"),
    (("max_steps: 10", "max_steps: 1.5"), "step_scheduler.max_steps must be int or None, got 1.5 (float)"),
    (("n_layer: 2", "n_layer: two"), "model.config.n_layer must be int, got 'two' (str)"),
])
def test_a_wrong_typed_recipe_value_is_one_line_naming_file_key_and_type(data, tmp_path, edit, message):
    recipe = todays_recipe(tmp_path, data, edit)
    result = script(recipe, "--device=cpu")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"train_gpt2.py: error: {recipe}: {message}" or \
        result.stderr.strip().startswith(f"train_gpt2.py: error: {recipe}: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_recipe_without_optimizer_values_gets_its_optimizers_defaults_and_strings_read_as_automodel(data, tmp_path):
    """What AutoModel would run: FusedAdam's own betas, eps and weight decay where the recipe leaves them out;
    "6e-4" is a number (AutoModel's loader reads strings with literal_eval), split stays the string as written."""
    recipe = todays_recipe(tmp_path, data, ("  betas: [0.9, 0.95]\n", ""), ("  weight_decay: 0.1\n", ""),
                           ("lr: 0.0006", 'lr: "6e-4"'))
    cfg = train_gpt2.load_config([recipe])
    assert (cfg.lr, cfg.beta1, cfg.beta2, cfg.adam_eps, cfg.weight_decay) == (6e-4, 0.9, 0.999, 1e-8, 0.0)
    assert cfg.split == "0.90, 0.10, 0.00"


def test_automodels_is_async_is_async_checkpoint(data, tmp_path):
    for written, value in (("true", True), ("false", False)):
        recipe = todays_recipe(tmp_path, data, ("  save_consolidated: false",
                                                f"  save_consolidated: false\n  is_async: {written}"))
        assert train_gpt2.load_config([recipe]).async_checkpoint is value


@pytest.mark.parametrize("key, pointer", [
    ("learning_rate", "it is --lr"), ("max_iters", "it is --max_steps"),
    ("lr_decay_iters", "the cosine decay always ends at --max_steps"), ("warmup_iters", "it is --lr_warmup_steps"),
    ("eval_interval", "it is --val_every_steps"), ("eval_iters", "--val_tokens = eval_iters x batch_size x block_size"),
    ("log_interval", "--log_every_steps"), ("batch_size", "it is --local_batch_size"),
    ("gradient_accumulation_steps", "global_batch_size / (local_batch_size x world size); set --global_batch_size = "
                                    "gradient_accumulation_steps x batch_size"),
    ("dropout", "the model has no dropout"), ("decay_lr", "--min_lr=<lr>"), ("dataset", "it is --data_paths"),
])
def test_nanogpts_config_names_point_to_ours_and_are_never_aliases(tmp_path, key, pointer):
    for argv in ([f"--{key}=1"], [str(tmp_path / "config.py")]):
        (tmp_path / "config.py").write_text(f"{key} = 1\n")
        said = re.escape(f"'{key}' is nanoGPT's name; here ") + ".*" + re.escape(pointer)
        with pytest.raises(ValueError, match=said):
            train_gpt2.load_config(argv)


def test_nanogpts_init_from_resume_and_wandb_names():
    assert train_gpt2.load_config(["--min_lr=6e-5"]).min_lr == 6e-5  # the same name, the same meaning
    with pytest.raises(ValueError, match=r"init_from='resume' is nanoGPT's; here rerunning the same command \(the same "
                                         r"out_dir\) resumes from its newest checkpoint"):
        train_gpt2.load_config(["--init_from=resume"])
    with pytest.raises(ValueError, match="init_from='scratch' is nanoGPT's; here a fresh GPT-2 init is the default"):
        train_gpt2.load_config(["--init_from=scratch"])
    with pytest.raises(ValueError, match="unknown config key 'wandb_entity'; wandb's keys are wandb_log, "
                                         "wandb_project, wandb_run_name"):
        train_gpt2.load_config(["--wandb_entity=me"])



@dataclass
class Toy:
    lr: float = 1e-3
    steps: int | None = 10
    name: str = "run"
    flag: bool = False


def test_files_then_overrides_in_order(tmp_path):
    config = tmp_path / "c.py"
    config.write_text("import math\nlr = 3e-4\nsteps = 2 ** 4\n_private = 1\n")
    cfg = parse_config(Toy, [str(config), "--steps=None", "--name=a,b", "--flag=True", "--lr=1"])
    assert cfg == Toy(lr=1.0, steps=None, name="a,b", flag=True)  # an int is a fine float; "a,b" stays a string


@pytest.mark.parametrize("argv, message", [
    (["--step=3"], "unknown config key 'step'; did you mean 'steps'?"),
    (["--steps=1.5"], "steps must be int or None, got 1.5"),
    (["--flag=1"], "flag must be bool, got 1"),
    (["--lr"], "write overrides as --key=value"),
])
def test_bad_overrides_name_the_key(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_config(Toy, argv)


@pytest.mark.parametrize("text, message", [
    ("lr = 1\nsteps = (\n", r"c\.py:2: syntax error"),
    ("lr = 1\nsteps = 1 / 0\n", r"c\.py:2: ZeroDivisionError"),
    ("import sys\nsys.exit(0)\n", r"called sys\.exit\(0\)"),
])
def test_config_file_errors_name_file_and_line(tmp_path, text, message):
    config = tmp_path / "c.py"
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        parse_config(Toy, [str(config)])
    with pytest.raises(FileNotFoundError, match="config file not found"):
        parse_config(Toy, [str(tmp_path / "missing.py")])




@pytest.mark.slow
def test_load_config_errors_name_file_and_line(tmp_path):
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
    with pytest.raises(ValueError, match="lr must be > 0, got inf"):
        train_gpt2.load_config(["--lr=1e400"])
    # on the command line: exit status 1, one line
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), str(config)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"train_gpt2.py: error: {config}:2: NameError: name 'learning_rate' is not defined" in result.stderr



@pytest.mark.parametrize("override, message", [
    ("--min_lr=-1e-2", "min_lr must be between 0 and lr (0.0006), got -0.01"),
    ("--min_lr=1e-3", "min_lr must be between 0 and lr (0.0006), got 0.001"),
    ("--lr=-1e-3", "lr must be > 0, got -0.001"),
    ("--lr=1e999", "lr must be > 0, got inf"),
    ("--weight_decay=-0.1", "weight_decay must be >= 0, got -0.1"),
    ("--beta1=1.0", "beta1 must be in [0, 1), got 1.0"),
    ("--beta2=-0.5", "beta2 must be in [0, 1), got -0.5"),
    ("--adam_eps=0", "adam_eps must be > 0, got 0.0"),
    ("--grad_clip=-1", "grad_clip must be >= 0 (0: no clipping), got -1.0"),
    ("--lr_warmup_steps=-1", "lr_warmup_steps must be >= 0, got -1"),
    ("--local_batch_size=0", "local_batch_size must be >= 1, got 0"),
    ("--ckpt_keep=0", "ckpt_keep must be >= 1, got 0"),
    ("--dtype=float16", "dtype must be one of bfloat16, float32, got 'float16'"),
])
def test_a_value_out_of_range_is_one_line_naming_the_key_value_and_range(override, message):
    with pytest.raises(ValueError) as error:
        train_gpt2.load_config([override])
    assert str(error.value) == f"config: {message}"


@pytest.mark.slow
def test_a_negative_min_lr_never_trains(tmp_path):
    result = script("--min_lr=-1e-2", f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == 1 and not (tmp_path / "out").exists()
    assert result.stderr == "train_gpt2.py: error: config: min_lr must be between 0 and lr " \
                            "(0.0006), got -0.01\n"


# A local directory named as a hub model (runs/gpt2) is read too: its config.json wins over the name.
@pytest.mark.parametrize("name", ["my-gpt2", "gpt2"])
def test_a_recipe_naming_a_local_hf_config_directory_takes_its_sizes(data, tmp_path, name):
    config = tmp_path / name
    config.mkdir()
    sizes = dict(model_type="gpt2", n_layer=3, n_head=4, n_embd=64, vocab_size=1000)
    (config / "config.json").write_text(json.dumps(sizes))
    recipe = todays_recipe(tmp_path, data, ("openai-community/gpt2\n    n_layer: 2\n",
                                            f"{config}\n"))
    text = open(recipe).read()
    for key in ("n_head", "n_embd", "vocab_size"):
        text = re.sub(rf"\n    {key}: \d+", "", text)
    open(recipe, "w").write(text)
    cfg = train_gpt2.load_config([recipe])
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.padded_vocab_size) == \
        (3, 4, 64, 1000, 1024)
    # model.config's own keys win over the directory's.
    text = text.replace(f"{config}\n", f"{config}\n    n_layer: 5\n")
    open(recipe, "w").write(text)
    assert train_gpt2.load_config([recipe]).n_layer == 5


# AutoModel's dion.Muon section (its MuonConfig's fields), as a recipe would write it.
MUON_SECTION = """optimizer:
  _target_: dion.Muon
  lr: 0.02
  mu: 0.9
  adjust_lr: rms_norm
  nesterov: false
  scalar_opt: adamw
  scalar_betas: [0.8, 0.95]
  scalar_eps: 1.0e-10
  scalar_lr: 0.003
  embed_lr: 0.006
  lm_head_lr: 0.001
  betas: [0.9, 0.95]
  epsilon: 1.0e-8
  weight_decay: 0.01

"""


def muon_recipe(tmp_path, data, *edits):
    text = open(TODAYS_RECIPE).read()
    start, end = text.index("optimizer:\n"), text.index("lr_scheduler:")
    return todays_recipe(tmp_path, data, (text[start:end], MUON_SECTION), *edits)


def test_automodels_muon_section_maps_key_by_key_and_its_defaults_are_muonconfigs(data, tmp_path):
    cfg = train_gpt2.load_config([muon_recipe(tmp_path, data)])
    assert (cfg.optimizer, cfg.lr, cfg.muon_lr, cfg.muon_momentum, cfg.muon_adjust_lr, cfg.beta1, cfg.beta2,
            cfg.adam_eps, cfg.muon_scalar_lr, cfg.muon_embed_lr, cfg.weight_decay) == \
        ("muon", 0.02, 0.02, 0.9, "rms_norm", 0.8, 0.95, 1e-10, 0.003, 0.006, 0.01)
    bare = muon_recipe(tmp_path, data, *[(line + "\n", "") for line in MUON_SECTION.splitlines()[2:-1]])
    cfg = train_gpt2.load_config(["--optimizer=adamw", "--muon_scalar_lr=1.0", bare])
    # dion's lr is Muon's and the schedule's; its scalar_lr defaults to that lr (ours would be 5 x lr)
    assert (cfg.optimizer, cfg.lr, cfg.muon_lr, cfg.muon_momentum, cfg.muon_adjust_lr, cfg.beta1, cfg.beta2,
            cfg.adam_eps, cfg.muon_scalar_lr, cfg.muon_embed_lr, cfg.weight_decay) == \
        ("muon", 5e-4, 5e-4, 0.95, "spectral_norm", 0.9, 0.999, 1e-8, 5e-4, None, 0.0)


@pytest.mark.parametrize("edit, named", [
    (("  mu: 0.9\n", "  mu: 0.9\n  newton_schulz_func: my.ns\n"), "optimizer.newton_schulz_func='my.ns'"),
    (("nesterov: false", "nesterov: true"), "optimizer.nesterov=True"),
    (("scalar_opt: adamw", "scalar_opt: lion"), "optimizer.scalar_opt='lion'"),
    (("  mu: 0.9\n", "  mu: 0.9\n  eps: 1.0e-8\n"), "optimizer.eps=1e-08"),
    (("dion.Muon", "dion.NorMuon"), "optimizer._target_='dion.NorMuon'"),
])
def test_a_muon_key_that_does_not_map_is_named_in_one_line(data, tmp_path, edit, named):
    with pytest.raises(ValueError, match=re.escape(named)) as error:
        train_gpt2.load_config([muon_recipe(tmp_path, data, edit)])
    assert "\n" not in str(error.value) and "not supported by train_gpt2.py" in str(error.value)


@pytest.mark.slow
def test_an_automodel_recipe_with_dion_muon_trains_with_torchs_muon(data, tmp_path):
    result = script(muon_recipe(tmp_path, data), "--device=cpu", "--compile=False")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    said = next(line for line in result.stdout.splitlines() if "AutoModel recipe read as" in line)
    for text in ("--optimizer='muon'", "--muon_momentum=0.9", "optimizer.lm_head_lr=0.001", "optimizer.nesterov=False"):
        assert text in said, text
    assert sorted(metrics(tmp_path / "out", "val_loss")) == [0, 5, 10]
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["optimizer"] == "muon"
