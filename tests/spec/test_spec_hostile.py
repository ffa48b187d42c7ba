"""Hostile and absurd specs: refused by validation with the key named, never a traceback.

Nothing from the spec becomes shell: every string that reaches the sbatch script has a
pattern (relax_hpc/spec/text_checks.py), every count an upper bound, every float must be
finite, and the file itself is bounded in size and nesting. The CLI tests run `relax-hpc
validate` / `render` as real subprocesses, like tests/cli does.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
import tomli_w
from spec_example import VALID_SPEC, spec_with

from relax_hpc.spec import JobSpec, SpecError, SpecProblem, load_spec, parse_spec
from relax_hpc.spec.loader import MAX_NESTING, MAX_SPEC_BYTES

REPO = Path(__file__).resolve().parents[2]

# Strings that are free text by design and never reach a shell: prompts and stop strings.
FREE_TEXT = {"data.prompt_template", "data.system_prompt", "reward.genrm_prompt", "rollout.stop"}
NO_CONTROL = "must not contain control characters"
FINITE = "must be a finite number (not inf or nan, and within about ±1.8e308)"


def problems_of(text: str) -> list[SpecProblem]:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "x.toml")
    return caught.value.problems


def only_problem(changes: dict[str, Any]) -> SpecProblem:
    problems = problems_of(spec_with(changes))
    assert len(problems) == 1, [p.format("x.toml") for p in problems]
    return problems[0]


def nested(key: str, value: object) -> dict[str, Any]:
    """{"a": {"b": value}} for key "a.b"."""
    out: dict[str, Any] = {}
    inner = out
    *tables, name = key.split(".")
    for table in tables:
        inner = inner.setdefault(table, {})
    inner[name] = value
    return out


def leaf_keys() -> list[tuple[str, Any]]:
    """(TOML key, type hint without None) of every leaf key, [cluster.forward] included."""
    found: list[tuple[str, Any]] = []

    def visit(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for spec_field in dataclasses.fields(cls):
            key = f"{prefix}.{spec_field.name}" if prefix else spec_field.name
            hint = hints[spec_field.name]
            if get_origin(hint) in (Union, types.UnionType):  # X | None
                (hint,) = [arg for arg in get_args(hint) if arg is not type(None)]
            if dataclasses.is_dataclass(hint):
                assert isinstance(hint, type)
                visit(hint, key)
            else:
                found.append((key, hint))

    visit(JobSpec, "")
    return found


STRING_KEYS = [k for k, hint in leaf_keys() if hint in (str, list[str]) and k not in FREE_TEXT]
INT_KEYS = [k for k, hint in leaf_keys() if hint is int]
FLOAT_KEYS = [k for k, hint in leaf_keys() if hint in (float, list[float])]


def test_the_schema_walk_finds_the_keys_that_reach_the_script() -> None:
    for key in ["job.name", "job.output_dir", "cluster.trainer.partition", "cluster.forward.extra_sbatch",
                "container.image", "container.binds", "container.env", "model.path", "data.path"]:
        assert key in STRING_KEYS
    assert "train.steps" in INT_KEYS and "train.lr" in FLOAT_KEYS and "train.adam_betas" in FLOAT_KEYS


# --- strings: nothing becomes shell --------------------------------------------------------


@pytest.mark.parametrize("key", STRING_KEYS)
def test_every_string_key_refuses_a_newline(key: str) -> None:
    hint = dict(leaf_keys())[key]
    value: object = ["ok", "a\ntouch /tmp/pwned"] if hint == list[str] else "a\ntouch /tmp/pwned"
    problem = only_problem(nested(key, value))
    assert problem.key == key


@pytest.mark.parametrize("key", sorted(FREE_TEXT))
def test_free_text_keys_keep_their_newlines(key: str) -> None:
    value: object = ["\n\n"] if key == "rollout.stop" else "Question:\n{question}"
    spec = parse_spec(spec_with(nested(key, value)))
    table, name = key.split(".")
    assert getattr(getattr(spec, table), name) == value


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        # The examples of the security report: each put a shell line into the rendered script.
        ("cluster.trainer.partition", "gpu\ntouch /tmp/x", "must be a Slurm name or comma-separated names"),
        ("cluster.trainer.extra_sbatch", ["--exclusive\ntouch /tmp/x"],
         f"element 0 ('--exclusive\\ntouch /tmp/x') {NO_CONTROL}"),
        ("job.output_dir", "runs/x\ntouch /tmp/x",
         f"{NO_CONTROL} (newline, carriage return, tab, NUL, ...); found '\\n' at position 6"),
        ("job.name", "x\ntouch", "must be 1..64 characters from A-Z a-z 0-9 _ . -"),
        ("job.name", "x\n", "must be 1..64 characters"),  # "$" of a pattern also matches before a final newline
        # Other control characters, anywhere.
        ("job.output_dir", "runs/x\rtouch", "found '\\r' at position 6"),
        ("job.output_dir", "runs/\x00x", "found '\\x00' at position 5"),
        ("model.path", "models/\ttiny", "found '\\t' at position 7"),
        ("data.path", "data/\x1b[2Jx.jsonl", "found '\\x1b' at position 5"),
        ("model.path", "models/tiny\u2028", "found '\\u2028' at position 11"),  # line separator
        ("model.path", "models/\u202etxt.exe", "found '\\u202e' at position 7"),  # right-to-left override
        ("cluster.trainer.account", "acct\nx", "must be one Slurm name from A-Z a-z 0-9 _ . -"),
        ("cluster.trainer.account", "a,b", "must be one Slurm name"),
        ("cluster.rollout.qos", "normal high", "must be one Slurm name"),
        ("cluster.trainer.constraint", "h100;reboot", "must be a Slurm feature expression"),
        ("cluster.trainer.time", "01:00:00\n", "is not a Slurm time limit"),
        ("cluster.trainer.time", " 01:00:00", "is not a Slurm time limit"),
        ("cluster.trainer.time", "400-00:00:00", "is longer than 365 days"),
        ("cluster.trainer.time", "9" * 5000, "at most 9 digits each"),
        ("cluster.trainer.memory", "64G\n", "must be a Slurm memory size"),
        ("cluster.trainer.extra_sbatch", ["--comment=a b"], "must be one long sbatch option"),
        ("cluster.trainer.extra_sbatch", ["-x node1"], "must be one long sbatch option"),
        ("cluster.trainer.extra_sbatch", ['--comment="x"'], "must be one long sbatch option"),
        ("cluster.trainer.extra_sbatch", ["--comment=a#b"], "must be one long sbatch option"),
        ("cluster.trainer.extra_sbatch", ["--exclusive", "--uid=0 --gid=0"], "element 1 ('--uid=0 --gid=0')"),
        # A later #SBATCH line wins: the script's own options cannot be overridden, prefixes included.
        ("cluster.trainer.extra_sbatch", ["--output=/tmp/x.out"], "--output would override the script's own --output: set it with [job] output_dir"),
        ("cluster.trainer.extra_sbatch", ["--part=debug"], "--part would override the script's own --partition: set it with partition"),
        ("cluster.trainer.extra_sbatch", ["--no-requeue"], "set it with [cluster] requeue"),
        ("cluster.trainer.extra_sbatch", ["--time=1"], "set it with time instead"),
        ("container.image", "img.sif\nrm", NO_CONTROL),
        ("container.image", "--fakeroot", 'must not start with "-"'),
        ("container.binds", ["/a:/b:ro:x"], 'must be "src", "src:dst" or "src:dst:opts"'),
        ("container.binds", ["/a::ro"], "with no empty part"),
        ("container.binds", ["/data\n"], NO_CONTROL),
        ("container.env", ["A\n=1"], 'must be "NAME=VALUE"'),
        ("container.env", ["A=1\nrm -rf ~"], NO_CONTROL),
    ],
)
def test_hostile_strings_are_refused_naming_key_and_allowed(key: str, value: object, message: str) -> None:
    problem = only_problem(nested(key, value))
    assert problem.key == key
    assert message in problem.message
    assert "\n" not in problem.format("x.toml")  # one problem, one line


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cluster.trainer.partition", "gpu,gpu-long"),
        ("cluster.trainer.account", "rl-team_2.a"),
        ("cluster.trainer.constraint", "[rack1|rack2]&ib*2"),
        ("cluster.trainer.extra_sbatch", ["--exclusive", "--gres=gpu:a100:4", "--mail-user=a@b.c",
                                          "--exclude=node[01-04]", "--begin=now+1hour", "--mem-per-gpu=40G",
                                          "--nodelist=node[01-02]", "--time-min=30"]),
        ("cluster.trainer.time", "36:00:00"),
        ("container.binds", ["/models", "/scratch/me:/data:ro"]),
        ("container.env", ["NCCL_DEBUG=WARN", "EMPTY=", "URL=http://x/?a=b&c=d"]),
        ("container.image", "docker://ubuntu:22.04"),
        ("job.output_dir", "/scratch/My Runs/it's #1 $HOME"),  # no control characters: fine, render quotes it
        ("model.path", "Qwen/Qwen3-4B"),
        # sbatch (22.05) splits hetjob components only at a line "#SBATCH hetjob", not at the word
        # inside an option: pytest's tmp_path of tests/slurm holds it ("test_submit_runs_one_hetjob_wi0").
        ("job.output_dir", "/tmp/test_submit_runs_one_hetjob_wi0/t"),
        ("job.name", "my-hetjob"),
    ],
)
def test_ordinary_values_are_still_accepted(key: str, value: object) -> None:
    spec = parse_spec(spec_with(nested(key, value)))
    holder: Any = spec
    for part in key.split("."):
        holder = getattr(holder, part)
    assert holder == value


# --- numbers: bounded and finite -----------------------------------------------------------


@pytest.mark.parametrize("key", INT_KEYS)
def test_every_integer_key_has_an_upper_bound(key: str) -> None:
    problem = only_problem(nested(key, 2**63 - 1))
    assert problem.key == key
    assert problem.message.startswith(("must be in [", "no Slurm node has more than"))


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 10**400])
def test_every_float_key_must_be_finite(key: str, value: float) -> None:
    hint = dict(leaf_keys())[key]
    problem = only_problem(nested(key, [0.9, value] if hint == list[float] else value))
    assert problem.key == (f"{key}[1]" if hint == list[float] else key)
    assert problem.message == FINITE


@pytest.mark.parametrize(
    ("changes", "key", "message"),
    [
        ({"train": {"steps": 1e29}}, "train.steps", "expected an integer, got a float"),
        ({"train": {"steps": 10**7 + 1}}, "train.steps", "must be in [1, 10000000]"),
        ({"train": {"lr": float("inf")}}, "train.lr", FINITE),
        ({"rollout": {"prompts_per_step": 2**63 - 1}}, "rollout.prompts_per_step", "must be in [1, 1000000]"),
        ({"rollout": {"max_new_tokens": 10**12}}, "rollout.max_new_tokens", "must be in [1, 10000000]"),
        ({"job": {"seed": 2**32}}, "job.seed", "must be in [0, 4294967295]"),
        ({"cluster": {"signal_grace_s": 70000}}, "cluster.signal_grace_s", "must be in [10, 65535]"),
        ({"reward": {"timeout_s": 1e300}}, "reward.timeout_s", "must be in (0, 1000000]"),
    ],
)
def test_absurd_numbers_say_the_bound(changes: dict[str, Any], key: str, message: str) -> None:
    problem = only_problem(changes)
    assert (problem.key, problem.message) == (key, message)


def test_the_bounds_leave_real_specs_alone() -> None:
    changes = {"train": {"steps": 100_000, "micro_batch_size": 512},
               "rollout": {"prompts_per_step": 512, "n_samples_per_prompt": 64, "max_new_tokens": 32_768},
               "cluster": {"trainer": {"nodes": 64, "gpus_per_node": 8, "cpus_per_node": 224, "time": "7-00:00:00"}}}
    assert parse_spec(spec_with(changes)).rollout.max_new_tokens == 32_768


# --- the file itself -----------------------------------------------------------------------


def only_file_problem(path: Path | str) -> SpecProblem:
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    (problem,) = caught.value.problems
    assert problem.key == "" and str(path) in str(caught.value)
    return problem


def test_a_file_over_1_mib_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text(VALID_SPEC + "# padding\n" * (2 * MAX_SPEC_BYTES // 10))
    assert "is larger than 1 MiB" in only_file_problem(big).message
    with pytest.raises(SpecError, match="is larger than 1 MiB"):
        parse_spec("#" * (MAX_SPEC_BYTES + 1))


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero on this system")
def test_dev_zero_is_refused_without_reading_it_all() -> None:
    assert "is larger than 1 MiB" in only_file_problem("/dev/zero").message


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 3000])
def test_deep_nesting_is_one_problem(tmp_path: Path, depth: int) -> None:
    # 3000 arrays: tomllib itself fails with RecursionError; a few more than allowed: our check.
    deep = tmp_path / "deep.toml"
    deep.write_text(VALID_SPEC + "[metrics]\nx = " + "[" * depth + "]" * depth + "\n")
    assert "is nested too deeply" in only_file_problem(deep).message
    inline = tmp_path / "inline.toml"
    inline.write_text("x = " + "{a = " * depth + "1" + "}" * depth + "\n")
    assert "is nested too deeply" in only_file_problem(inline).message


def test_nesting_up_to_the_limit_reaches_the_key_checks() -> None:
    depth = MAX_NESTING - 1  # under [metrics]: 1 table + the arrays
    problems = problems_of(VALID_SPEC + "[metrics]\nx = " + "[" * depth + "]" * depth + "\n")
    assert [p.key for p in problems] == ["metrics.x"]


def test_an_integer_of_thousands_of_digits_is_one_problem(tmp_path: Path) -> None:
    spec = tmp_path / "digits.toml"
    spec.write_text(VALID_SPEC.replace("steps = 3", "steps = 1" + "0" * 5000))
    assert only_file_problem(spec).message == "invalid TOML: an integer has too many digits"


# --- the command line ----------------------------------------------------------------------


def relax(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "relax_hpc.cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def _hostile_spec(tmp_path: Path) -> Path:
    path = tmp_path / "hostile.toml"
    text = spec_with({"job": {"output_dir": "runs/x\ntouch /tmp/relax-pwned-1"},
                      "cluster": {"trainer": {"partition": "gpu\ntouch /tmp/relax-pwned-2",
                                              "extra_sbatch": ["--exclusive\ntouch /tmp/relax-pwned-3"]}}})
    path.write_text(text)
    return path


def test_validate_names_every_hostile_key_and_exits_2(tmp_path: Path) -> None:
    spec = _hostile_spec(tmp_path)
    result = relax("validate", str(spec))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    for key in ("job.output_dir", "cluster.trainer.partition", "cluster.trainer.extra_sbatch"):
        assert f"{key} = " in result.stderr
    assert result.stderr.splitlines()[0] == f"invalid job spec {spec} (3 problems):"


def test_render_is_never_given_hostile_text(tmp_path: Path) -> None:
    result = relax("render", str(_hostile_spec(tmp_path)), "--job-dir", str(tmp_path / "job"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stdout == ""  # refused while loading: no script was rendered
    assert "cluster.trainer.partition" in result.stderr


def _cli_cases(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """{name: (spec path, expected text in stderr)} of files that are absurd as a whole or in a number."""
    cases: dict[str, tuple[str, str]] = {}

    def write(name: str, text: str, expected: str) -> None:
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        cases[name] = (str(path), expected)

    write("two_mib", VALID_SPEC + "#" * (2 * MAX_SPEC_BYTES) + "\n", "is larger than 1 MiB")
    write("deep", "x = " + "[" * 3000 + "]" * 3000 + "\n", "is nested too deeply")
    write("digits", VALID_SPEC.replace("steps = 3", "steps = " + "9" * 5000), "an integer has too many digits")
    write("steps", VALID_SPEC.replace("steps = 3", "steps = 1e29"), "train.steps = 1e+29: expected an integer")
    write("lr", VALID_SPEC.replace("lr = 1e-5", "lr = inf"), f"train.lr = inf: {FINITE}")
    write("prompts", VALID_SPEC.replace("prompts_per_step = 4", f"prompts_per_step = {2**63 - 1}"),
          "rollout.prompts_per_step = 9223372036854775807: must be in [1, 1000000]")
    if Path("/dev/zero").exists():
        cases["dev_zero"] = ("/dev/zero", "/dev/zero: is larger than 1 MiB")
    return cases


def test_absurd_files_and_numbers_give_one_line_and_no_traceback(tmp_path: Path) -> None:
    for name, (path, expected) in _cli_cases(tmp_path).items():
        result = relax("validate", path)
        assert result.returncode == 2, (name, result.stderr)
        assert "Traceback" not in result.stderr and "Error" not in result.stderr, (name, result.stderr)
        header, problem, footer = result.stderr.splitlines()  # the loader's format: one problem line
        assert header == f"invalid job spec {path} (1 problem):", name
        assert problem.startswith(path) and expected in problem, (name, problem)
        assert footer.startswith("See docs/spec.md"), name


def test_tomli_w_writes_what_the_tests_feed() -> None:
    # The parametrised tests go through tomli_w: make sure it keeps the hostile characters.
    assert "\\n" in tomli_w.dumps({"a": "x\ny"}) and "inf" in tomli_w.dumps({"a": float("inf")})
