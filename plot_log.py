"""Plot one or more llm.c-format main.log files against GPT-2 and GPT-3: the picture llm.c's runs are judged by.

    python plot_log.py out/main.log [other/main.log ...] -o curves.png
    python plot_log.py out_gpt2_124m --reference out_openai_gpt2 -o curves.png   # OpenAI's GPT-2 on your val tokens

The layout is llm.c's dev/vislog.ipynb: on the left train and val loss (log-scale y) with OpenAI GPT-2 124M's val loss
on FineWeb-Edu (3.2924) and on llm.c's FineWeb val (3.424958); on the right HellaSwag acc_norm with GPT-2 124M
(0.2945) and GPT-3 Small 125M (0.337). Each run's lowest losses and highest HellaSwag are marked on the curves and
their values and steps written in the legend. A run's out_dir may stand for its main.log. Those published baselines
were measured on build-nanogpt's and llm.c's val tokens; `--reference RUN_DIR` replaces them with a line measured on
yours, by `train_gpt2.py CONFIG --eval_only=True --init_from=gpt2 --out_dir=RUN_DIR`.

The log is read the way vislog reads it: `s:STEP key:value`, only the first key after the step counts, and a later
line for a step replaces an earlier one (a resumed run re-logs the steps after its last checkpoint). Lines that do not
parse are skipped with a warning. matplotlib is needed only here; it renders with the Agg backend, no display needed.
"""
import argparse
import math
import os
import sys

from atomic_io import atomic_save

GPT2_VAL_LOSS_FINEWEB_EDU = 3.2924
GPT2_VAL_LOSS_FINEWEB = 3.424958
GPT2_HELLASWAG = 0.2945
GPT3_HELLASWAG = 0.337


def parse_log(path):
    """{key: [(step, value), ...] sorted by step} for every key in the log (trl, tel, eval, ...); later lines win."""
    if os.path.isdir(path):
        path = os.path.join(path, "main.log")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: log file not found")
    streams, bad_lines = {}, []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_number, line in enumerate(f, start=1):
            fields = line.split()
            if not fields:
                continue
            try:
                s, step = fields[0].split(":")
                key, value = fields[1].split(":")
                if s != "s" or not key:
                    raise ValueError
                streams.setdefault(key, {})[int(step)] = float(value)
            except (ValueError, IndexError):
                bad_lines.append(line_number)
    if bad_lines:
        print(f"plot_log.py: warning: {path}: skipped {len(bad_lines)} line(s) that are not 's:STEP key:value' "
              f"(first: line {bad_lines[0]})", file=sys.stderr)
    if not any(streams.get(key) for key in ("trl", "tel", "eval")):
        raise ValueError(f"{path}: no 's:STEP trl:/tel:/eval:' lines; is this a main.log written by train_gpt2.py "
                         f"or llm.c?")
    return {key: sorted(points.items()) for key, points in streams.items()}


def extreme(points, best):
    """(step, value) of the lowest (best=min) or highest (best=max) finite value, or None."""
    finite = [(step, value) for step, value in points if math.isfinite(value)]
    return best(finite, key=lambda point: point[1]) if finite else None


