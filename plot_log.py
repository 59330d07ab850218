"""Plot llm.c-format main.log files (loss, HellaSwag) against GPT-2 and GPT-3, as llm.c's vislog."""
import argparse
import math
import os
import re
import sys

from atomic_io import atomic_save

# OpenAI's published figures (value, color, linestyle, label), drawn where no --reference run is.
PUBLISHED = {"tel": [(3.2924, "r", "--", "OpenAI GPT-2 124M, build-nanogpt's val shard (3.2924)"),
                     (3.424958, "m", ":", "OpenAI GPT-2 124M, llm.c's FineWeb val (3.424958)")],
             "eval": [(0.2945, "r", "--", "OpenAI GPT-2 124M checkpoint (0.2945, llm.c's vislog)"),
                      (0.337, "g", "--", "OpenAI GPT-3 125M checkpoint (0.337, GPT-3 paper)")]}
# (key in the log, name, which value is best)
STREAMS = [("trl", "train loss", min), ("tel", "val loss", min), ("eval", "HellaSwag", max)]


def parse_log(path):
    """{key: [(step, value), ...] sorted by step}; a step logged twice keeps its later value."""
    if os.path.isdir(path):  # an out_dir: its main.log, or an --eval_only run's eval/main.log
        path = os.path.join(path, "main.log")
        if not os.path.isfile(path):
            path = os.path.join(os.path.dirname(path), "eval", "main.log")
    streams, bad_lines = {}, []
    with open(path, encoding="utf-8", errors="replace") as f:
        # Whatever follows the last newline is dropped: a line a killed run left half written.
        lines = f.read().split("\n")[:-1]
    for line_number, line in enumerate(lines, start=1):
        m = re.match(r"s:(\d+)\s+(\w+):(\S+)", line)  # the step, then its first key:value
        try:
            value = float(m[3])
        except (TypeError, ValueError):  # no match, or not a number
            if line.strip():
                bad_lines.append(line_number)
            continue
        streams.setdefault(m[2], {})[int(m[1])] = value
    if bad_lines:
        print(f"plot_log.py: warning: {path}: skipped {len(bad_lines)} line(s) that are not "
              f"'s:STEP key:value' (first: line {bad_lines[0]})", file=sys.stderr)
    if not any(streams.get(key) for key, _, _ in STREAMS):
        raise ValueError(f"{path}: no 's:STEP trl:/tel:/eval:' lines; is it a train_gpt2.py log?")
    return {key: sorted(points.items()) for key, points in streams.items()}


def extreme(points, best):
    """(step, value) of the lowest (best=min) or highest (best=max) finite value, or None."""
    finite = [point for point in points if math.isfinite(point[1])]
    return best(finite, key=lambda point: point[1], default=None)


def plot(runs, out_path, loss_max=None, references=()):
    """Draw [(label, streams), ...] into out_path (png, svg, ...), references as horizontal lines.
    A HellaSwag panel only when a log has HellaSwag results: alone, baselines look like a result."""
    from matplotlib.figure import Figure  # here, so that parse_log's callers need no matplotlib
    with_hellaswag = any(streams.get("eval") for _, streams in [*runs, *references])
    fig = Figure(figsize=(8 + 8 * with_hellaswag, 6))
    fmt = os.path.splitext(out_path)[1].lstrip(".").lower()
    if fmt not in fig.canvas.get_supported_filetypes():
        raise ValueError(f"{out_path}: unsupported image type '{fmt}'; use .png, .svg or .pdf")
    loss_ax = fig.add_subplot(1, 1 + with_hellaswag, 1)
    axes = {"trl": loss_ax, "tel": loss_ax}
    if with_hellaswag:
        axes["eval"] = fig.add_subplot(1, 2, 2, sharex=loss_ax)
        axes["eval"].set(xlabel="steps", ylabel="accuracy (acc_norm)", title="HellaSwag eval")
    styles = {"trl": dict(alpha=0.6), "tel": dict(ls="--", marker="."), "eval": dict(marker=".")}
    for i, (label, streams) in enumerate(runs):
        for key, name, best in STREAMS:
            if key not in axes or not streams.get(key):
                continue
            # The best point is marked and put in the legend: text by the curves would overlap them.
            point, color, legend = extreme(streams[key], best), f"C{i}", f"{label} {name}"
            if point:
                axes[key].plot(*point, color=color, marker="*", ms=12, mec="black")
                legend += f" ({best.__name__} {point[1]:.4f} @ {point[0]})"
            axes[key].plot(*zip(*streams[key]), color=color, label=legend, **styles[key])
    baselines = {}  # what each reference measured at step 0 replaces OpenAI's published figures
    for i, (label, streams) in enumerate(references):
        for key, name, _ in STREAMS[1:]:
            if streams.get(key):
                value = streams[key][0][1]
                legend = f"{label} {name} on these val tokens ({value:.4f}, eval_only)"
                baselines.setdefault(key, []).append((value, f"C{len(runs) + i}", "-.", legend))
    for key in PUBLISHED.keys() & axes.keys():
        for value, color, linestyle, label in baselines.get(key) or PUBLISHED[key]:
            axes[key].axhline(value, color=color, linestyle=linestyle, linewidth=1.5, label=label)
    loss_ax.set(yscale="log", ylim=(None, loss_max), xlabel="steps", ylabel="loss", title="Loss")
    loss_ax.yaxis.set_major_formatter("{x:g}")  # plain numbers, not powers of ten
    loss_ax.yaxis.set_minor_formatter("{x:g}")
    for ax in fig.axes:
        ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    atomic_save(out_path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=100, bbox_inches="tight"))
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="main.log files (llm.c format) or their out_dirs")
    parser.add_argument("-o", "--output", default="curves.png", help="the image to write")
    parser.add_argument("--labels", nargs="+", help="legend name of each log (default: its folder)")
    parser.add_argument("--loss-max", type=float, help="top of the loss axis, e.g. 4.0")
    parser.add_argument("--reference", action="append", default=[], help="an --eval_only out_dir")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.logs):
        parser.error(f"--labels got {len(args.labels)} names for {len(args.logs)} logs")
    if args.loss_max is not None and not 0 < args.loss_max < math.inf:  # nan fails both comparisons
        parser.error(f"--loss-max must be a positive finite loss, got {args.loss_max}")
    folders = [os.path.basename(os.path.abspath(p if os.path.isdir(p) else os.path.dirname(p)))
               for p in args.logs]
    if len(set(folders)) < len(folders):  # two runs in folders of one name are told by their path
        folders = args.logs
    labels = args.labels or folders
    try:
        runs = [(label, parse_log(path)) for label, path in zip(labels, args.logs)]
        references = [(os.path.basename(os.path.abspath(p)), parse_log(p)) for p in args.reference]
        plot(runs, args.output, loss_max=args.loss_max, references=references)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"plot_log.py: error: {e}")
    except OSError as e:  # -o under a file, in a read-only directory, on a full disk
        sys.exit(f"plot_log.py: error: -o {args.output}: {e}")
    for label, streams in runs + references:
        bests = []
        for key, name, best in STREAMS:
            point = extreme(streams.get(key, []), best)
            if point:
                bests.append(f"{best.__name__} {name} {point[1]:.4f} (step {point[0]})")
        print(f"{label}: " + ", ".join(bests))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
