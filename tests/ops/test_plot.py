"""The job's plots: the panels drawn from a metrics.jsonl, and the writer that redraws them during
a run (every N steps, on its own thread, skipping a draw while one still runs, files replaced
whole)."""

from __future__ import annotations

import json
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest

from relax_hpc.cli.main import main as relax_main
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.ops.plot import PANELS, PlotWriter, plot_run, replace_atomically

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def is_complete_png(data: bytes) -> bool:
    return data.startswith(PNG_SIGNATURE) and data.endswith(b"IEND\xaeB`\x82")


def tiny_png() -> bytes:
    """A whole 1x1 PNG: signature, IHDR, IDAT, IEND."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x00")) + chunk(b"IEND", b""))


def step_record(step: int, with_kl: bool) -> dict[str, float]:
    # The names the loop logs (driver/loop.py: step_metrics), values a tiny run could have.
    row = {"step": step, "reward/mean": 0.01 * step, "samples/step": 256.0, "time/step_s": 0.08 + 0.001 * step,
           "train/loss/policy": (-1) ** step * 1e-9, "train/entropy": 3.8 - 0.01 * step,
           "rollout/response_len": 3.9 + 0.001 * step}
    if with_kl:
        row["train/loss/kl"] = 0.001 * step
    return row


def write_metrics(path: Path, steps: int, with_kl: bool = True) -> None:
    path.write_text("".join(json.dumps(step_record(s, with_kl)) + "\n" for s in range(1, steps + 1)))


def test_every_panel_is_drawn_from_the_runs_metrics(tmp_path: Path) -> None:
    write_metrics(tmp_path / "metrics.jsonl", 40)
    drawn = plot_run(tmp_path / "metrics.jsonl", tmp_path, "tiny")

    assert drawn.recorded == {"reward": True, "policy_loss": True, "kl": True, "entropy": True,
                              "response_length": True, "step_time": True, "samples_per_s": True}
    assert [p.name for p in PANELS] == list(drawn.recorded)
    # 11 x 12 inches at 110 dpi; the reward curve alone 7 x 4.
    assert png_size(drawn.panels_png) == (1210, 1320)
    assert png_size(drawn.reward_curve) == (770, 440)
    assert (drawn.panels_png.stat().st_mode & 0o777) == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_a_metric_the_run_did_not_record_is_a_panel_that_says_so(tmp_path: Path) -> None:
    write_metrics(tmp_path / "metrics.jsonl", 3, with_kl=False)  # no reference model: no KL
    drawn = plot_run(tmp_path / "metrics.jsonl", tmp_path, "tiny", mode=0o600)

    assert [name for name, recorded in drawn.recorded.items() if not recorded] == ["kl"]
    assert png_size(drawn.panels_png) == (1210, 1320)
    assert (drawn.panels_png.stat().st_mode & 0o777) == 0o600


def test_no_reward_yet_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no reward/mean records to plot yet"):
        plot_run(tmp_path / "metrics.jsonl", tmp_path)
    assert not (tmp_path / "plots.png").exists()


def test_a_record_still_being_written_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, 3)
    with path.open("a") as f:
        f.write(json.dumps(step_record(4, True))[:40])  # the sink's write of step 4, cut short

    assert [int(r["step"]) for r in read_metrics(path, partial_last_line_ok=True)] == [1, 2, 3]
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)  # after a run, a cut record is damage: it is not hidden
    plot_run(path, tmp_path)


def test_relax_hpc_plot_draws_both_files_and_names_what_was_not_recorded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_metrics(tmp_path / "metrics.jsonl", 5, with_kl=False)
    assert relax_main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'reward_curve.png'} and {tmp_path / 'plots.png'}" in out
    assert "(not recorded in this run: kl)" in out
    assert png_size(tmp_path / "plots.png") == (1210, 1320)

    assert relax_main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl does not exist: give the job directory of a run" in capsys.readouterr().err


def test_the_writer_draws_every_n_steps() -> None:
    draws: list[str] = []
    writer = PlotWriter(20, lambda: draws.append(threading.current_thread().name))
    for step in range(1, 46):  # a loop of 45 steps
        writer.on_step(step)
        writer.close()  # each draw done before the next step: none is skipped
    assert writer.started == [20, 40] and writer.skipped == []
    assert draws == ["plot-writer", "plot-writer"]  # on the writer's thread, not the loop's


def test_every_zero_never_draws() -> None:
    writer = PlotWriter(0, lambda: pytest.fail("drew"))
    assert not any(writer.on_step(step) for step in range(1, 101))


def test_a_draw_still_running_makes_the_next_due_one_skip_not_wait() -> None:
    release, drawing = threading.Event(), threading.Event()
    draws: list[int] = []

    def slow_draw() -> None:
        draws.append(len(draws))
        drawing.set()
        release.wait(30)

    writer = PlotWriter(2, slow_draw)
    assert writer.on_step(2)
    assert drawing.wait(30)
    # Both return while the first draw still waits for its release: had either waited for it,
    # the draw would have timed out and the step drawn.
    assert not writer.on_step(4)
    assert not writer.on_step(6)
    assert writer.busy
    release.set()
    writer.close()
    assert writer.started == [2] and writer.skipped == [4, 6] and draws == [0]
    assert writer.on_step(8)  # free again: the next due step draws
    writer.close()
    assert draws == [0, 1]


def test_a_failing_draw_is_counted_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise OSError("No space left on device")

    writer = PlotWriter(1, broken)
    for step in (1, 2, 3):
        writer.on_step(step)
        writer.close()
    assert writer.failures == 3
    assert sum("drawing the plots at step 1 failed" in r.getMessage() for r in caplog.records) == 1


def test_a_reader_sees_no_file_or_a_whole_png_never_part_of_one(tmp_path: Path) -> None:
    out = tmp_path / "plots.png"
    png = tiny_png()

    def slow_write(tmp: Path) -> None:  # a draw that takes its time writing, byte by byte
        with tmp.open("wb") as f:
            for byte in png:
                f.write(bytes([byte]))
                f.flush()
                time.sleep(0.002)

    writer = PlotWriter(1, lambda: replace_atomically(out, slow_write, mode=0o600))
    seen: list[bytes | None] = []
    for step in (1, 2):
        writer.on_step(step)
        while writer.busy:
            seen.append(out.read_bytes() if out.exists() else None)
        writer.close()
    assert len(seen) > 10, "the reader never looked while the draw was writing"
    assert None in seen  # before the first draw's rename
    assert all(data is None or data == png for data in seen)
    assert out.read_bytes() == png and (out.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots.png"]


def test_a_write_that_fails_keeps_the_previous_file(tmp_path: Path) -> None:
    out = tmp_path / "plots.png"
    out.write_bytes(tiny_png())

    def fail_halfway(tmp: Path) -> None:
        tmp.write_bytes(tiny_png()[:20])
        raise OSError("No space left on device")

    with pytest.raises(OSError):
        replace_atomically(out, fail_halfway)
    assert is_complete_png(out.read_bytes())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots.png"]
