"""Grow jobs without a cluster: the rendered script (golden files), the request checks, the
grow_jobs.json record, and `relax-hpc grow / shrink / status / render --grow` through main()
with the fake Slurm client and a real REST server over an in-memory elastic control.

Re-record the golden files after an intended change of grow.sbatch.in or the renderer:

    RELAX_RECORD_GOLDEN=1 .venv/bin/pytest tests/launch/test_federation.py -q
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_fakes import FakeElastic, InMemoryRest

from relax_hpc.auth import JobSecret
from relax_hpc.cli.main import main
from relax_hpc.engines.elastic.rest_api import RestServer, make_rest_app
from relax_hpc.cli import slurm_commands as commands
from relax_hpc.launch.federation import (
    ElasticApi,
    FederationError,
    OperationBusy,
    grow_request,
    read_grow_jobs,
    render_grow_sbatch,
    submit_grow,
)
from relax_hpc.launch.incluster import write_cluster_json
from relax_hpc.launch.jobs import pin_paths
from relax_hpc.launch.slurm_client import FakeSlurmClient, JobComponent
from relax_hpc.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
SPECS = {
    "tiny_slurm": REPO / "jobspecs" / "tiny_slurm.toml",
    "gpu_1node": Path(__file__).parent / "specs" / "gpu_1node.toml",
    "qwen3_omni": REPO / "jobspecs" / "qwen3_omni.toml",
}
# What each golden file asks for: a pre-emptible partition, the rollout component's own (with GPUs), a container.
GROW_ARGS: dict[str, dict[str, Any]] = {
    "tiny_slurm": {"engines": 3, "nodes": 2, "partition": "preempt", "time_limit": "01:00:00", "preemptible": True},
    "gpu_1node": {"engines": 2},
    "qwen3_omni": {"engines": 1, "qos": "scavenger", "preemptible": True},
}


def rendered(name: str) -> str:
    spec = pin_paths(load_spec(SPECS[name]), Path("/shared"))
    return render_grow_sbatch(grow_request(Path(f"/shared/runs/{spec.job.name}"), "4242", spec, **GROW_ARGS[name]))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_grow_script_matches_golden(name: str) -> None:
    golden = GOLDEN / f"grow_{name}.sbatch"
    text = rendered(name)
    if os.environ.get("RELAX_RECORD_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing: record it with RELAX_RECORD_GOLDEN=1"
    assert text == golden.read_text(), (
        f"the grow job of {name} renders differently from {golden}; if the change is intended, re-record "
        "with RELAX_RECORD_GOLDEN=1 and review the diff")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_grow_script_is_valid_bash(name: str) -> None:
    done = subprocess.run(["bash", "-n"], input=rendered(name), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def _headers(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_grow_job_never_requeues_and_takes_the_named_partition_without_the_components_qos() -> None:
    headers = _headers(rendered("tiny_slurm"))
    assert "--no-requeue" in headers and "--requeue" not in headers and "hetjob" not in headers
    assert {"--job-name=tiny_slurm-grow", "--nodes=2", "--partition=preempt", "--time=01:00:00",
            "--signal=B:USR1@60", "--output=/shared/runs/tiny_slurm/logs/grow-%j.out"} <= set(headers)
    gpu = _headers(rendered("gpu_1node"))  # nothing named: the rollout component's partition and GPUs
    assert {"--partition=gpu", "--gpus-per-node=1", "--cpus-per-task=8", "--time=04:00:00"} <= set(gpu)
    assert not any(h.startswith(("--qos", "--account")) for h in gpu)
    text = rendered("gpu_1node")
    assert "--kill-on-bad-exit=0 --gpus-per-node=1" in text and "--gpus-per-node 1" in text


def test_grow_script_runs_in_the_jobs_container_and_passes_the_model_path() -> None:
    text = rendered("qwen3_omni")
    assert "WRAP_grow=(bash -c " in text and "' container --nv --bind" in text and '--env-file "$JOB_DIR/container.env"' in text
    assert "--model-dir /models/Qwen3-Omni-30B-A3B-Instruct --dtype bfloat16" in text
    assert "--qos=scavenger" in _headers(text) and "--partition=gpu" not in _headers(text)


def test_render_is_pure() -> None:
    assert rendered("tiny_slurm") == rendered("tiny_slurm")


def test_grow_request_reports_every_problem_at_once() -> None:
    spec = load_spec(SPECS["tiny_slurm"])
    with pytest.raises(FederationError) as caught:
        grow_request(Path("/j"), "4242", spec, engines=1, nodes=2, partition="a b", time_limit="soon",
                     gpus_per_node=-1)
    text = str(caught.value)
    assert "--engines 1 over --nodes 2" in text and "--partition 'a b'" in text and "--time 'soon'" in text
    assert "--gpus-per-node -1" in text
    with pytest.raises(FederationError, match="--preemptible: name the partition"):
        grow_request(Path("/j"), "4242", spec, engines=1, preemptible=True)


def test_submit_grow_records_the_job_owner_only(tmp_path: Path) -> None:
    spec = load_spec(SPECS["tiny_slurm"])
    fake = FakeSlurmClient(next_id=77)
    request = grow_request(tmp_path, "4242", spec, engines=2, partition="preempt", preemptible=True)
    assert submit_grow(request, fake, tmp_path, now=100.0) == "77"
    assert submit_grow(request, fake, tmp_path, now=200.0) == "78"
    record = tmp_path / "federation" / "grow_jobs.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "federation").stat().st_mode) == 0o700
    assert (tmp_path / "federation" / "weights").is_dir()  # the engines' --weights-root must exist
    jobs = read_grow_jobs(tmp_path)
    assert [(j["job_id"], j["engines"], j["partition"], j["preemptible"], j["submitted_at"]) for j in jobs] == [
        ("77", 2, "preempt", True, 100.0), ("78", 2, "preempt", True, 200.0)]
    assert (tmp_path / "federation" / "grow-77.sbatch").read_text() == fake.submitted[0][1] == render_grow_sbatch(request)
    assert not list(tmp_path.glob("federation/*.tmp*")) and not (tmp_path / "federation" / "grow-next.sbatch").exists()


def test_elastic_api_turns_http_errors_into_messages() -> None:
    control = FakeElastic()
    api = ElasticApi(InMemoryRest(control), "http://fake")
    control.refuse = "no engine has address ['http://x:1']; GET /rollout/engines lists them"
    with pytest.raises(FederationError, match="400: no engine has address"):
        api.start("scale_in", {"engine_urls": ["http://x:1"]})
    control.refuse, control.busy = None, {"id": "op-9", "kind": "scale_out", "state": "running"}
    with pytest.raises(OperationBusy, match="op-9 scale_out running"):
        api.start("scale_in", {"num_engines": 1})


# --- the CLI ----------------------------------------------------------------------------------


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, FakeSlurmClient]:
    """A main job submitted through `relax-hpc submit` (fake Slurm), running as job 1000."""
    fake = FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                         for i in range(2)])
    monkeypatch.setattr(commands, "make_client", lambda: fake)
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "s.toml"
    spec.write_text((REPO / "jobspecs/tiny_slurm.toml").read_text().replace(
        'name = "tiny_slurm"', f'name = "s"\noutput_dir = "{tmp_path / "job"}"'))
    assert main(["submit", str(spec)]) == 0
    fake.jobs["1000"] = [JobComponent("1000", 0, "RUNNING", "n0"), JobComponent("1001", 1, "RUNNING", "n1")]
    fake.next_id = 2000
    return tmp_path / "job", fake


@pytest.fixture
def rest(job: tuple[Path, FakeSlurmClient]) -> Iterator[FakeElastic]:
    """The main job's REST API: a real server over a FakeElastic, named in cluster.json."""
    job_dir, _ = job
    control = FakeElastic()
    token = JobSecret.load(job_dir / ".secret").token("rest")
    with RestServer(make_rest_app(control, token), host="127.0.0.1") as server:
        write_cluster_json(job_dir / "cluster.json", {"job_id": 1000, "rest_url": server.url,
                                                      "secret_file": str(job_dir / ".secret")})
        yield control


