"""The renderer's own defence: every value it writes into the script is quoted or refused.

The spec checks already refuse hostile strings (tests/spec/test_spec_hostile.py), so these
tests build JobSpecs that skip validation (dataclasses.replace) to reach the renderer with
text no loaded spec can carry, and check ordinary but awkward text (spaces, quotes, "#", "$"
in the job directory) comes out quoted for both readers of the script: sbatch, which parses
the #SBATCH comment lines itself, and bash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.launch.render import render_sbatch, sbatch_headers
from relax_hpc.spec import JobSpec, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobspecs" / "tiny_slurm.toml"


def sbatch_arguments(line: str) -> list[str]:
    """The arguments sbatch takes from one #SBATCH line.

    A port of get_argument() in Slurm's src/sbatch/opt.c: ASCII whitespace separates words,
    single or double quotes group, a backslash escapes the next character (inside quotes too),
    an unquoted "#" ends the line; an empty word ends the line as well.
    """
    assert line.startswith("#SBATCH")
    rest, i = line[len("#SBATCH"):], 0
    words: list[str] = []
    while True:
        while i < len(rest) and rest[i] in " \t\v\f\r":
            i += 1
        word: list[str] = []
        quote, escape = "", False
        while i < len(rest) and (quote or rest[i] not in " \t\v\f\r") and rest[i] != "\n":
            char = rest[i]
            i += 1
            if escape:
                escape = False
            elif char == "\\":
                escape = True
                continue
            elif quote:
                if char == quote:
                    quote = ""
                    continue
            elif char in "\"'":
                quote = char
                continue
            elif char == "#":
                i = len(rest)
                break
            word.append(char)
        assert not quote, f"sbatch: unmatched quote in {line!r}"
        if not word:
            return words
        words.append("".join(word))


def test_the_sbatch_parser_port_reads_plain_and_quoted_words() -> None:
    assert sbatch_arguments("#SBATCH --nodes=1  # one node") == ["--nodes=1"]
    assert sbatch_arguments('#SBATCH "--output=/a b/c \\" d"') == ['--output=/a b/c " d']


# Enough configuration for the sbatch client to parse a script; no controller listens there.
_FAKE_SLURM_CONF = """\
ClusterName=parse-only
SlurmctldHost=localhost
SlurmctldPort=1
AuthType=auth/none
GresTypes=gpu
NodeName=n1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1 Default=YES State=UP
"""


def real_sbatch_arguments(script: str, tmp_path: Path) -> list[str]:
    """The arguments the installed sbatch client finds in ``script`` (its -vvv debug lines).

    sbatch parses the #SBATCH lines before it contacts a controller; it is stopped as soon as
    it tries to, so no Slurm daemon is needed.
    """
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        if os.environ.get("RELAX_TEST_SLURM") == "1":  # the test command installs it (tools/run-tests)
            pytest.fail("no sbatch client installed: run tools/dev-slurm install (Debian package slurm-client)")
        pytest.skip("no sbatch client installed")
    conf, path = tmp_path / "slurm.conf", tmp_path / "job.sbatch"
    conf.write_text(_FAKE_SLURM_CONF)
    path.write_text(script)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    process = subprocess.Popen(["timeout", "30", sbatch, "-vvv", "--test-only", str(path)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:
            argument = re.search(r'Found in script, argument "(.*)"$', line.rstrip("\n"))
            if argument is not None:
                found.append(argument.group(1))
            elif "connect" in line:
                break
    finally:
        process.kill()
        process.wait()
    if not found:
        pytest.skip("the installed sbatch does not parse scripts without a cluster configuration")
    return found


def _with_dir(spec: JobSpec, output_dir: str) -> JobSpec:
    return dataclasses.replace(spec, job=dataclasses.replace(spec.job, output_dir=output_dir))


def slurm_expand(pattern: str, job_id: int) -> str:
    """The file name Slurm makes of an --output ``pattern`` (the symbols relax-hpc can meet).

    A port of expand_stdio_fields() in Slurm's src/common/print_fields.c: a backslash anywhere
    turns replacement off and every backslash is dropped; "%%" is one "%", "%j" the job id, and
    (like Slurm) any other "%x" is left as it is.
    """
    if "\\" in pattern:
        return pattern.replace("\\", "")
    return re.sub(r"%(.)", lambda m: {"%": "%", "j": str(job_id)}.get(m.group(1), m.group(0)), pattern)


# Valid: no control characters. Spaces, quotes, "#", "%", "$(...)" and backticks in a path.
AWKWARD_DIR = "/scratch/My Runs/it's \"#1\" 100%j $(touch pwned) `id` 5%%"


def test_an_awkward_job_dir_is_quoted_for_sbatch_and_for_bash(tmp_path: Path) -> None:
    spec = parse_spec(TINY.read_text().replace('name = "tiny_slurm"',
                                                f'name = "tiny_slurm"\noutput_dir = {json.dumps(AWKWARD_DIR)}'))
    job_dir = str(spec.job_dir())
    text = render_sbatch(spec, job_dir, f"{job_dir}/spec.submit.toml")
    (output,) = [line for line in text.splitlines() if line.startswith("#SBATCH") and "--output" in line]
    (argument,) = sbatch_arguments(output)
    assert argument == "--output=" + job_dir.replace("%", "%%") + "/logs/slurm-%j.out"
    # Slurm's pattern replacement gives back the directory as written, and only %j is replaced.
    assert slurm_expand(argument.removeprefix("--output="), 42) == f"{job_dir}/logs/slurm-42.out"
    # Every #SBATCH line is exactly one option (nothing leaks into a second word).
    assert all(len(sbatch_arguments(line)) == 1 for line in text.splitlines() if line.startswith("#SBATCH "))
    # bash reads JOB_DIR and SPEC back verbatim and runs nothing while doing so.
    assignments = "\n".join(line for line in text.splitlines() if line.startswith(("JOB_DIR=", "SPEC=")))
    shown = subprocess.run(["bash", "-c", assignments + '\nprintf "%s\\n%s" "$JOB_DIR" "$SPEC"'], cwd=tmp_path,
                           capture_output=True, text=True, check=True)
    assert shown.stdout == f"{job_dir}\n{job_dir}/spec.submit.toml"
    assert list(tmp_path.iterdir()) == []  # $(touch pwned) did not run
    (tmp_path / "sbatch").mkdir()
    assert subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, check=False).returncode == 0
    # The installed sbatch client, when there is one, reads the lines as the port does.
    ours = [word for line in text.splitlines() if line.startswith("#SBATCH") for word in sbatch_arguments(line)]
    assert real_sbatch_arguments(text, tmp_path / "sbatch") == [word for word in ours if word != "hetjob"]


def test_the_slurm_pattern_port_reads_percent_and_backslash() -> None:
    assert slurm_expand("/a/%%j-%j-%u.out", 7) == "/a/%j-7-%u.out"
    assert slurm_expand("/a\\b/%j.out", 7) == "/ab/%j.out"  # the reason a backslash is refused


def test_a_backslash_in_the_job_dir_is_refused_with_the_key_to_change() -> None:
    spec = load_spec(TINY)
    with pytest.raises(ValueError, match=r"contains a backslash.*\[job\] output_dir"):
        render_sbatch(spec, "/scratch/a\\b", "/scratch/a\\b/spec.submit.toml")


def test_plain_values_stay_unquoted() -> None:
    # The golden files pin this too; quoting only what needs it keeps them unchanged.
    lines = sbatch_headers(load_spec(TINY), "/shared/runs/tiny_slurm")
    assert "#SBATCH --output=/shared/runs/tiny_slurm/logs/slurm-%j.out" in lines
    assert not any('"' in line for line in lines)


def _component_with(spec: JobSpec, **changes: Any) -> JobSpec:
    trainer = dataclasses.replace(spec.cluster.trainer, **changes)
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, trainer=trainer))


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"partition": "gpu\ntouch /tmp/x"}, "#SBATCH --partition"),
        ({"account": "a\rb"}, "#SBATCH --account"),
        ({"time": "01:00:00\n"}, "#SBATCH --time"),
        ({"extra_sbatch": ["--exclusive\ntouch /tmp/x"]}, "cluster.trainer.extra_sbatch"),
        ({"cpus_per_node": "2\ntouch /tmp/x"}, "#SBATCH --cpus-per-task"),  # not even a str field
    ],
)
def test_render_refuses_what_validation_would_have_refused(changes: dict[str, object], what: str) -> None:
    spec = _component_with(load_spec(TINY), **changes)
    with pytest.raises(ValueError, match=what):
        render_sbatch(spec, "/j", "/j/s.toml")


def test_render_refuses_control_characters_in_names_and_paths() -> None:
    spec = load_spec(TINY)
    bad_name = dataclasses.replace(spec, job=dataclasses.replace(spec.job, name="x\ntouch /tmp/x"))
    with pytest.raises(ValueError, match="job.name"):
        render_sbatch(bad_name, "/j", "/j/s.toml")
    with pytest.raises(ValueError, match="control character"):
        render_sbatch(spec, "/j\ntouch /tmp/x", "/j/s.toml")
    with pytest.raises(ValueError, match="the spec file"):
        render_sbatch(spec, "/j", "/j/s\n.toml")


def test_container_words_are_shell_quoted() -> None:
    spec = load_spec(TINY)
    container = dataclasses.replace(spec.container, image="/img dir/$(id).sif", binds=["/a b:/c"],
                                    env=["X=$(touch pwned); echo"])
    text = render_sbatch(dataclasses.replace(spec, container=container), "/j", "/j/s.toml")
    assert "'/img dir/$(id).sif'" in text and "'/a b:/c'" in text and "pwned" not in text  # env: in the env file
    assert subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, check=False).returncode == 0


@pytest.mark.parametrize("golden", sorted((Path(__file__).parent / "golden").glob("*.sbatch")), ids=lambda p: p.stem)
def test_every_sbatch_line_of_the_golden_scripts_is_one_option(golden: Path, tmp_path: Path) -> None:
    text = golden.read_text()
    lines = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert all(len(sbatch_arguments(line)) == 1 for line in lines)
    ours = [sbatch_arguments(line)[0] for line in lines]
    assert real_sbatch_arguments(text, tmp_path) == [word for word in ours if word != "hetjob"]
