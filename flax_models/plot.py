"""Draw the training command's metrics files: ``python -m flax_models.plot metrics.jsonl
[metrics-plain.jsonl ...] -o loss.png``.

Two panels, one line per file (labelled by its run's implementation): the training loss
per step with the held-out loss as markers, and the throughput (tokens/s or images/s)
per step, leaving out each run's first step (it includes compilation). Needs matplotlib.
"""
from __future__ import annotations

import argparse

from flax_models import metrics


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flax_models.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="metrics files (JSONL) written by "
                                            "python -m flax_models.train --metrics")
    p.add_argument("-o", "--output", default="loss.png",
                   help="image to write; its suffix picks the format (default: loss.png)")
    return p


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError as e:
        raise SystemExit("plot: matplotlib is not installed (pip install matplotlib); the "
                         "metrics files are JSON lines and readable without it") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    return plt


def draw(all_series: list[dict], output: str) -> None:
    """Write the two-panel figure of ``all_series`` (from `metrics.series`) to ``output``."""
    plt = _pyplot()
    fig, (ax_loss, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    for s in all_series:
        line, = ax_loss.plot(s["step"], s["loss"], label=f"{s['label']} train")
        if s["eval_step"]:
            ax_loss.plot(s["eval_step"], s["eval_loss"], "o", color=line.get_color(),
                         label=f"{s['label']} held-out")
        ax_rate.plot(s["rate_step"], s["rate"], color=line.get_color(), label=s["label"])
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    unit = all_series[0]["unit"]
    ax_rate.set(xlabel="step", ylabel=f"{unit}/s", title=f"throughput ({unit}/s)")
    for ax in (ax_loss, ax_rate):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv=None) -> str:
    args = build_parser().parse_args(argv)
    all_series = [metrics.series(metrics.read(f)) for f in args.files]
    for f, s in zip(args.files, all_series):
        if not s["step"]:
            raise SystemExit(f"plot: {f} holds no step records")
    draw(all_series, args.output)
    print(f"wrote {args.output}")
    return args.output


if __name__ == "__main__":
    main()
