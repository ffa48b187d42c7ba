"""The command line's names: help on every argument, one positional name per kind of thing,
`--version`, the renamed flags and their old names, `logs -n`, and Slurm-style `convert --time`."""

from __future__ import annotations

import argparse
from importlib.metadata import version
from pathlib import Path

import pytest

from relax_hpc.cli.main import POSITIONAL_NAMES, build_parser, main
from relax_hpc.cli import slurm_commands as commands
from relax_hpc.launch.slurm_client import FakeSlurmClient


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_argument_of_every_command_has_help() -> None:
    parser = build_parser()
    missing = [f"{name}: {'/'.join(a.option_strings) or a.dest}"
               for name, command in [("relax-hpc", parser), *_commands(parser).items()]
               for a in command._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not (a.help or "").strip()]
    assert missing == []


def test_positionals_of_one_kind_have_one_name_in_every_command() -> None:
    names = {(a.dest, a.metavar) for command in _commands(build_parser()).values() for a in command._actions
             if not a.option_strings and a.dest in POSITIONAL_NAMES}
    assert names == {(dest, metavar) for dest, metavar in POSITIONAL_NAMES.items()}
    usage = _commands(build_parser())["status"].format_usage()
    assert usage.rstrip().endswith(" JOB")


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"relax-hpc {version('relax-hpc')}\n"


@pytest.mark.parametrize("flag", ["--requeue", "--checkpoint"])
def test_cancel_requeue_and_its_old_name_signal_usr1(flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurmClient()
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    (tmp_path / "slurm_job_id").write_text("77\n")
    assert main(["cancel", str(tmp_path), flag]) == 0
    assert fake.actions == [("cancel", "77", "USR1", "batch")]
    assert "checkpoint and requeue" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--grow-job", "--job"])
def test_shrink_takes_the_grow_job_by_its_new_and_old_name(flag: str) -> None:
    args = build_parser().parse_args(["shrink", "1000", flag, "2000"])
    assert (args.job, args.grow_job, args.engines) == ("1000", "2000", None)


def test_logs_n_prints_the_last_n_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "slurm_job_id").write_text("5\n")
    log = tmp_path / "logs" / "restart-0" / "driver.log"
    log.parent.mkdir(parents=True)
    log.write_text("a\nb\nc\n")
    assert main(["logs", str(tmp_path), "-n", "2"]) == 0
    assert capsys.readouterr().out == f"==> {log} <==\nb\nc\n"
    assert main(["logs", str(tmp_path), "--lines", "0"]) == 0
    assert capsys.readouterr().out == f"==> {log} <==\n"
    assert main(["logs", str(tmp_path)]) == 0  # without -n: the whole log
    assert capsys.readouterr().out.endswith("a\nb\nc\n")
    assert main(["logs", str(tmp_path), "-n", "-1"]) == 2
    assert "-n -1: pass the number of last lines to print, >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "minutes"), [
    (["--time", "30"], 30), (["--time", "00:30:00"], 30), (["--time", "90:30"], 91),  # M:S rounds up
    (["--time", "1-00:00"], 24 * 60), (["--time-min", "45"], 45), ([], None),
])
def test_convert_time_takes_slurm_forms_and_the_old_minutes_flag(
        argv: list[str], minutes: int | None, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["convert", "job", "out", "--slurm", *argv])
    assert commands._time_minutes(args) == minutes
    assert ("--time-min is deprecated; pass --time 45" in capsys.readouterr().err) == ("--time-min" in argv)


def test_convert_time_refusals_say_what_to_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--slurm", "--time", "1h"]) == 2
    assert "--time 1h: not a Slurm time limit" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--time", "30"]) == 2
    assert "--time is the Slurm job's time limit: it goes with --slurm" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--time", "30", "--time-min", "30"]) == 2
    assert "pass only --time" in capsys.readouterr().err
