"""``oldgpu plot``: a PNG from real TensorBoard event files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_status import make_job, metrics_for, write_events

from oldgpu import cli, plot
from oldgpu.output import EngineError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    from matplotlib import image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 20_000  # six drawn panels, not an empty canvas
    pixels = image.imread(path)
    height, width = pixels.shape[:2]
    assert (width, height) == (plot.FIGSIZE[0] * plot.DPI, plot.FIGSIZE[1] * plot.DPI)
    assert pixels.std() > 0.01  # something is drawn


def run_plot(where, **kw):
    return plot.plot("gsm8k", jobs_dir=where["jobs_dir"], state_root=where["state_root"], **kw)


def test_plot_all_panels(tmp_path):
    where = make_job(tmp_path)
    write_events(where["tensorboard"], range(1, 6))
    doc = run_plot(where)
    out = where["state"] / "plot.png"
    assert doc["path"] == str(out) and doc["last_step"] == 5
    assert_png(out)
    for key in (
        "critic/score/mean",
        "actor/kl_loss",
        "actor/pg_loss",
        "critic/vf_loss",
        "perf/throughput",
        "timing_s/step",
    ):
        assert doc["series"][key] == 5
    assert doc["series"]["actor/reward_kl_penalty"] == 0
    panels = {p["title"]: p for p in doc["panels"]}
    assert not any(p["no_data"] for p in panels.values())
    assert panels["reward"]["keys"] == ["critic/score/mean"]  # the first present only
    assert panels["KL"]["keys"] == ["actor/kl_loss"]
    assert panels["losses"]["keys"] == ["actor/pg_loss", "critic/vf_loss", "actor/kl_loss"]
    assert not list(where["state"].glob(".*.tmp"))


def test_missing_series_say_no_data(tmp_path):
    def sparse(step):
        full = metrics_for(step, kl_keys=())
        return {k: full[k] for k in ("critic/rewards/mean", "timing_s/step")}

    where = make_job(tmp_path)
    write_events(where["tensorboard"], range(1, 4), metrics=sparse)
    out = tmp_path / "out.png"
    doc = run_plot(where, out=out)
    assert_png(out)
    panels = {p["title"]: p for p in doc["panels"]}
    assert panels["reward"]["keys"] == ["critic/rewards/mean"]
    assert panels["seconds per step"]["keys"] == ["timing_s/step"]
    for title in ("KL", "losses", "throughput", "response length"):
        assert panels[title] == {"title": title, "keys": [], "no_data": True}
    assert "  KL: no data" in plot._text(doc)


def test_no_event_files_is_an_error(tmp_path):
    where = make_job(tmp_path)
    with pytest.raises(EngineError) as err:
        run_plot(where)
    assert err.value.name == "job-no-metrics" and "no event files" in err.value.message
    from torch.utils.tensorboard import SummaryWriter

    SummaryWriter(str(where["tensorboard"])).close()  # opened, no step logged yet
    with pytest.raises(EngineError) as err:
        run_plot(where)
    assert err.value.name == "job-no-metrics" and "1 event files" in err.value.message
    assert not (where["state"] / "plot.png").exists()


def test_cli_tensorboard_dir_and_out(tmp_path, capsys):
    where = make_job(tmp_path)
    elsewhere = tmp_path / "copied-tb"
    write_events(elsewhere, range(1, 8))
    out = tmp_path / "curves.png"
    argv = ["plot", "gsm8k", "--json", "--tensorboard-dir", str(elsewhere), "--out", str(out)]
    argv += ["--jobs-dir", str(where["jobs_dir"]), "--state-dir", str(where["state_root"])]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == str(out) and doc["tensorboard_dir"] == str(elsewhere)
    assert doc["series"]["critic/score/mean"] == 7
    assert_png(out)


def test_cli_no_metrics_exit_status(tmp_path, capsys):
    where = make_job(tmp_path)
    argv = ["plot", "gsm8k", "--jobs-dir", str(where["jobs_dir"])]
    argv += ["--state-dir", str(where["state_root"])]
    assert cli.main(argv) == 2
    assert "job-no-metrics" in capsys.readouterr().err


def test_unwritable_out(tmp_path):
    where = make_job(tmp_path)
    write_events(where["tensorboard"], range(1, 3))
    with pytest.raises(EngineError) as err:
        run_plot(where, out=tmp_path / "no-such-dir" / "plot.png")
    assert err.value.name == "plot-write-failed"
