"""Plot llm.c-format main.log files (loss, HellaSwag) against GPT-2 and GPT-3 in the layout of llm.c's dev/vislog.ipynb.

    python plot_log.py out/main.log [other/main.log ...] -o curves.png
    python plot_log.py out_gpt2_124m --reference out_openai_gpt2 -o curves.png   # OpenAI's GPT-2 on your val tokens
"""
import argparse
import math
import os
import re
import sys

from atomic_io import atomic_save

# (value, color, linestyle, label) of OpenAI's published figures, drawn where no --reference run measured its own
PUBLISHED = {"tel": [(3.2924, "r", "--", "OpenAI GPT-2 (124M) on build-nanogpt's FineWeb-Edu val shard (3.2924)"),
                     (3.424958, "m", ":", "OpenAI GPT-2 (124M) on llm.c's FineWeb val (3.424958, llm.c)")],
             "eval": [(0.2945, "r", "--", "OpenAI GPT-2 (124M) checkpoint (0.2945, llm.c's vislog)"),
                      (0.337, "g", "--", "OpenAI GPT-3 (125M) checkpoint (0.337, GPT-3 paper)")]}
STREAMS = [("trl", "train loss", min), ("tel", "val loss", min), ("eval", "HellaSwag", max)]  # key, name, best


def parse_log(path):
    """{key: [(step, value), ...] sorted by step} for every key in the log (trl, tel, eval, ...); later lines win."""
    if os.path.isdir(path):  # an out_dir: its main.log, or an --eval_only run's eval/main.log
        path = next((p for p in (os.path.join(path, "main.log"), os.path.join(path, "eval", "main.log"))
                     if os.path.isfile(p)), os.path.join(path, "main.log"))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: log file not found")
    streams, bad_lines = {}, []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_number, line in enumerate(f, start=1):
            m = re.match(r"s:(\d+)\s+(\w+):(\S+)", line)  # as vislog reads it: the first key:value after the step
            try:
                streams.setdefault(m[2], {})[int(m[1])] = float(m[3])  # the value is parsed before the key is added
            except (TypeError, ValueError):  # no match, or not a number
                if line.strip():
                    bad_lines.append(line_number)
    if bad_lines:
        print(f"plot_log.py: warning: {path}: skipped {len(bad_lines)} line(s) that are not 's:STEP key:value' "
              f"(first: line {bad_lines[0]})", file=sys.stderr)
    if not any(streams.get(key) for key, _, _ in STREAMS):
        raise ValueError(f"{path}: no 's:STEP trl:/tel:/eval:' lines; is this a main.log of train_gpt2.py or llm.c?")
    return {key: sorted(points.items()) for key, points in streams.items()}


def extreme(points, best):
    """(step, value) of the lowest (best=min) or highest (best=max) finite value, or () if there is none."""
    return best(((step, value) for step, value in points if math.isfinite(value)), key=lambda p: p[1], default=())


def plot(runs, out_path, loss_max=None, references=()):
    """[(label, streams), ...] into out_path (png, svg, ... by extension); references (--eval_only runs) as lines."""
    from matplotlib.figure import Figure  # here: parse_log's callers need no matplotlib
    fig = Figure(figsize=(16, 6))
    fmt = os.path.splitext(out_path)[1].lstrip(".").lower()
    if fmt not in (supported := fig.canvas.get_supported_filetypes()):
        raise ValueError(f"{out_path}: unsupported image type '{fmt}'; use one of {', '.join(sorted(supported))}")
    loss_ax, hellaswag_ax = fig.subplots(1, 2, sharex=True)  # same steps side by side
    axes = {"trl": loss_ax, "tel": loss_ax, "eval": hellaswag_ax}
    styles = {"trl": dict(alpha=0.6, linewidth=1), "tel": dict(linestyle="--", marker="."), "eval": dict(marker=".")}
    for i, (label, streams) in enumerate(runs):
        for key, name, best in STREAMS:
            points = streams.get(key, [])  # a stream the log lacks plots nothing, as does a missing extreme
            point = extreme(points, best)  # in the legend and marked: text next to the curves would overlap them
            note = f" ({best.__name__} {point[1]:.4f} @ {point[0]})" if point else ""
            axes[key].plot(*zip(*points), color=f"C{i % 10}", label=f"{label} {name}{note}", **styles[key])
            axes[key].plot(*point, color=f"C{i % 10}", marker="v" if best is min else "^", ms=8, mec="black")
    for key, name in (("tel", "val loss"), ("eval", "HellaSwag")):  # each reference's s:0 value, else OpenAI's
        measured = [(streams[key][0][1], f"C{(len(runs) + i) % 10}", "-.", f"{label} {name} on these val tokens "
                     f"({streams[key][0][1]:.4f}, eval_only)") for i, (label, streams) in enumerate(references)
                    if streams.get(key)]
        for value, color, linestyle, label in measured or PUBLISHED[key]:
            axes[key].axhline(value, color=color, linestyle=linestyle, linewidth=1.5, label=label)
    loss_ax.set(yscale="log", ylim=(None, loss_max), xlabel="steps", ylabel="loss", title="Loss")  # None: automatic
    loss_ax.yaxis.set_major_formatter("{x:g}")  # plain numbers, not powers of ten, on the log axis
    loss_ax.yaxis.set_minor_formatter("{x:g}")
    hellaswag_ax.set(xlabel="steps", ylabel="accuracy (acc_norm)", title="HellaSwag eval")
    for ax in (loss_ax, hellaswag_ax):
        ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    atomic_save(out_path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=100, bbox_inches="tight"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="main.log files (llm.c format) or the out_dirs holding them")
    parser.add_argument("-o", "--output", default="curves.png", help="image to write (default curves.png)")
    parser.add_argument("--labels", nargs="+", default=None, help="legend name of each log (default: its folder)")
    parser.add_argument("--loss-max", type=float, default=None, help="top of the loss axis, e.g. 4.0 as in vislog")
    parser.add_argument("--reference", action="append", default=[], metavar="DIR", help="an --eval_only run's out_dir")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.logs):
        parser.error(f"--labels got {len(args.labels)} names for {len(args.logs)} logs")
    if args.loss_max is not None and not 0 < args.loss_max < math.inf:  # nan fails both comparisons
        parser.error(f"--loss-max must be a positive finite loss, got {args.loss_max}")
    folders = [os.path.basename(os.path.abspath(p if os.path.isdir(p) else os.path.dirname(p))) for p in args.logs]
    labels = args.labels or (folders if len(set(folders)) == len(folders) else args.logs)  # paths tell twins apart
    try:
        runs = [(label, parse_log(path)) for label, path in zip(labels, args.logs)]
        references = [(os.path.basename(os.path.abspath(path)), parse_log(path)) for path in args.reference]
        plot(runs, args.output, loss_max=args.loss_max, references=references)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"plot_log.py: error: {e}")
    except OSError as e:  # -o under a file, in a read-only directory, on a full disk
        sys.exit(f"plot_log.py: error: -o {args.output}: " + (f"{e.filename}: {e.strerror}" if e.filename else str(e)))
    for label, streams in runs + references:  # each curve's best point
        points = [(f"{best.__name__} {name}", extreme(streams.get(key, []), best)) for key, name, best in STREAMS]
        print(f"{label}: " + ", ".join(f"{what} {point[1]:.4f} (step {point[0]})" for what, point in points if point))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
