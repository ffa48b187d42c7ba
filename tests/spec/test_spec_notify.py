"""[notify]: defaults, checks, and the alert URLs' secrets kept out of everything printed.

The secrets below (tokens, passwords, topics) must never appear in a problem report, in
`relax-hpc show`, in the job directory's spec.toml, or in the rendered sbatch script; only the
owner-only spec.submit.toml that the Slurm job reads keeps them.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from spec_example import VALID_SPEC, spec_with

from relax_hpc.cli.main import main
from relax_hpc.launch.slurm_client import FakeSlurmClient
from relax_hpc.spec import SpecError, parse_spec, spec_to_toml
from relax_hpc.spec.schema import NOTIFY_EVENTS, NotifySpec

REPO = Path(__file__).resolve().parents[2]

URLS = ["slack://TokenAaa/TokenBbb/TokenCcc", "mailto://mailuser:mail-pass-99@example.com",
        "json://jsonuser:json-pass-77@127.0.0.1:8080/hook-path-55", "ntfy://secret-topic-42"]
SECRETS = ["TokenAaa", "TokenBbb", "TokenCcc", "mailuser", "mail-pass-99", "jsonuser", "json-pass-77",
           "hook-path-55", "secret-topic-42"]
REDACTED = ["slack://***/***", "mailto://***@example.com", "json://***@127.0.0.1:8080/***", "ntfy://***"]


def report_of(text: str) -> str:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "x.toml")
    return str(caught.value)


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, secret


def test_defaults_send_nothing_and_name_the_usual_events() -> None:
    notify = parse_spec(VALID_SPEC).notify
    assert notify == NotifySpec()
    assert notify.urls == [] and notify.urls_file is None and notify.min_interval_s == 60.0
    assert notify.events == ["started", "requeued", "preempted", "role_restarted", "save_failed", "failed",
                             "finished", "reward_milestone"]
    assert notify.reward_milestones == []
    assert set(notify.events) == set(NOTIFY_EVENTS)  # every event is alerted unless the spec says otherwise


def test_every_key_is_accepted() -> None:
    notify = parse_spec(spec_with({"notify": {
        "urls": URLS, "urls_file": "~/.config/relax-hpc/alerts", "events": ["failed", "role_restarted"],
        "min_interval_s": 0, "reward_milestones": [0.5, 0.25]}})).notify
    assert notify.urls == URLS and notify.events == ["failed", "role_restarted"]
    assert notify.min_interval_s == 0.0 and notify.reward_milestones == [0.5, 0.25]


def test_an_unknown_event_lists_the_allowed_ones() -> None:
    report = report_of(spec_with({"notify": {"events": ["started", "crashed"]}}))
    assert "notify.events[1] = 'crashed': is not one of the allowed values; allowed: " in report
    assert '"started", "requeued", "preempted", "role_restarted", "save_failed", "failed", "finished", "reward_milestone"' in report


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"urls": ["TokenAaa/TokenBbb"]}, "notify.urls = ['***']: element 0 (***) must be an Apprise URL"),
        ({"urls": ["ntfy://ntfy.sh/x", "slack://TokenAaa/Token Bbb"]},
         "element 1 (slack://***/***) must be an Apprise URL"),
        ({"urls": ["slack://TokenAaa/TokenBbb\n"]}, "element 0 (slack://***/***) must not contain control characters"),
        ({"urls": "slack://TokenAaa/TokenBbb/TokenCcc"}, "notify.urls = 'slack://***/***': expected an array"),
        ({"urls": ["slack://TokenAaa/TokenBbb", 3]}, "notify.urls[1] = 3: expected a string"),
        ({"url": ["slack://TokenAaa/TokenBbb/TokenCcc"]},
         "notify.url = ['slack://***/***']: unknown key (did you mean \"urls\"?)"),
        ({"min_interval_s": -1}, "notify.min_interval_s = -1: must be in [0, 1000000]"),
        ({"reward_milestones": [0.5, float("nan")]}, "notify.reward_milestones[1] = nan: must be a finite number"),
        ({"urls_file": "a\nb"}, "must not contain control characters"),
    ],
)
def test_problems_name_the_key_and_never_print_a_secret(changes: dict[str, object], expected: str) -> None:
    report = report_of(spec_with({"notify": changes}))
    assert expected in report
    assert_no_secret(report)


def test_the_resolved_spec_redacts_the_urls_and_loads_again() -> None:
    spec = parse_spec(spec_with({"notify": {"urls": URLS}}))
    shown = spec_to_toml(spec)
    assert_no_secret(shown)
    assert parse_spec(shown).notify.urls == REDACTED
    assert parse_spec(spec_to_toml(spec, redact=False)) == spec  # the file a Slurm job reads back


def test_show_prints_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(spec_with({"notify": {"urls": URLS}}))
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert_no_secret(out)
    assert all(url in out for url in REDACTED)


def test_validate_names_a_url_apprise_refuses_redacted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(spec_with({"notify": {"urls": ["ntfy://secret-topic-42", "bogus://TokenAaa/TokenBbb"]}}))
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "[notify] URL 2 (bogus://***/***): Apprise does not accept it" in captured.err
    assert_no_secret(captured.out + captured.err)
    path.write_text(spec_with({"notify": {"urls": URLS}}))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"notify: Apprise accepts {', '.join(REDACTED)}" in out
    assert_no_secret(out)


def test_render_and_submit_keep_the_secrets_out_of_the_script(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from relax_hpc.launch.jobs import submit_spec
    from relax_hpc.spec import load_spec

    path = tmp_path / "slurm.toml"
    path.write_text((REPO / "jobspecs" / "tiny_slurm.toml").read_text()
                    + "\n[notify]\nurls = [" + ", ".join(f'"{u}"' for u in URLS) + "]\n")
    assert main(["render", str(path)]) == 0
    assert_no_secret(capsys.readouterr().out)

    client = FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                           for i in range(2)])
    done = submit_spec(load_spec(path), path, client, base=tmp_path)
    assert_no_secret(done.script.read_text())
    # The job reads its URLs back from spec.submit.toml: kept as written, owner-only.
    submitted = done.job_dir / "spec.submit.toml"
    assert load_spec(submitted).notify.urls == URLS
    assert stat.S_IMODE(submitted.stat().st_mode) == 0o600

    path.write_text(path.read_text().replace("ntfy://secret-topic-42", "bogus://TokenAaa"))
    with pytest.raises(ValueError, match=r"URL 4 \(bogus://\*\*\*\): Apprise does not accept it") as caught:
        submit_spec(load_spec(path), path, client, base=tmp_path)
    assert_no_secret(str(caught.value))
