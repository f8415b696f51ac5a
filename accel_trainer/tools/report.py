"""`accel-trainer report RUN_DIR [RUN_DIR ...] --out FILE.png`: the curves of one or more runs in one picture.

Reads each run's `metrics.jsonl` and draws, one panel per quantity, every numeric field it finds: the loss (with
eval_loss dashed on the same axes), each eval metric, the learning rate, the gradient norm, and -- when the run
logged them -- throughput, step time, data wait, peak memory, MFU, fp16 loss scale and skipped steps. A field no
run logged gets no panel. Each panel is drawn against optimizer updates (`step`) and against wall time
(`elapsed_s`, summed over restarts when a resumed run started its clock again), side by side; `--x step|time`
keeps one view and `--cols N` puts N panels in a row.
Runs are overlaid, one colour each, labelled by their folder name or `--labels`:

    accel-trainer report runs/reg_1proc runs/reg_2proc --out report.png
    accel-trainer report runs/a runs/b --labels "1 process" "2 processes" --x time --cols 3 --out time.png

matplotlib (the [report] extra: `pip install 'accel-trainer[report]'`) is imported only here, with the Agg backend
(no display needed).
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import safe_read
from ..errors import UserError, need

# Bookkeeping, not curves: the axes themselves, and eval_samples (the size of the eval split, a constant).
NOT_PLOTTED = {"step", "epoch", "elapsed_s", "eval_samples"}
# Panel order for the fields we know; any other numeric field follows, sorted. eval_loss shares the loss panel.
ORDER = [
    "loss",
    "learning_rate",
    "grad_norm",
    "samples_per_second",
    "items_per_second",
    "step_time_s",
    "data_wait_fraction",
    "peak_memory_mb",
    "mfu",
    "loss_scale",
    "skipped_steps",
]
SHARED_PANEL = {"eval_loss": "loss"}
X_VIEWS = {"step": ("step", "optimizer updates"), "time": ("elapsed_s", "wall time (s)")}
MAX_PANELS = 48  # a figure of thousands of panels took gigabytes; a run logs tens of fields


def _plain(text: str) -> str:
    """A field name or label as text on the figure: never matplotlib's math ('$\\frac{$' raised deep in the
    renderer), a lone surrogate (not encodable: the writer raised) as its escape."""
    return text.encode("utf-8", "backslashreplace").decode().replace("$", r"\$")


class ReportError(UserError):
    pass


def _number(value) -> float | None:
    """A plottable float, or None. metrics.jsonl writes non-finite floats as the strings 'nan', 'inf', '-inf'."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl. Bad input raises ReportError with one line naming the problem and fix.
    A cut-off last line (a run killed while writing) is left out with a warning; a broken line elsewhere is an
    error."""
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir}: no such folder. Pass the output_dir of a run (it holds metrics.jsonl).")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ReportError(f"{path} does not exist: {run_dir} is not a run's output_dir, or the run has not logged yet.")
    try:
        text = safe_read.read_text(path, max_bytes=4 << 30)
    except (OSError, ValueError) as e:
        raise ReportError(f"{path} cannot be read ({e}): it is not a run's metrics file.") from None
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for i, line in lines:
        try:
            row = safe_read.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not an object with a 'step'")
        except ValueError as e:
            if i == lines[-1][0]:
                print(f"warning: {path}:{i}: cut-off last line left out ({e})", file=sys.stderr)
                continue
            raise ReportError(f"{path}:{i} is not a metrics row ({e}); the file is damaged.") from None
        rows.append(row)
    if not rows:
        raise ReportError(
            f"{path} is empty: the run has not logged yet (it logs every --logging_steps updates and at each eval)."
        )
    return rows


def _cumulative_time(rows: list[dict]) -> list[float | None]:
    """elapsed_s per row, made monotone: a resumed run starts its clock at 0 again; add the time before it."""
    out, offset, last = [], 0.0, None
    for row in rows:
        t = _number(row.get("elapsed_s"))
        if t is None:
            out.append(None)
            continue
        if last is not None and t < last:
            offset += last
        last = t
        out.append(offset + t)
    return out


def series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """The (x, y) points of `key` in these rows, in file order: rows without the key (or with a non-numeric
    value) are left out. x is 'step' or 'time' (elapsed_s, monotone over restarts). This is what gets drawn."""
    xs_all = [_number(r.get("step")) for r in rows] if x == "step" else _cumulative_time(rows)
    xs, ys = [], []
    for row, xv in zip(rows, xs_all):
        y = _number(row.get(key))
        if y is not None and xv is not None:
            xs.append(xv)
            ys.append(y)
    return xs, ys


def panels(runs: list[tuple[str, list[dict]]]) -> list[tuple[str, list[str]]]:
    """[(panel title, [keys drawn on it])] for every numeric field any run logged, in a stable order."""
    keys = set()
    for _, rows in runs:
        for row in rows:
            keys.update(k for k, v in row.items() if k not in NOT_PLOTTED and _number(v) is not None)
    evals = sorted(k for k in keys if k.startswith("eval_") and k not in SHARED_PANEL)
    ordered = (
        [k for k in ORDER[:1] if k in keys or "eval_loss" in keys]
        + evals
        + [k for k in ORDER[1:] if k in keys]
        + sorted(keys - set(ORDER) - set(evals) - set(SHARED_PANEL))
    )
    if len(ordered) > MAX_PANELS:
        print(
            f"warning: {len(ordered)} numeric fields in metrics.jsonl; drawing the first {MAX_PANELS} "
            f"({len(ordered) - MAX_PANELS} left out, from {ordered[MAX_PANELS]!a}).",
            file=sys.stderr,
        )
        ordered = ordered[:MAX_PANELS]
    out = []
    for title in ordered:
        members = [title] + [k for k, panel in SHARED_PANEL.items() if panel == title]
        out.append((title, [k for k in members if k in keys]))
    return out


def _labels(run_dirs: list[str], labels: list[str] | None) -> list[str]:
    if labels:
        if len(labels) != len(run_dirs):
            raise ReportError(
                f"--labels gives {len(labels)} label(s) for {len(run_dirs)} run folder(s); give one each."
            )
        return labels
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(set(names)) < len(names):  # two folders with the same name: the paths tell them apart
        return [os.path.normpath(d) for d in run_dirs]
    return names


def _check_out(out: str, fig) -> None:
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    supported = fig.canvas.get_supported_filetypes()
    if ext not in supported:
        raise ReportError(f"--out {out}: unknown picture type {ext!r}; end the name in .png, .pdf or .svg.")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ReportError(f"--out {out}: folder {folder} does not exist; create it or write elsewhere.")
    if os.path.isdir(out):
        raise ReportError(f"--out {out} is a folder; give a file name such as {os.path.join(out, 'report.png')}.")
    if not os.access(folder, os.W_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        raise ReportError(f"--out {out}: not writable here; choose another path.")


def plot_runs(
    run_dirs: list[str],
    out: str,
    labels: list[str] | None = None,
    x: str = "both",
    dpi: int = 100,
    cols: int | None = None,
) -> dict[tuple[str, str, str, str], tuple[list[float], list[float]]]:
    """Draw the runs into `out`. Returns what was drawn, read back from the figure's lines:
    {(panel, key, x view, run label): (xs, ys)}.

    Cells fill a grid row by row: with both views, each panel's step and time views side by side (cols 2);
    with one view, `cols` panels per row (default 2)."""
    matplotlib = need("matplotlib", "report", "accel-trainer report")  # the [report] extra; before any work
    if x not in ("both", *X_VIEWS):
        raise ReportError(f"--x {x!r}: use step, time or both.")
    views = list(X_VIEWS) if x == "both" else [x]
    cols = cols or 2
    if cols < 1 or (x == "both" and cols % 2):
        raise ReportError(f"--cols {cols}: give an even number >= 2 with --x both, or >= 1 with one view.")
    labels = _labels(run_dirs, labels)
    runs = [(label, read_metrics(d)) for label, d in zip(labels, run_dirs)]
    layout = panels(runs)
    if not layout:
        raise ReportError(f"{', '.join(run_dirs)}: metrics.jsonl holds no numeric fields to draw.")

    matplotlib.use("Agg")  # files only; works without a display and does not disturb an interactive session
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cells = [(title, keys, view) for title, keys in layout for view in views]
    nrows = -(-len(cells) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * min(cols, 2) + 4.2 * max(0, cols - 2), 2.3 * nrows + 0.6))
    axes = [axes] if cols * nrows == 1 else list(getattr(axes, "flat", axes))
    try:
        _check_out(out, fig)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        drawn = {}
        for n, (title, keys, view) in enumerate(cells):
            drawn.update(_draw_cell(axes[n], title, keys, view, runs, colors))
            if n + cols >= len(cells):  # nothing below this cell: label its x axis
                axes[n].set_xlabel(X_VIEWS[view][1], fontsize=8)
            if len(keys) > 1 and n == 0:  # say which line style is which key
                styles = [Line2D([], [], color="gray", linestyle="--" if k.startswith("eval_") else "-") for k in keys]
                axes[n].legend(styles, [_plain(k) for k in keys], fontsize=7, loc="upper right")
        for ax in axes[len(cells) :]:
            ax.set_visible(False)
        handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2) for i in range(len(runs))]
        fig.legend(
            handles, [_plain(label) for label, _ in runs], loc="upper center", ncol=min(len(runs), 4), fontsize=9
        )
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
        try:
            fig.savefig(out, dpi=dpi)
        except OSError as e:
            raise ReportError(f"--out {out}: cannot write it ({e.strerror or e}); choose another path.") from None
        return drawn
    finally:
        plt.close(fig)


def _draw_cell(ax, title: str, keys: list[str], view: str, runs, colors) -> dict:
    """One panel's `keys` in one x view, a line per run and key; returns what was drawn (as plot_runs)."""
    drawn = {}
    for i, (label, rows) in enumerate(runs):
        for key in keys:
            xs, ys = series(rows, key, view)
            if not xs:
                continue
            is_eval = key.startswith("eval_")
            (line,) = ax.plot(
                xs,
                ys,
                color=colors[i % len(colors)],
                linestyle="--" if is_eval and len(keys) > 1 else "-",
                marker="o" if is_eval or len(xs) == 1 else None,
                markersize=3,
                # earlier runs drawn wider: runs that agree (1 vs 2 processes) stay visible
                linewidth=1.2 + (len(runs) - 1 - i) / max(1, len(runs) - 1),
            )
            drawn[(title, key, view, label)] = (list(line.get_xdata()), list(line.get_ydata()))
    ax.set_title(_plain(title if len(keys) == 1 else " / ".join(keys)), fontsize=9, loc="left")
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    return drawn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output_dir of a run (holds metrics.jsonl)")
    p.add_argument("--out", required=True, help="picture to write: .png, .pdf or .svg")
    p.add_argument("--labels", nargs="+", default=None, help="legend label per RUN_DIR (default: folder names)")
    p.add_argument("--x", choices=["both", "step", "time"], default="both", help="x axes (default: both)")
    p.add_argument(
        "--cols", type=int, default=None, help="panels per row (default 2; with --x both, 2 = one panel a row)"
    )
    p.add_argument("--dpi", type=int, default=100, help="resolution of a .png (default: 100)")


def run(a) -> int:
    try:
        drawn = plot_runs(a.run_dirs, a.out, labels=a.labels, x=a.x, dpi=a.dpi, cols=a.cols)
    except UserError as e:  # ReportError, or matplotlib missing (the [report] extra)
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_panels = len({k[0] for k in drawn})
    print(f"wrote {a.out}: {n_panels} panels, {len(a.run_dirs)} run(s)")
    return 0


def add_parser(sub):
    """Register `accel-trainer report` on the console script's subparsers."""
    p = sub.add_parser(
        "report",
        help="draw the curves of runs (metrics.jsonl) into a picture",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="accel-trainer report", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