def plot(runs, out_path, loss_max=None, references=()):
    """Render [(label, streams), ...] into out_path (png, svg, pdf, ... by extension), written atomically.
    references: [(label, streams), ...] of --eval_only runs, drawn as horizontal lines at their s:0 val loss and
    HellaSwag; without any, the published OpenAI GPT-2/GPT-3 figures are drawn, labelled with their source."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ImportError("plot_log.py needs matplotlib: pip install matplotlib (training does not)") from None

    fig = Figure(figsize=(16, 6))
    canvas = FigureCanvasAgg(fig)
    fmt = os.path.splitext(out_path)[1].lstrip(".").lower()
    if fmt not in canvas.get_supported_filetypes():
        raise ValueError(f"{out_path}: unsupported image type '{fmt}'; use one of "
                         f"{', '.join(sorted(canvas.get_supported_filetypes()))}")
    loss_ax, hellaswag_ax = fig.subplots(1, 2, sharex=True)  # same steps side by side
    for i, (label, streams) in enumerate(runs):
        color = f"C{i % 10}"
        for key, ax, best, name, style in (("trl", loss_ax, min, "train loss", dict(alpha=0.6, linewidth=1)),
                                           ("tel", loss_ax, min, "val loss", dict(linestyle="--", marker=".")),
                                           ("eval", hellaswag_ax, max, "HellaSwag", dict(marker="."))):
            if not streams.get(key):
                continue
            steps, values = zip(*streams[key])
            point = extreme(streams[key], best)
            if point is None:
                ax.plot(steps, values, color=color, label=f"{label} {name}", **style)
                continue
            # the extreme goes into the legend and gets a marker: text next to the curves would overlap them
            which = "min" if best is min else "max"
            ax.plot(steps, values, color=color, label=f"{label} {name} ({which} {point[1]:.4f} @ {point[0]})", **style)
            ax.plot([point[0]], [point[1]], color=color, marker="v" if best is min else "^", markersize=8,
                    markeredgecolor="black")

    for i, (label, streams) in enumerate(references):
        style = dict(color=f"C{(len(runs) + i) % 10}", linestyle="-.", linewidth=1.5)
        for key, ax, name in (("tel", loss_ax, "val loss"), ("eval", hellaswag_ax, "HellaSwag")):
            if streams.get(key):
                value = streams[key][0][1]
                ax.axhline(value, label=f"{label} {name} on these val tokens ({value:.4f}, eval_only)", **style)
    if not references:
        loss_ax.axhline(GPT2_VAL_LOSS_FINEWEB_EDU, color="r", linestyle="--", linewidth=1,
                        label=f"OpenAI GPT-2 (124M) val loss on build-nanogpt's FineWeb-Edu val shard "
                              f"({GPT2_VAL_LOSS_FINEWEB_EDU}, build-nanogpt)")
        loss_ax.axhline(GPT2_VAL_LOSS_FINEWEB, color="m", linestyle=":", linewidth=1,
                        label=f"OpenAI GPT-2 (124M) val loss on llm.c's FineWeb val ({GPT2_VAL_LOSS_FINEWEB}, llm.c)")
    loss_ax.set_yscale("log")
    plain_numbers = FuncFormatter(lambda y, _: f"{y:g}")
    loss_ax.yaxis.set_major_formatter(plain_numbers)
    loss_ax.yaxis.set_minor_formatter(plain_numbers)
    if loss_max is not None:
        loss_ax.set_ylim(top=loss_max)
    loss_ax.set(xlabel="steps", ylabel="loss", title="Loss")
    loss_ax.legend(fontsize=8)

    if not any(streams.get("eval") for _, streams in references):
        hellaswag_ax.axhline(GPT2_HELLASWAG, color="r", linestyle="--", linewidth=1,
                             label=f"OpenAI GPT-2 (124M) checkpoint ({GPT2_HELLASWAG}, llm.c's vislog)")
        hellaswag_ax.axhline(GPT3_HELLASWAG, color="g", linestyle="--", linewidth=1,
                             label=f"OpenAI GPT-3 (125M) checkpoint ({GPT3_HELLASWAG}, GPT-3 paper)")
    if not any(streams.get("eval") for _, streams in runs):
        hellaswag_ax.text(0.5, 0.5, "no HellaSwag evals (eval:) in these logs", ha="center", va="center",
                          transform=hellaswag_ax.transAxes, color="gray")
        hellaswag_ax.set_ylim(0.2, 0.4)
    hellaswag_ax.set(xlabel="steps", ylabel="accuracy (acc_norm)", title="HellaSwag eval")
    hellaswag_ax.legend(fontsize=8)

    # render next to the target and rename, so a crash never leaves a truncated picture under the real name
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    atomic_save(out_path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=100, bbox_inches="tight"))


def summary(label, streams):
    parts = []
    for key, name, best in (("trl", "min train loss", min), ("tel", "min val loss", min),
                            ("eval", "max HellaSwag", max)):
        point = extreme(streams.get(key, []), best)
        if point:
            parts.append(f"{name} {point[1]:.4f} (step {point[0]})")
    return f"{label}: " + ", ".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="main.log files (llm.c format) or the out_dirs holding them")
    parser.add_argument("-o", "--output", default="curves.png", help="image to write (default curves.png)")
    parser.add_argument("--labels", nargs="+", default=None, help="legend name of each log (default: its folder)")
    parser.add_argument("--loss-max", type=float, default=None, help="top of the loss axis, e.g. 4.0 as in vislog")
    parser.add_argument("--reference", action="append", default=[], metavar="RUN_DIR",
                        help="an out_dir of train_gpt2.py --eval_only=True (e.g. OpenAI's gpt2 on your val tokens), "
                             "drawn as a horizontal line; repeatable")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.logs):
        parser.error(f"--labels got {len(args.labels)} names for {len(args.logs)} logs")

    run_dirs = [path if os.path.isdir(path) else os.path.dirname(path) for path in args.logs]
    labels = args.labels or [os.path.basename(os.path.abspath(run_dir)) for run_dir in run_dirs]
    if len(set(labels)) < len(labels):
        labels = list(args.logs)
    try:
        runs = [(label, parse_log(path)) for label, path in zip(labels, args.logs)]
        references = [(os.path.basename(os.path.abspath(path)), parse_log(path)) for path in args.reference]
        plot(runs, args.output, loss_max=args.loss_max, references=references)
    except (FileNotFoundError, ValueError, ImportError) as e:
        sys.exit(f"plot_log.py: error: {e}")
    except OSError as e:  # -o under a file, in a read-only directory, on a full disk
        sys.exit(f"plot_log.py: error: -o {args.output}: {e.filename or args.output}: {e.strerror or e}; choose "
                 f"another output path")
    for label, streams in runs + references:
        print(summary(label, streams))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
