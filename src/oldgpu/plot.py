"""``oldgpu plot JOB``: a job's training curves as one PNG.

Panels over steps, from the job's TensorBoard event files (read as ``oldgpu
status`` reads them): reward, KL, losses, throughput, seconds per step and
response length. A series the job did not log leaves its panel saying "no
data"; a job with no metrics at all is an error (``job-no-metrics``).

matplotlib draws off-screen (Agg); like TensorBoard it is imported only here,
and ``REQUIRES`` makes the CLI use the training venv's python for it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldgpu import jobs, status, subcommand
from oldgpu.output import EngineError, Result

REQUIRES = ("tensorboard", "matplotlib")

DEFAULT_NAME = "plot.png"
FIGSIZE = (13.0, 10.0)  # inches
DPI = 100


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    first_only: bool  # plot the first key present (alternatives), else every one present
    ylabel: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("reward", status.REWARD_KEYS, True, "mean per sequence"),
    Panel("KL", status.KL_KEYS, True),
    Panel("losses", ("actor/pg_loss", "critic/vf_loss", "actor/kl_loss"), False),
    Panel("throughput", ("perf/throughput",), False, "tokens/s per GPU"),
    Panel("seconds per step", ("timing_s/step",), False, "s"),
    Panel("response length", ("response_length/mean",), False, "tokens"),
)


def chosen_keys(panel: Panel, scalars: Mapping[str, Sequence[status.Point]]) -> list[str]:
    present = [k for k in panel.keys if scalars.get(k)]
    return present[:1] if panel.first_only else present


def draw(scalars: Mapping[str, Sequence[status.Point]], out: Path, title: str) -> list[dict]:
    """Write the PNG to ``out``; what each panel shows."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2, sharex=True).flatten()
    shown: list[dict] = []
    for index, (ax, panel) in enumerate(zip(axes, PANELS, strict=True)):
        keys = chosen_keys(panel, scalars)
        ax.set_title(panel.title)
        if index >= len(axes) - 2:  # the bottom row; the others share its steps
            ax.set_xlabel("step")
        if panel.ylabel:
            ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for key in keys:
            points = scalars[key]
            ax.plot(
                [p.step for p in points],
                [p.value for p in points],
                marker="." if len(points) <= 60 else None,
                linewidth=1.2,
                label=key,
            )
        if keys:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(
                0.5,
                0.5,
                "no data",
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize="large",
                color="gray",
            )
            ax.set_yticks([])
        shown.append({"title": panel.title, "keys": keys, "no_data": not keys})
    fig.suptitle(title)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise EngineError(
            "plot-write-failed", f"cannot write {out}: {exc.strerror or exc} (pick --out FILE.png)"
        ) from None
    return shown


def plot(
    name: str,
    *,
    out: Path | None = None,
    tensorboard_dir: Path | None = None,
    jobs_dir: Path = jobs.JOBS_DIR,
    state_root: Path = jobs.STATE_DIR,
) -> dict[str, Any]:
    if not jobs.NAME_RE.match(name):
        raise EngineError("job-unknown", f"{name!r} is not a job name")
    try:
        job: jobs.Job | None = jobs.load_job(name, jobs_dir)
    except EngineError:
        job = None  # the curves need only the event files
    paths = status.job_paths(name, job, state_root)
    tb_dir = tensorboard_dir or paths["tensorboard"]
    out = out or paths["state"] / DEFAULT_NAME
    try:
        files = status.event_files(tb_dir)
        scalars = status.read_scalars(tb_dir) if files else {}
    except OSError as exc:
        raise EngineError("job-no-metrics", f"job {name}: {exc}") from None
    if not any(scalars.values()):
        where = f"{len(files)} event files" if files else "no event files"
        raise EngineError(
            "job-no-metrics",
            f"job {name}: {where} with metrics under {tb_dir} (verl writes them after "
            "each step; has the job finished one?)",
        )
    summary = status.summarize(scalars, job.total_steps if job else None)
    total = job.total_steps if job else "?"
    title = f"verl job {name}: step {summary['last_step']}/{total}"
    panels = draw(scalars, out, title)
    series = {key: len(scalars.get(key, ())) for panel in PANELS for key in panel.keys}
    return {
        "job": name,
        "path": str(out),
        "tensorboard_dir": str(tb_dir),
        "last_step": summary["last_step"],
        "series": series,
        "panels": panels,
    }


def _text(doc: Mapping[str, Any]) -> str:
    lines = [f"wrote {doc['path']} (job {doc['job']}, last step {doc['last_step']})"]
    for panel in doc["panels"]:
        what = ", ".join(f"{k} {doc['series'][k]} points" for k in panel["keys"]) or "no data"
        lines.append(f"  {panel['title']}: {what}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Result:
    doc = plot(
        args.job,
        out=Path(args.out) if args.out else None,
        tensorboard_dir=Path(args.tensorboard_dir) if args.tensorboard_dir else None,
        jobs_dir=Path(args.jobs_dir),
        state_root=Path(args.state_dir),
    )
    return Result(doc, _text(doc))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "a job's reward, KL, losses and throughput over steps, as a PNG"
    parser = subcommand.add(subparsers, common, "plot", run, __doc__, help=summary)
    parser.add_argument("job", metavar="JOB", help="the job's name")
    parser.add_argument(
        "--out", metavar="FILE.png", help=f"where to write it (default <state>/{DEFAULT_NAME})"
    )
    parser.add_argument(
        "--tensorboard-dir",
        metavar="DIR",
        help="read the event files here (default <state>/tensorboard)",
    )
    jobs.add_dir_args(parser, "jobs", "state")
