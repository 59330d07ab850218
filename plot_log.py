"""Plot llm.c-format main.log files against GPT-2 and GPT-3, in the layout of llm.c's dev/vislog.ipynb.

    python plot_log.py out/main.log [other/main.log ...] -o curves.png
    python plot_log.py out_gpt2_124m --reference out_openai_gpt2 -o curves.png   # OpenAI's GPT-2 on your val tokens

Left: train and val loss (log y), right: HellaSwag acc_norm, against OpenAI's published GPT-2/GPT-3 figures or those
a --reference run (train_gpt2.py --eval_only=True) measured on your val tokens. Logs are read as vislog reads them.
"""
import argparse
import math
import os
import sys

from atomic_io import atomic_save

# (value, color, linestyle, label) of OpenAI's published figures, drawn where no --reference run measured its own
PUBLISHED = {"tel": [(3.2924, "r", "--", "OpenAI GPT-2 (124M) val loss on build-nanogpt's FineWeb-Edu val shard "
                                         "(3.2924, build-nanogpt)"),
                     (3.424958, "m", ":", "OpenAI GPT-2 (124M) val loss on llm.c's FineWeb val (3.424958, llm.c)")],
             "eval": [(0.2945, "r", "--", "OpenAI GPT-2 (124M) checkpoint (0.2945, llm.c's vislog)"),
                      (0.337, "g", "--", "OpenAI GPT-3 (125M) checkpoint (0.337, GPT-3 paper)")]}


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
        raise ValueError(f"{path}: no 's:STEP trl:/tel:/eval:' lines; is this a main.log of train_gpt2.py or llm.c?")
    return {key: sorted(points.items()) for key, points in streams.items()}


def extreme(points, best):
    """(step, value) of the lowest (best=min) or highest (best=max) finite value, or None."""
    finite = [(step, value) for step, value in points if math.isfinite(value)]
    return best(finite, key=lambda point: point[1]) if finite else None


def plot(runs, out_path, loss_max=None, references=()):
    """Render [(label, streams), ...] into out_path (png, svg, ... by extension); references (--eval_only runs) are
    drawn as horizontal lines at their s:0 val loss and HellaSwag in place of the published figures."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ImportError("plot_log.py needs matplotlib: pip install matplotlib (training does not)") from None
    fig = Figure(figsize=(16, 6))
    fmt = os.path.splitext(out_path)[1].lstrip(".").lower()
    supported = FigureCanvasAgg(fig).get_supported_filetypes()
    if fmt not in supported:
        raise ValueError(f"{out_path}: unsupported image type '{fmt}'; use one of {', '.join(sorted(supported))}")
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
            # the extreme goes into the legend and gets a marker: text next to the curves would overlap them
            note = f" ({'min' if best is min else 'max'} {point[1]:.4f} @ {point[0]})" if point else ""
            ax.plot(steps, values, color=color, label=f"{label} {name}{note}", **style)
            if point:
                ax.plot(*zip(point), color=color, marker="v" if best is min else "^", markersize=8,
                        markeredgecolor="black")
    for key, ax, name in (("tel", loss_ax, "val loss"), ("eval", hellaswag_ax, "HellaSwag")):
        for i, (label, streams) in enumerate(references):
            if streams.get(key):
                value = streams[key][0][1]
                ax.axhline(value, color=f"C{(len(runs) + i) % 10}", linestyle="-.", linewidth=1.5,
                           label=f"{label} {name} on these val tokens ({value:.4f}, eval_only)")
        if not any(streams.get(key) for _, streams in references):
            for value, color, linestyle, label in PUBLISHED[key]:
                ax.axhline(value, color=color, linestyle=linestyle, linewidth=1, label=label)
    loss_ax.set_yscale("log")
    plain_numbers = FuncFormatter(lambda y, _: f"{y:g}")
    loss_ax.yaxis.set_major_formatter(plain_numbers)
    loss_ax.yaxis.set_minor_formatter(plain_numbers)
    if loss_max is not None:
        loss_ax.set_ylim(top=loss_max)
    loss_ax.set(xlabel="steps", ylabel="loss", title="Loss")
    loss_ax.legend(fontsize=8)
    if not any(streams.get("eval") for _, streams in runs):
        hellaswag_ax.text(0.5, 0.5, "no HellaSwag evals (eval:) in these logs", ha="center", va="center",
                          transform=hellaswag_ax.transAxes, color="gray")
        hellaswag_ax.set_ylim(0.2, 0.4)
    hellaswag_ax.set(xlabel="steps", ylabel="accuracy (acc_norm)", title="HellaSwag eval")
    hellaswag_ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    atomic_save(out_path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=100, bbox_inches="tight"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="main.log files (llm.c format) or the out_dirs holding them")
    parser.add_argument("-o", "--output", default="curves.png", help="image to write (default curves.png)")
    parser.add_argument("--labels", nargs="+", default=None, help="legend name of each log (default: its folder)")
    parser.add_argument("--loss-max", type=float, default=None, help="top of the loss axis, e.g. 4.0 as in vislog")
    parser.add_argument("--reference", action="append", default=[], metavar="RUN_DIR",
                        help="an out_dir of train_gpt2.py --eval_only=True, drawn as a horizontal line; repeatable")
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
    for label, streams in runs + references:  # each curve's best point
        parts = []
        for key, name, best in (("trl", "min train loss", min), ("tel", "min val loss", min),
                                ("eval", "max HellaSwag", max)):
            if point := extreme(streams.get(key, []), best):
                parts.append(f"{name} {point[1]:.4f} (step {point[0]})")
        print(f"{label}: " + ", ".join(parts))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
