"""plot_log.py on a real main.log: the demo config (shrunk to a few steps of a 1-layer model, HellaSwag on the fixture)
trained, stopped, resumed from an earlier checkpoint with another lr so steps are re-logged with new values; the PNG is
read back. Garbage lines are skipped with a count, logs without data get clear errors."""
import os
import re
import stat

import numpy as np
import pytest

from conftest import ROOT
import plot_log
from indexed_dataset import IndexedDatasetBuilder
from tokenizer import EOT_ID, gpt2_encoding

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hellaswag_small.jsonl")


def write_shakespeare(prefix, num_chars=60_000):
    """The start of tinyshakespeare as GPT-2 tokens, one document per blank-line separated block, as the demo has it."""
    with open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        blocks = [b for b in re.split(r"\n\s*\n", f.read(num_chars)) if b.strip()]
    enc = gpt2_encoding()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for block in blocks:
        builder.add_document(np.array(enc.encode_ordinary(block) + [EOT_ID], dtype=np.uint16))
    builder.finalize(prefix + ".idx")


def demo_args(data, out_dir, **overrides):
    config = dict(data_paths=data, out_dir=str(out_dir), seq_length=32, n_layer=1, n_head=2, n_embd=32,
                  global_batch_size=4, local_batch_size=4, max_steps=6, lr_warmup_steps=2, val_every_steps=2,
                  val_tokens=256, hellaswag=FIXTURE, hellaswag_limit=4, sample_tokens=0, ckpt_every_steps=3,
                  dtype="float32")
    config.update(overrides)
    return [os.path.join(ROOT, "configs", "demo_cpu.py")] + [f"--{k}={v}" for k, v in config.items()]


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory):
    """main.log of the demo config: steps 0-5, then a resume from the step-3 checkpoint with a lower lr, which
    re-logs steps 3-6 with different values (as a run resumed after a crash re-logs the steps since its checkpoint)."""
    import train_gpt2

    root = tmp_path_factory.mktemp("demo")
    data, out_dir = str(root / "shakespeare"), root / "out_demo"
    write_shakespeare(data)
    train_gpt2.main(demo_args(data, out_dir))
    first_run = (out_dir / "main.log").read_text().splitlines()
    os.rename(out_dir / "ckpt" / "step_00000006", root / "step_00000006")  # as if the run died before saving it
    train_gpt2.main(demo_args(data, out_dir, lr=1e-4))
    return out_dir / "main.log", first_run


@pytest.mark.slow
def test_demo_log_renders_and_later_lines_win(demo_log, tmp_path, capsys):
    import matplotlib.image

    log_path, first_run = demo_log
    lines = log_path.read_text().splitlines()
    resumed = lines[len(first_run):]
    assert lines[:len(first_run)] == first_run and any(l.startswith("s:3 trl:") for l in resumed)

    def values(log_lines, key):
        return {int(m[1]): float(m[2]) for m in (re.match(rf"s:(\d+) {key}:(\S+)", l) for l in log_lines) if m}

    streams = plot_log.parse_log(str(log_path))
    for key in ("trl", "tel", "eval"):
        expected = {**values(first_run, key), **values(resumed, key)}
        assert dict(streams[key]) == expected and [s for s, _ in streams[key]] == sorted(expected)
    assert dict(streams["trl"])[4] == values(resumed, "trl")[4] != values(first_run, "trl")[4]
    assert set(dict(streams["eval"])) == {2, 4, 6} and set(dict(streams["tel"])) == {0, 2, 4, 6}

    out = tmp_path / "curves.png"
    plot_log.main([str(log_path.parent), str(log_path), "--labels", "demo", "demo again", "-o", str(out)])
    printed = capsys.readouterr()
    assert "demo: min train loss" in printed.out and "max HellaSwag" in printed.out and "warning" not in printed.err
    assert out.stat().st_size > 20_000
    image = matplotlib.image.imread(str(out))
    height, width = image.shape[:2]
    assert image.ndim == 3 and 1200 < width < 1700 and 400 < height < 700  # 16 x 6 inches at 100 dpi, trimmed
    assert image[..., :3].std() > 0.05  # curves and text, not a blank canvas
    assert os.listdir(tmp_path) == ["curves.png"]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # an ordinary file, not a private temporary one


@pytest.mark.slow
def test_garbage_lines_are_counted_and_skipped(demo_log, tmp_path, capsys):
    log_path, _ = demo_log
    noisy = tmp_path / "main.log"
    lines = log_path.read_text().splitlines()
    noisy.write_text("\n".join(lines[:3] + ["Traceback (most recent call last):", "s:x trl:1.0", "s:7", "",
                                            "s:9 trl:not-a-number", "\x00\x01binary"] + lines[3:]) + "\n")
    assert plot_log.parse_log(str(noisy)) == plot_log.parse_log(str(log_path))
    err = capsys.readouterr().err
    assert str(noisy) in err and "5 line(s)" in err and "line 4" in err

    plot_log.main([str(noisy), "-o", str(tmp_path / "noisy.png")])
    assert (tmp_path / "noisy.png").stat().st_size > 20_000


