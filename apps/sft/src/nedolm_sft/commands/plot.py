"""``nedolm-sft plot``: loss, validation loss, learning-rate and throughput curves as one PNG."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from nedolm.train.metrics import METRICS_FILE, MetricsError, read_metrics, split_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_run(run_dir: Path, out: Path) -> Path:
    """Draw the run's curves into ``out`` (written atomically) and return it."""
    import matplotlib.pyplot as plt

    fig = draw_curves(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out


def draw_curves(run_dir: Path) -> Figure:
    """The run's curves as a figure titled by the run directory's name (an absolute path
    would leak the user's file system into a picture meant to be shared)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise click.ClickException(
            f"{metrics} not found: is {run_dir} a run directory that has logged a step?"
        )
    try:
        train, validation = split_metrics(read_metrics(run_dir))
    except MetricsError as exc:
        raise click.ClickException(str(exc)) from exc
    if not train and not validation:
        raise click.ClickException(f"{metrics} holds no training or validation records yet")

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    loss_ax, lr_ax, speed_ax = axes
    if train:
        loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if validation:
        loss_ax.plot(
            [r["step"] for r in validation],
            [r["val_loss"] for r in validation],
            marker="o",
            label="validation loss",
        )
    for source, points in _by_source(validation).items():
        steps, losses = zip(*points, strict=True)
        loss_ax.plot(steps, losses, marker=".", linestyle="--", label=f"validation: {source}")
    loss_ax.set(title="assistant-token loss", xlabel="step", ylabel="nats / target")
    loss_ax.legend()
    lr_ax.plot([r["step"] for r in train], [r.get("lr", 0.0) for r in train], color="tab:green")
    lr_ax.set(title="learning rate", xlabel="step")
    speed_ax.plot(
        [r["step"] for r in train], [r.get("tokens_per_s", 0.0) for r in train], color="tab:red"
    )
    speed_ax.set(title="throughput", xlabel="step", ylabel="context tokens / s")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"NedoLM SFT — {run_dir.resolve().name}")
    fig.tight_layout()
    return fig


def _by_source(validation: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, loss) per validation source of the records that carry ``val_loss_by_source``."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for record in validation:
        for source, loss in record.get("val_loss_by_source", {}).items():
            curves.setdefault(source, []).append((record["step"], loss))
    return dict(sorted(curves.items()))


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG to write (default: RUN_DIR/curves.png).",
)
def plot(run_dir: Path, out: Path | None) -> None:
    """Plot loss, validation loss, learning rate and throughput of a run as a PNG.

    \b
    Example:
      nedolm-sft plot runs/sft-demo            # writes runs/sft-demo/curves.png
    """
    if not run_dir.is_dir():
        raise click.ClickException(f"run directory {run_dir} does not exist")
    path = plot_run(run_dir, out or run_dir / "curves.png")
    click.echo(f"wrote {path}")