def test_render_grow_prints_what_grow_submits(job: tuple[Path, FakeSlurmClient],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, _ = job
    capsys.readouterr()
    assert main(["render", "--grow", str(job_dir), "--engines", "2", "--partition", "preempt", "--preemptible"]) == 0
    text = capsys.readouterr().out
    expected = grow_request(job_dir, "1000", load_spec(job_dir / "spec.submit.toml"), engines=2,
                            partition="preempt", preemptible=True)
    assert text == render_grow_sbatch(expected)
    assert main(["render"]) == 2 and "pass a SPEC" in capsys.readouterr().err
    assert main(["render", str(SPECS["tiny_slurm"]), "--engines", "2"]) == 2
    assert "--engines only go with --grow JOB" in capsys.readouterr().err
    assert main(["render", "--grow", str(job_dir)]) == 2 and "needs --engines N" in capsys.readouterr().err


def test_grow_submits_and_records_the_grow_job(job: tuple[Path, FakeSlurmClient], rest: FakeElastic,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, fake = job
    capsys.readouterr()
    assert main(["grow", str(job_dir), "--engines", "2", "--partition", "preempt", "--preemptible"]) == 0
    out = capsys.readouterr().out
    assert "submitted grow job 2000: 2 engine(s) on 1 node(s) for job 1000 (partition preempt, preemptible)" in out
    assert "relax-hpc shrink 1000 --grow-job 2000" in out
    grow_id, script, _ = fake.submitted[-1]
    assert grow_id == "2000" and "#SBATCH --job-name=s-grow" in script and "MAIN_JOB=1000" in script
    assert [j["job_id"] for j in read_grow_jobs(job_dir)] == ["2000"]


def test_grow_needs_a_running_job_with_its_rest_api(job: tuple[Path, FakeSlurmClient],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, fake = job
    capsys.readouterr()
    assert main(["grow", str(job_dir), "--engines", "1"]) == 2  # no cluster.json yet
    assert "has not started its REST API yet" in capsys.readouterr().err
    write_cluster_json(job_dir / "cluster.json", {"job_id": 1000, "rest_url": "http://127.0.0.1:9",
                                                  "secret_file": str(job_dir / ".secret")})
    assert main(["grow", str(job_dir), "--engines", "1"]) == 2  # nothing listens on port 9
    assert "did not answer" in capsys.readouterr().err
    fake.jobs["1000"] = [JobComponent("1000", 0, "PENDING", "")]
    assert main(["grow", str(job_dir), "--engines", "1"]) == 2
    assert "job 1000 is PENDING: a grow job joins a running job" in capsys.readouterr().err
    assert len(fake.submitted) == 1  # only the main job


def test_shrink_a_grow_job_drains_it_then_cancels_it(job: tuple[Path, FakeSlurmClient], rest: FakeElastic,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, fake = job
    rest.elastic("scale_out", {"engine_urls": ["http://n5:4000", "http://n5:4001"], "job": "2000"})
    capsys.readouterr()
    assert main(["shrink", str(job_dir), "--job", "2000", "--timeout-s", "10"]) == 0
    out = capsys.readouterr().out
    assert "draining 2 engine(s)" in out and "(scale_in) done: 2 engines removed" in out
    assert "cancelled grow job 2000" in out
    assert rest.posted("scale_in") == [{"job": "2000", "timeout_s": 10.0}]
    assert fake.actions[-1] == ("cancel", "2000", "", "")
    assert [e["state"] for e in rest.engines] == ["active", "gone", "gone"]


def test_shrink_by_count_and_its_refusals(job: tuple[Path, FakeSlurmClient], rest: FakeElastic,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, fake = job
    rest.busy = {"id": "op-9", "kind": "scale_out", "state": "running"}
    capsys.readouterr()
    assert main(["shrink", str(job_dir), "--engines", "1"]) == 2
    assert "another operation is in progress (op-9 scale_out running)" in capsys.readouterr().err
    rest.busy, rest.refuse = None, "removing 1 of the 1 serving engines would leave none"
    assert main(["shrink", str(job_dir), "--engines", "1"]) == 2
    assert "400: removing 1 of the 1 serving engines would leave none" in capsys.readouterr().err
    rest.refuse, rest.outcome = None, "failed"
    assert main(["shrink", str(job_dir), "--engines", "1", "--force"]) == 1
    assert "(scale_in) failed" in capsys.readouterr().out
    assert rest.posted("scale_in")[-1] == {"num_engines": 1, "force": True}
    assert not [a for a in fake.actions if a[0] == "cancel"]  # only --job cancels


def test_status_lists_grow_jobs_and_engines(job: tuple[Path, FakeSlurmClient], rest: FakeElastic,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, fake = job
    assert main(["grow", str(job_dir), "--engines", "1", "--partition", "preempt", "--preemptible"]) == 0
    fake.jobs["2000"] = [JobComponent("2000", 0, "RUNNING", "n7")]
    rest.elastic("scale_out", {"engine_urls": ["http://n7:4000"], "job": "2000"})
    capsys.readouterr()
    assert main(["status", str(job_dir)]) == 0
    out = capsys.readouterr().out
    assert "trainer  1000" in out and "grow jobs (" in out
    assert "2000       RUNNING     n7" in out and "1 engine(s) on 1 node(s), partition preempt, preemptible" in out
    assert "engines (http://127.0.0.1:" in out and "2, 2 active" in out
    lines = out.splitlines()
    assert any(line.split()[:4] == ["engine-1", "2000", "active", "v7"] and "http://n7:4000" in line for line in lines)
    assert any(line.split()[:3] == ["engine-0", "main", "active"] for line in lines)


def test_status_says_in_one_line_when_the_api_does_not_answer(job: tuple[Path, FakeSlurmClient],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    job_dir, _ = job
    capsys.readouterr()
    assert main(["status", str(job_dir)]) == 0
    out = capsys.readouterr().out
    assert "trainer  1000" in out and out.count("REST API:") == 1 and "has not started its REST API yet" in out
    write_cluster_json(job_dir / "cluster.json", {"job_id": 1000, "rest_url": "http://127.0.0.1:9",
                                                  "secret_file": str(job_dir / ".secret")})
    (job_dir / "federation").mkdir()
    (job_dir / "federation" / "grow_jobs.json").write_text(json.dumps({"grow_jobs": [
        {"job_id": "2000", "engines": 2, "nodes": 1, "submitted_at": 0}]}))
    assert main(["status", str(job_dir)]) == 0
    out = capsys.readouterr().out
    assert "2000       ended" in out and "REST API: http://127.0.0.1:9 does not answer" in out