def test_bad_input_gives_clear_errors(tmp_path, capsys):
    empty = tmp_path / "empty" / "main.log"
    empty.parent.mkdir()
    empty.write_text("hello\nworld\n")
    with pytest.raises(SystemExit, match=r"plot_log\.py: error: .*empty/main\.log"):
        plot_log.main([str(empty), "-o", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match=r"nothere/main\.log"):
        plot_log.main([str(tmp_path / "nothere" / "main.log")])

    good = tmp_path / "run" / "main.log"
    good.parent.mkdir()
    good.write_text("s:0 tel:10.9\ns:0 trl:10.9 lr:0.0006 norm:1.5\ns:1 trl:9.5 lr:0.0006 norm:1.2\n")
    with pytest.raises(SystemExit, match=r"x\.docx: .*'docx'"):
        plot_log.main([str(good), "-o", str(tmp_path / "x.docx")])
    for bad in ("-1", "0", "nan", "inf"):  # refused, not silently ignored
        with pytest.raises(SystemExit):
            plot_log.main([str(good), f"--loss-max={bad}", "-o", str(tmp_path / "x.png")])
        err = capsys.readouterr().err
        assert err.endswith(f": error: --loss-max must be a positive finite loss, got {float(bad)}\n"), err
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.docx").exists()


def test_loss_only_log_renders(tmp_path, capsys):
    import matplotlib.image

    log = tmp_path / "run" / "main.log"
    log.parent.mkdir()
    log.write_text("".join(f"s:{s} trl:{10 / (1 + s):.4f} lr:0.000600 norm:1.00\n" for s in range(50))
                   + "s:0 tel:11.0\ns:49 tel:0.5\n")
    plot_log.main([str(log), "-o", str(tmp_path / "loss.svg"), "--loss-max", "4.0"])
    assert (tmp_path / "loss.svg").read_text().lstrip().startswith("<?xml")
    plot_log.main([str(log), "-o", str(tmp_path / "loss.png")])
    assert "run: min train loss 0.2000 (step 49), min val loss 0.5000 (step 49)\n" in capsys.readouterr().out
    assert matplotlib.image.imread(str(tmp_path / "loss.png")).std() > 0.05


def test_a_log_without_hellaswag_gets_no_hellaswag_panel(tmp_path):
    """The demo has no HellaSwag: a panel of the published baselines alone would look like a result."""
    log = tmp_path / "run" / "main.log"
    log.parent.mkdir()
    log.write_text("s:0 tel:11.0\ns:0 trl:10.9 lr:0.0006 norm:1.5\ns:1 trl:9.5 lr:0.0006 norm:1.2\ns:1 tel:9.0\n")
    figure = plot_log.plot([("run", plot_log.parse_log(str(log)))], str(tmp_path / "loss.png"))
    assert [ax.get_title() for ax in figure.axes] == ["Loss"]
    with_hellaswag = tmp_path / "hellaswag" / "main.log"
    with_hellaswag.parent.mkdir()
    with_hellaswag.write_text(log.read_text() + "s:1 eval:0.2600\n")
    figure = plot_log.plot([("run", plot_log.parse_log(str(log))), ("other", plot_log.parse_log(str(with_hellaswag)))],
                           str(tmp_path / "both.png"))
    assert [ax.get_title() for ax in figure.axes] == ["Loss", "HellaSwag eval"]


@pytest.mark.slow
def test_logged_hellaswag_equals_the_standalone_cli(demo_log):
    """The `s:6 eval:` the trainer logged for its final model is what hellaswag.py computes from the run's files."""
    import hellaswag

    log_path, _ = demo_log
    out_dir = log_path.parent
    logged = dict(plot_log.parse_log(str(log_path))["eval"])[6]
    for model in (out_dir, out_dir / "ckpt" / "step_00000006", out_dir / "hf"):
        result = hellaswag.main(["--model", str(model), "--data", FIXTURE, "--limit", "4", "--device", "cpu"])
        assert result["total"] == 4 and round(result["acc_norm"], 4) == logged


def test_reference_run_is_drawn_as_a_labelled_line_instead_of_the_published_baselines(tmp_path, monkeypatch):
    import plot_log

    run, ref = tmp_path / "run", tmp_path / "openai_gpt2"
    run.mkdir()
    ref.mkdir()
    (run / "main.log").write_text("s:0 tel:10.9\ns:0 trl:10.9 lr:0.000001 norm:1.0\ns:1 trl:9.0 lr:0.000002 norm:1.0\n"
                                  "s:1 tel:8.5\ns:1 eval:0.2600\n")
    (ref / "main.log").write_text("s:0 tel:3.3100\ns:0 eval:0.2950\n")
    drawn = []
    from matplotlib.axes import Axes
    real = Axes.axhline
    monkeypatch.setattr(Axes, "axhline", lambda self, y, **kw: drawn.append((y, kw.get("label"))) or real(self, y, **kw))
    plot_log.main([str(run), "--reference", str(ref), "-o", str(tmp_path / "c.png")])
    assert (3.31, "openai_gpt2 val loss on these val tokens (3.3100, eval_only)") in drawn
    assert (0.295, "openai_gpt2 HellaSwag on these val tokens (0.2950, eval_only)") in drawn
    assert not any(label and "OpenAI" in label for _, label in drawn)  # the published figures give way
    drawn.clear()
    plot_log.main([str(run), "-o", str(tmp_path / "d.png")])
    assert any(label and "build-nanogpt" in label for _, label in drawn)  # without a reference: labelled sources


def test_a_torn_last_line_is_not_a_point(tmp_path, capsys):
    """A run killed mid-write leaves its last line without a newline: skipped, as the trainer's resume does."""
    log = tmp_path / "run" / "main.log"
    log.parent.mkdir()
    log.write_text("s:10 trl:3.5000\ns:11 trl:3.4000\ns:12 trl:1")
    assert plot_log.parse_log(str(log))["trl"] == [(10, 3.5), (11, 3.4)]
    plot_log.main([str(log), "-o", str(tmp_path / "curves.png")])
    captured = capsys.readouterr()
    assert "min train loss 3.4000 (step 11)" in captured.out and "warning" not in captured.err
