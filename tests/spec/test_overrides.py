"""Spec composition and --set overrides (relax_hpc/spec/compose.py, overrides.py, peer_keys.py):
merge order, how --set values are typed, every error naming its file or --set, where each value
came from, and the hints for other frameworks' key names."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from relax_hpc.spec import SpecError, load_spec, spec_to_toml
from relax_hpc.spec.compose import annotate_origins, compose_spec, merge_tables
from relax_hpc.spec.loader import schema_keys
from relax_hpc.spec.overrides import Override, parse_override
from relax_hpc.spec.peer_keys import PEER_KEYS, peer_hint
from relax_hpc.spec.schema import JobSpec

BASE = """\
[job]
name = "base"

[model]
path = "models/tiny"

[data]
path = "data/p.jsonl"

[rollout]
n_samples_per_prompt = 4
stop = ["a", "b"]

[reward]
function = "tiny_sum"

[train]
steps = 10
lr = 1e-5

[cluster.trainer]
nodes = 1
time = "04:00:00"
"""

OVERLAY = """\
[train]
steps = 20

[rollout]
stop = ["c"]

[cluster.trainer]
nodes = 2
"""


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    base, overlay = tmp_path / "base.toml", tmp_path / "overlay.toml"
    base.write_text(BASE)
    overlay.write_text(OVERLAY)
    return str(base), str(overlay)


def _error(paths: list[str], overrides: list[str]) -> str:
    with pytest.raises(SpecError) as caught:
        compose_spec(paths, overrides)
    return str(caught.value)


def test_files_merge_left_to_right(files: tuple[str, str]) -> None:
    spec = compose_spec(list(files)).spec
    assert spec.train.steps == 20  # the overlay's scalar replaces the base's
    assert spec.train.lr == 1e-5  # a key only the base sets stays: tables merge key by key
    assert spec.rollout.stop == ["c"]  # an array is replaced, not appended to
    assert spec.rollout.n_samples_per_prompt == 4
    assert (spec.cluster.trainer.nodes, spec.cluster.trainer.time) == (2, "04:00:00")  # nested tables too
    assert compose_spec(list(reversed(files))).spec.train.steps == 10  # the other order, the other winner


def test_merge_tables_leaves_its_inputs_alone() -> None:
    base = {"a": {"b": 1, "c": [1]}}
    overlay = {"a": {"b": 2}, "d": 3}
    assert merge_tables(base, overlay) == {"a": {"b": 2, "c": [1]}, "d": 3}
    assert base == {"a": {"b": 1, "c": [1]}} and overlay == {"a": {"b": 2}, "d": 3}


def test_set_values_are_toml_values(files: tuple[str, str]) -> None:
    spec = compose_spec(list(files), [
        "train.lr=1e-6", "train.steps=3", "checkpoint.resume=false", "rollout.stop=['x', \"y\"]",
        "train.adam_betas=[0.8, 0.9]", "job.name=run-2", "data.path=/data/p.jsonl",
        "cluster.trainer.nodes=4", "rollout.temperature=1",
    ]).spec
    assert spec.train.lr == 1e-6 and spec.train.steps == 3 and spec.checkpoint.resume is False
    assert spec.rollout.stop == ["x", "y"] and spec.train.adam_betas == [0.8, 0.9]
    assert spec.job.name == "run-2" and spec.data.path == "/data/p.jsonl"  # not TOML: taken as strings
    assert spec.cluster.trainer.nodes == 4  # set inside a sub-table
    assert spec.rollout.temperature == 1.0  # an integer where a float goes, as in a file


def test_a_string_key_takes_the_text_as_typed(files: tuple[str, str]) -> None:
    # 02:00:00 is a TOML time and 123 an integer, but these keys are strings: the text is the value.
    spec = compose_spec(list(files), ["cluster.trainer.time=02:00:00", "job.name=123",
                                      'model.path="quoted path"']).spec
    assert spec.cluster.trainer.time == "02:00:00" and spec.job.name == "123"
    assert spec.model.path == "quoted path"


def test_later_set_wins_and_goes_on_top_of_every_file(files: tuple[str, str]) -> None:
    spec = compose_spec(list(files), ["train.steps=5", "train.steps=6"]).spec
    assert spec.train.steps == 6


def test_a_bad_type_names_the_set_and_the_key(files: tuple[str, str]) -> None:
    text = _error(list(files), ["train.lr=abc"])
    assert "--set train.lr=abc: train.lr = 'abc': expected a number, got a string" in text
    assert "(1 problem)" in text


def test_an_unknown_key_by_set_gets_the_files_did_you_mean(files: tuple[str, str]) -> None:
    text = _error(list(files), ["train.lrr=1", "trian.steps=2"])
    assert '--set train.lrr=1: train.lrr = 1: unknown key (did you mean "lr"?)' in text
    assert '--set trian.steps=2: trian: unknown table (did you mean "train"?)' in text


@pytest.mark.parametrize(("override", "message"), [
    ("cluster.trainer=1", "cluster.trainer is a table, which --set does not replace: set its keys one at a time, "
                          "e.g. --set cluster.trainer.nodes=..."),
    ("train={steps = 2}", "train is a table, which --set does not replace"),
    ("train.lr.x=1", "train.lr is a key, not a table: set it as --set train.lr=VALUE"),
    ("train.steps={a = 1}", "train.steps takes a value, not a table"),
])
def test_what_set_cannot_set_is_refused_by_name(files: tuple[str, str], override: str, message: str) -> None:
    text = _error(list(files), [override])
    assert f"--set {override}: " in text and message in text


@pytest.mark.parametrize(("override", "why"), [
    ("train.lr", "no '=' between the key and the value"),
    ("=1e-6", "the key before '=' is empty"),
    ("train..lr=1", "is not a dotted key"),
    ("train.stop[0]=x", "is not a dotted key"),
])
def test_a_malformed_set_shows_the_expected_form(files: tuple[str, str], override: str, why: str) -> None:
    text = _error(list(files), [override, "also bad"])
    assert f"--set {override}: " in text and why in text
    assert "expected --set KEY=VALUE, e.g. --set train.lr=1e-6" in text
    assert "--set also bad: no '='" in text  # every malformed one at once


def test_a_value_cannot_smuggle_in_more_keys() -> None:
    # "value = 1\n[job]\nname = 'x'" is valid TOML with two keys: the text is one value, a string.
    override = parse_override("train.lr=1\n[job]\nname = 'x'")
    assert isinstance(override, Override) and override.value == "1\n[job]\nname = 'x'"


def test_problems_name_the_file_that_gave_the_value(tmp_path: Path, files: tuple[str, str]) -> None:
    overlay = tmp_path / "bad.toml"
    overlay.write_text("[rollout]\ntop_p = 1.5\n")
    text = _error([*files, str(overlay)], ["train.steps=0"])
    lines = text.splitlines()
    assert lines[0] == f"invalid job spec {files[0]} + {files[1]} + {overlay} --set train.steps=0 (2 problems):"
    # In order: the files, left to right, then the overrides.
    assert lines[1].startswith(f"{overlay}:2: rollout.top_p = 1.5: ")
    assert lines[2].startswith("--set train.steps=0: train.steps = 0: ")


def test_one_file_reports_as_load_spec_does(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BASE.replace("lr = 1e-5", "lr = -1\nbogus = 2") + '[algorithm]\nname = "ppo"\n')
    with pytest.raises(SpecError) as loaded:
        load_spec(bad)
    assert _error([str(bad)], []) == str(loaded.value)


def test_where_each_value_came_from(files: tuple[str, str]) -> None:
    composed = compose_spec(list(files), ["train.lr=3e-6"])
    origins = composed.origins
    assert origins.where_of("train.steps") == f"{files[1]}:2"
    assert origins.where_of("cluster.trainer.time") == f"{files[0]}:23"
    assert origins.where_of("rollout.stop[0]") == f"{files[1]}:5"  # an array item: its key's line
    assert origins.where_of("train.lr") == "--set train.lr=3e-6"
    assert origins.where_of("train.grad_clip") is None  # a default
    assert set(origins.given()) == {"job.name", "model.path", "data.path", "rollout.n_samples_per_prompt",
                                    "rollout.stop", "reward.function", "train.steps", "train.lr",
                                    "cluster.trainer.nodes", "cluster.trainer.time"}


def test_annotated_toml_names_each_given_value_and_still_loads(files: tuple[str, str]) -> None:
    composed = compose_spec(list(files), ["train.lr=3e-6"])
    text = annotate_origins(spec_to_toml(composed.spec), composed.origins)
    lines = text.splitlines()
    assert f"steps = 20  # {files[1]}:2" in lines
    assert "lr = 3e-06  # --set" in lines
    assert f'name = "base"  # {files[0]}:2' in lines
    assert "grad_clip = 1.0" in lines  # a default has no note
    assert f"stop = [  # {files[1]}:5" in lines  # a multi-line array: after its opening bracket
    assert tomllib.loads(text) == tomllib.loads(spec_to_toml(composed.spec))


def test_a_secret_given_by_set_is_not_shown(files: tuple[str, str]) -> None:
    text = _error(list(files), ["notify.url=slack://TokenA/TokenB/TokenC"])
    assert "TokenA" not in text and "--set notify.url=***" in text
    composed = compose_spec(list(files), ["notify.urls=['slack://TokenA/TokenB/TokenC']"])
    assert "TokenA" not in composed.label
    assert "TokenA" not in annotate_origins(spec_to_toml(composed.spec), composed.origins)


def test_original_text_keeps_every_part_as_written(files: tuple[str, str]) -> None:
    assert compose_spec([files[0]]).original_text() == BASE
    text = compose_spec(list(files), ["train.lr=3e-6"]).original_text()
    assert BASE in text and OVERLAY in text and "# --set train.lr=3e-6" in text
    assert text.index(BASE) < text.index(OVERLAY) < text.index("# --set train.lr=3e-6")


@pytest.mark.parametrize(("written", "ours"), [
    ("[data]\nmax_response_length = 512", "rollout.max_new_tokens"),
    ("[data]\nmax_prompt_length = 512", "data.max_prompt_tokens"),
    ("[rollout]\nn = 8", "rollout.n_samples_per_prompt"),
    ("[rollout]\nnum_generations = 8", "rollout.n_samples_per_prompt"),
    ("[data]\ntrain_batch_size = 32", "rollout.prompts_per_step"),
    ("[train]\ntensor_model_parallel_size = 2", "train.megatron.tensor_parallel"),
    ("[rollout]\ntensor_model_parallel_size = 2", "rollout.sglang.tp_size"),
    ("[train]\nppo_mini_batch_size = 8", "train.mini_batches"),
    ("[train]\nkl_loss_coef = 0.01", "algorithm.kl_coef"),
    ("[train]\nlearning_rate = 1e-6", "train.lr"),
])
def test_a_peer_frameworks_key_gets_ours(files: tuple[str, str], tmp_path: Path, written: str, ours: str) -> None:
    extra = tmp_path / "peer.toml"
    extra.write_text(written + "\n")
    text = _error([files[0], str(extra)], [])
    assert f"{extra}:2: " in text and f"ours is {ours}" in text


def test_our_own_key_in_the_wrong_table_says_where_it_belongs(files: tuple[str, str]) -> None:
    text = _error(list(files), ["rollout.lr=1e-6", "train.kl_coef=0.1"])
    assert "lr belongs in [train]" in text and "kl_coef belongs in [algorithm]" in text


def _schema_keys() -> tuple[set[str], set[str]]:
    """(every key path, every key name) of the schema."""
    keys = [(table, spec_field.name) for table, spec_field in schema_keys()]
    return {f"{table}.{name}" if table else name for table, name in keys}, {name for _, name in keys}


def test_peer_hints_name_real_keys_and_no_name_of_ours() -> None:
    paths, names = _schema_keys()
    for name, hint in PEER_KEYS.items():
        assert name.rpartition(".")[2] not in names, f"{name} is ours: the loader says where it belongs"
        named = {word.rstrip(",;:)") for word in hint.split() if "." in word and word[0].isalpha()}
        assert named and named <= paths, (name, named - paths)
    assert peer_hint("rollout.n") is not None and peer_hint("train.n") is None  # n alone means nothing
