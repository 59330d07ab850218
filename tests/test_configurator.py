"""configurator.parse_config: config files then --key=value overrides, in order, each value checked against the
dataclass's field types; every error names the key, or the file and line."""
from dataclasses import dataclass

import pytest

from train_gpt2 import parse_config


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
