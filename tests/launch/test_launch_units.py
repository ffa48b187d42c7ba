"""Launch layer without a cluster: ports, container prefix, preflight, submit/status via the fake."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from relax_hpc.auth import JobSecret
from relax_hpc.driver.jobdir import JobDirBusyError, JobDirLock
from relax_hpc.launch import incluster
from relax_hpc.launch.container import container_prefix, env_file_text
from relax_hpc.launch.incluster import ray_start_command, write_cluster_json
from relax_hpc.launch.jobs import (
    PreflightError,
    find_job,
    job_status,
    pin_paths,
    submit_spec,
)
from relax_hpc.launch.preflight import gpus_of, preflight_problems
from relax_hpc.launch.slurm_client import FakeSlurmClient, JobComponent
from relax_hpc.ops.ports import (
    PORT_HIGH,
    PORT_LOW,
    PORT_SLOT_ENV,
    SLOTS_PER_JOB,
    ray_ports,
    ray_temp_dir,
)
from relax_hpc.ops.ray_node_env import RAY_NODE_ENV, apply_ray_node_env
from relax_hpc.spec import (
    ContainerSpec,
    JobSpec,
    SpecError,
    load_spec,
    parse_spec,
    spec_to_toml,
)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobspecs" / "tiny_slurm.toml"
QWEN = REPO / "jobspecs" / "qwen3_omni.toml"


def test_ports_differ_per_node_and_between_consecutive_jobs() -> None:
    used: dict[int, tuple[int, int]] = {}
    for job in (41, 42, 43):
        for slot in range(SLOTS_PER_JOB):
            for port in ray_ports(job, slot).all_ports():
                assert PORT_LOW <= port < PORT_HIGH  # below the ephemeral range
                assert port not in used, f"job {job} slot {slot} port {port} clashes with {used[port]}"
                used[port] = (job, slot)


def test_ports_are_a_pure_function_of_job_and_slot() -> None:
    assert ray_ports(123456, 2) == ray_ports(123456, 2)
    assert ray_ports(123456, 2) != ray_ports(123457, 2)
    with pytest.raises(ValueError, match="job id and node slot"):
        ray_ports(-1, 0)


def test_temp_dir_is_short_and_per_node() -> None:
    path = ray_temp_dir(987654321, 15)
    assert path == "/tmp/relax-987654321-15" and path != ray_temp_dir(987654321, 14)
    # Ray adds session_<date>_<time>_<pid>/sockets/plasma_store (~70 bytes); Unix sockets allow ~107.
    assert len(path) + 70 < 107


def test_ray_start_command_head_and_worker() -> None:
    ports = ray_ports(7, 0)
    head = ray_start_command("ray", ports, "/tmp/relax-7-0", "10.0.0.1", head_address=None, num_cpus=4,
                             num_gpus=8, resources={"trainer": 8.0})
    assert "--head" in head and f"--port={ports.gcs}" in head and '--resources={"trainer": 8.0}' in head
    assert "--num-gpus=8" in head and "--temp-dir=/tmp/relax-7-0" in head and "--block" in head
    worker = ray_start_command("ray", ray_ports(7, 1), "/tmp/relax-7-1", "10.0.0.2",
                               head_address="10.0.0.1:1", num_cpus=2, num_gpus=0, resources={"rollout": 1.0})
    assert "--address=10.0.0.1:1" in worker and "--head" not in worker
    # No log monitor: every driver of the job connects with log_to_driver=False.
    assert "--include-log-monitor=false" in head and "--include-log-monitor=false" in worker


def test_node_advertises_the_resources_of_colocated_components(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(incluster, "node_address", lambda node: "10.0.0.1")
    monkeypatch.setattr(incluster, "_busy_ports", lambda ip, ports: [])
    monkeypatch.setattr(incluster, "claim_private_dir", lambda path: None)
    monkeypatch.setattr(incluster, "_run_until_stopped", lambda cmd, temp_dir: started.append(cmd) or 0)
    # The node launcher exports the engines' port slot (and RAY_AUTH_MODE) into its own
    # environment; here that is the test process's, restored after the test. Left behind, it once
    # made a later local run on this worker plan its SGLang ports in job 7's block, where a
    # running Slurm job's Ray worker answered (2026-11-29).
    monkeypatch.setenv(PORT_SLOT_ENV, "")
    monkeypatch.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
    monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    args = ["node", "--job-id", "7", "--first-slot", "0", "--component", "trainer", "--resource", "4",
            "--num-cpus", "16", "--num-gpus", "4", "--head"]
    assert incluster.main(args) == 0 and incluster.main([*args, "--also-resource=rollout"]) == 0
    assert '--resources={"trainer": 4.0}' in started[0]
    assert '--resources={"rollout": 4.0, "trainer": 4.0}' in started[1]
    assert os.environ[PORT_SLOT_ENV] == "7:0"  # what the node's Ray workers inherit
    assert os.environ["RAY_prestart_worker_first_driver"] == "0"  # and its raylet: no idle workers


def test_the_ray_node_settings_leave_a_users_own_value() -> None:
    environ = {"RAY_prestart_worker_first_driver": "1"}
    apply_ray_node_env(environ)
    assert environ == {"RAY_prestart_worker_first_driver": "1"}
    apply_ray_node_env(empty := {})
    assert empty == RAY_NODE_ENV


def test_ray_temp_dir_is_made_private_and_a_foreign_one_refused(tmp_path: Path) -> None:
    fresh = tmp_path / "relax-7-0"
    assert incluster.claim_private_dir(fresh) is None and stat.S_IMODE(fresh.stat().st_mode) == 0o700
    opened = tmp_path / "relax-7-1"
    opened.mkdir()
    os.chmod(opened, 0o777)  # ours, left open by an earlier attempt: closed again
    assert incluster.claim_private_dir(opened) is None and stat.S_IMODE(opened.stat().st_mode) == 0o700
    (tmp_path / "relax-7-2").write_text("")
    assert "not a directory" in (incluster.claim_private_dir(tmp_path / "relax-7-2") or "")
    if os.getuid() == 0:  # only root can make a directory another user owns
        planted = tmp_path / "relax-7-3"
        planted.mkdir()
        os.chown(planted, 4242, 4242)
        problem = incluster.claim_private_dir(planted) or ""
        assert "belongs to uid 4242" in problem and "resubmit" in problem


def test_node_refuses_to_start_ray_in_a_dir_it_cannot_claim(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(incluster, "node_address", lambda node: "10.0.0.1")
    monkeypatch.setattr(incluster, "claim_private_dir", lambda path: f"its temp dir {path} belongs to uid 1")
    monkeypatch.setattr(incluster, "_run_until_stopped", lambda cmd, temp_dir: started.append(cmd) or 0)
    args = ["node", "--job-id", "7", "--first-slot", "0", "--component", "trainer", "--num-cpus", "2", "--head"]
    assert incluster.main(args) == incluster.EXIT_FAILED and not started
    assert "cannot start Ray: its temp dir /tmp/relax-7-0 belongs to uid 1" in capsys.readouterr().err


def test_cluster_json_is_owner_only(tmp_path: Path) -> None:
    target = tmp_path / "cluster.json"
    write_cluster_json(target, {"head_address": "h:1", "secret_file": "/j/.secret"})
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert json.loads(target.read_text())["secret_file"] == "/j/.secret"
    assert not (tmp_path / "cluster.json.tmp").exists()


def test_container_prefix_nv_only_for_gpu_components() -> None:
    c = ContainerSpec(image="/img/relax.sif", binds=["/models", "/data:/d:ro"], env=["A=1", "B=x y"])
    gpu, cpu = container_prefix(c, 8), container_prefix(c, 0)
    assert gpu[:2] == ["bash", "-c"] and gpu[3:5] == ["container", "--nv"] and "--nv" not in cpu
    assert gpu[-1] == "/img/relax.sif"
    assert "/data:/d:ro" in gpu and '"$JOB_DIR"' in gpu
    assert gpu[-3:-1] == ["--env-file", '"$JOB_DIR/container.env"'] and "'B=x y'" not in gpu
    assert "--env-file" not in container_prefix(dataclasses.replace(c, env=[]), 8)
    assert container_prefix(ContainerSpec(), 8) == []


def test_env_file_values_arrive_verbatim_and_run_nothing(tmp_path: Path) -> None:
    # Apptainer evaluates the file as POSIX shell with every assignment exported (set -a) and
    # command execution off; bash reading it the same way must give back each value as written.
    values = {"A": "1", "B": "x y, z", "C": "it's $(touch pwned) `id` $HOME \\n", "D": ""}
    text = env_file_text(ContainerSpec(image="i.sif", env=[f"{k}={v}" for k, v in values.items()]))
    env_file = tmp_path / "container.env"
    env_file.write_text(text)
    shown = subprocess.run(["bash", "-c", 'set -a; . "$0"; printf "%s\\0" "$A" "$B" "$C" "$D"', str(env_file)],
                           cwd=tmp_path, capture_output=True, text=True, check=True)
    assert shown.stdout.split("\0")[:-1] == list(values.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["container.env"]  # $(touch pwned) did not run


def test_spec_rejects_bad_container_env_and_grace_beyond_time_limit() -> None:
    text = TINY.read_text().replace('time = "00:30:00"', 'time = "1"', 1)  # 1 minute
    text += '\n[container]\nimage = "x.sif"\nenv = ["NO_EQUALS", "1BAD=2"]\n'
    with pytest.raises(SpecError) as error:
        parse_spec(text)
    report = str(error.value)
    assert "container.env" in report and "NAME=VALUE" in report
    assert "cluster.signal_grace_s = 60: must be below cluster.trainer.time = '1' (60 s)" in report


def test_spec_rejects_impossible_slurm_values() -> None:
    text = TINY.read_text().replace('time = "00:30:00"', 'time = "25:61"', 1).replace("nodes = 1", "nodes = 0", 1)
    with pytest.raises(SpecError) as error:
        parse_spec(text)
    report = str(error.value)
    assert "cluster.trainer.time" in report and "cluster.trainer.nodes = 0: must be in [1, 100000]" in report


NODES = [
    {"name": f"g{i}", "cpus": 64, "gres": "gpu:h100:8(S:0-1)", "partitions": ["gpu"]} for i in range(2)
] + [{"name": "c1", "cpus": 8, "gres": "", "partitions": ["cpu"]}]


def test_gpus_of_reads_gres() -> None:
    assert [gpus_of(n) for n in NODES] == [8, 8, 0]
    assert gpus_of({"gres": "gpu:4,gpu:a100:2"}) == 6


def test_preflight_accepts_a_fitting_spec_and_names_each_impossible_request() -> None:
    spec = load_spec(QWEN)
    assert preflight_problems(spec, NODES) == []
    too_many = [dict(n, gres="gpu:4") for n in NODES[:2]] + NODES[2:]
    problems = preflight_problems(spec, too_many)
    assert any("cluster.trainer.gpus_per_node = 8" in p and "at most 4 GPU" in p for p in problems)
    one_node = NODES[:1]
    problems = preflight_problems(spec, one_node)
    assert any("need 2 distinct nodes" in p for p in problems), problems
    missing = preflight_problems(spec, NODES[2:])
    assert missing[0].startswith("cluster.trainer.partition = 'gpu': no such partition; known: cpu")


def _with_partition(spec: JobSpec, component: str, partition: str, **changes: int) -> JobSpec:
    c = dataclasses.replace(getattr(spec.cluster, component), partition=partition, **changes)
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, **{component: c}))


def test_preflight_checks_each_name_of_a_partition_list() -> None:
    spec = load_spec(QWEN)  # trainer and rollout in "gpu", 8 GPUs per node each
    long_nodes = [{"name": "l1", "cpus": 64, "gres": "gpu:4", "partitions": ["gpu-long"]}]
    assert preflight_problems(_with_partition(spec, "trainer", "gpu,gpu-long"), NODES + long_nodes) == []
    # One unknown name is enough for sbatch to refuse the job: name it.
    problems = preflight_problems(_with_partition(spec, "trainer", "gpu,gpu-lng"), NODES + long_nodes)
    assert problems == [("cluster.trainer.partition = 'gpu,gpu-lng': no such partition 'gpu-lng'; "
                         "known: cpu, gpu, gpu-long")]
    # The job runs in one of the listed partitions: it must fit one; when none fits, each says why.
    too_big = _with_partition(spec, "trainer", "cpu,gpu-long")
    assert preflight_problems(too_big, NODES + long_nodes) == [
        ("cluster.trainer.gpus_per_node = 8: the nodes of partition 'cpu' carry at most 0 GPU(s); "
         "lower gpus_per_node or choose another partition"),
        "cluster.trainer.cpus_per_node = 64: the nodes of partition 'cpu' have at most 8 CPUs",
        ("cluster.trainer.gpus_per_node = 8: the nodes of partition 'gpu-long' carry at most 4 GPU(s); "
         "lower gpus_per_node or choose another partition"),
    ]
    # Distinct nodes are counted over the union of the listed partitions.
    both = _with_partition(_with_partition(spec, "trainer", "gpu,gpu-long", gpus_per_node=4), "rollout",
                           "gpu,gpu-long", gpus_per_node=4, nodes=3)
    assert preflight_problems(both, NODES + long_nodes) == [
        "cluster.rollout.nodes = 3: partition 'gpu' has only 2 node(s)",
        "cluster.rollout.nodes = 3: partition 'gpu-long' has only 1 node(s)",
        ("cluster.*.nodes: the components rollout, trainer need 4 distinct nodes together (Slurm never "
         "shares a node between components of one job), but partition 'gpu,gpu-long' has 3"),
    ]


def test_preflight_of_a_colocated_spec_needs_no_rollout_nodes() -> None:
    spec = load_spec(TINY)
    assert any("need 2 distinct nodes" in p for p in preflight_problems(spec, NODES[2:]))
    # cluster.rollout is not used when colocated: neither its partition nor a node of its own.
    rollout = dataclasses.replace(spec.cluster.rollout, partition="nowhere")
    colocated = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, colocate=True, rollout=rollout))
    assert preflight_problems(colocated, NODES[2:]) == []


def test_submit_writes_job_dir_and_refuses_before_sbatch(tmp_path: Path) -> None:
    spec_path = tmp_path / "t.toml"
    spec_path.write_text(TINY.read_text())
    fake = FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                         for i in range(3)])
    done = submit_spec(load_spec(spec_path), spec_path, fake, base=tmp_path)
    assert done.job_dir == tmp_path / "runs" / "tiny_slurm"
    assert (done.job_dir / "slurm_job_id").read_text().strip() == done.job_id == "1000"
    submitted = load_spec(done.job_dir / "spec.submit.toml")
    assert submitted.model.path == str(tmp_path / "runs/models/tiny-qwen3")  # absolute for other nodes
    assert submitted.job.output_dir == str(done.job_dir)
    assert fake.submitted[0][1] == done.script.read_text() and "#SBATCH hetjob" in fake.submitted[0][1]
    assert find_job(str(done.job_dir)) == ("1000", done.job_dir)
    assert find_job("1000", search_roots=[tmp_path / "runs"]) == ("1000", done.job_dir)

    fake_one_node = FakeSlurmClient(node_records=fake.node_records[:1])
    with pytest.raises(PreflightError, match="need 2 distinct nodes"):
        submit_spec(load_spec(spec_path), spec_path, fake_one_node, base=tmp_path)
    assert fake_one_node.submitted == []


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _one_node_per_component() -> FakeSlurmClient:
    return FakeSlurmClient(node_records=[{"name": f"n{i}", "cpus": 2, "gres": "", "partitions": ["debug"]}
                                         for i in range(2)])


def test_submit_writes_an_owner_only_job_dir_and_keeps_env_values_off_the_script(tmp_path: Path) -> None:
    spec_path = tmp_path / "t.toml"
    spec_path.write_text(TINY.read_text() + '\n[container]\nimage = "/img/x.sif"\n'
                         'env = ["WANDB_API_KEY=s3cret value", "HF_HUB_OFFLINE=1"]\n')
    old_umask = os.umask(0o022)  # a common default: without care every file would be world-readable
    try:
        done = submit_spec(load_spec(spec_path), spec_path, _one_node_per_component(), base=tmp_path)
    finally:
        os.umask(old_umask)
    job_dir = done.job_dir
    assert _mode(job_dir) == 0o700 and _mode(job_dir / "logs") == 0o700
    files = sorted(p.name for p in job_dir.iterdir() if p.is_file())
    assert files == [".lock", ".ray_token", ".secret", "container.env", "job.sbatch", "slurm_job_id",
                     "spec.original.toml", "spec.submit.toml"]
    assert {name: _mode(job_dir / name) for name in files} == dict.fromkeys(files, 0o600)
    # The job secret and Ray's token reach the job by path only, never in the script.
    secret = JobSecret.load(job_dir / ".secret")
    script_text = done.script.read_text()
    assert secret.hex() not in script_text and secret.token("ray") not in script_text
    assert 'RELAX_HPC_SECRET_FILE="$JOB_DIR/.secret"' in script_text
    assert 'RAY_AUTH_TOKEN_PATH="$JOB_DIR/.ray_token"' in script_text and "RAY_AUTH_MODE=token" in script_text
    assert (job_dir / "container.env").read_text().splitlines()[1:] == [
        "WANDB_API_KEY='s3cret value'", "HF_HUB_OFFLINE=1"]
    script = done.script.read_text()
    assert "s3cret" not in script and '--env-file "$JOB_DIR/container.env"' in script
    # Without env the file is gone: no earlier submission's secret stays behind unused.
    spec_path.write_text(TINY.read_text() + '\n[container]\nimage = "/img/x.sif"\n')
    submit_spec(load_spec(spec_path), spec_path, _one_node_per_component(), base=tmp_path)
    assert not (job_dir / "container.env").exists() and "--env-file" not in done.script.read_text()
    assert JobSecret.load(job_dir / ".secret") != secret  # each submission gets a fresh secret


def test_submit_keeps_the_mode_of_an_existing_job_dir(tmp_path: Path) -> None:
    job_dir = tmp_path / "runs" / "tiny_slurm"
    job_dir.mkdir(parents=True)
    job_dir.chmod(0o750)  # e.g. shared with the group on purpose
    spec_path = tmp_path / "t.toml"
    spec_path.write_text(TINY.read_text())
    submit_spec(load_spec(spec_path), spec_path, _one_node_per_component(), base=tmp_path)
    assert _mode(job_dir) == 0o750 and _mode(job_dir / "spec.submit.toml") == 0o600


def test_submit_refuses_a_job_dir_a_run_holds_and_writes_nothing(tmp_path: Path) -> None:
    spec_path = tmp_path / "t.toml"
    spec_path.write_text(TINY.read_text())
    job_dir = tmp_path / "runs" / "tiny_slurm"
    fake = _one_node_per_component()
    with JobDirLock(job_dir):  # what `relax-hpc run` holds for its whole run
        with pytest.raises(JobDirBusyError, match=rf"job directory {job_dir} is in use .*\(pid {os.getpid()} on host"):
            submit_spec(load_spec(spec_path), spec_path, fake, base=tmp_path)
        assert fake.submitted == [] and sorted(p.name for p in job_dir.iterdir()) == [".lock"]
    # Free again: submit takes the lock only to look, and leaves it for the job's own run.
    submit_spec(load_spec(spec_path), spec_path, fake, base=tmp_path)
    with JobDirLock(job_dir):
        pass


def test_submit_refuses_a_job_dir_whose_job_is_still_queued(tmp_path: Path) -> None:
    spec_path = tmp_path / "t.toml"
    spec_path.write_text(TINY.read_text())
    fake = _one_node_per_component()
    first = submit_spec(load_spec(spec_path), spec_path, fake, base=tmp_path)  # PENDING in the fake
    written = {p.name: p.read_bytes() for p in first.job_dir.iterdir() if p.is_file()}
    with pytest.raises(JobDirBusyError, match=rf"Slurm job {first.job_id}, still PENDING.*relax-hpc cancel {first.job_id}"):
        submit_spec(load_spec(spec_path), spec_path, fake, base=tmp_path)
    assert len(fake.submitted) == 1
    assert {p.name: p.read_bytes() for p in first.job_dir.iterdir() if p.is_file()} == written  # secret included
    fake.jobs[first.job_id] = [dataclasses.replace(c, state="COMPLETED") for c in fake.jobs[first.job_id]]
    second = submit_spec(load_spec(spec_path), spec_path, fake, base=tmp_path)
    assert second.job_id != first.job_id and len(fake.submitted) == 2


def test_submit_refuses_a_job_dir_slurm_cannot_name_before_writing(tmp_path: Path) -> None:
    spec_path = tmp_path / "t.toml"
    spec_path.write_text(TINY.read_text().replace('name = "tiny_slurm"', 'name = "tiny_slurm"\noutput_dir = "a\\\\b"'))
    fake = _one_node_per_component()
    with pytest.raises(ValueError, match="contains a backslash"):
        submit_spec(load_spec(spec_path), spec_path, fake, base=tmp_path)
    assert fake.submitted == [] and not (tmp_path / "a\\b").exists()


def test_find_job_reads_the_job_dir_from_the_output_pattern_with_percent(tmp_path: Path) -> None:
    job_dir = tmp_path / "100% done"
    job_dir.mkdir()
    (job_dir / "slurm_job_id").write_text("7\n")
    logs = str(job_dir).replace("%", "%%") + "/logs"
    for reported in (f"{job_dir}/logs/slurm-7.out", f"{logs}/slurm-%j.out"):  # expanded, or as submitted
        fake = FakeSlurmClient(jobs={"7": [JobComponent("7", 0, "RUNNING", "n1", stdout=reported)]})
        assert find_job("7", fake, search_roots=[tmp_path / "runs"]) == ("7", job_dir)


def test_status_reads_slurm_and_the_job_dir(tmp_path: Path) -> None:
    (tmp_path / "logs" / "restart-0").mkdir(parents=True)
    (tmp_path / "logs" / "restart-1").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.5}\n')
    fake = FakeSlurmClient(jobs={"7": [JobComponent("7", 0, "RUNNING", "n1"), JobComponent("8", 1, "RUNNING", "n2")]})
    status = job_status("7", tmp_path, fake)
    text = "\n".join(status.lines())
    # No spec.submit.toml to name the groups: numbers, not a guess that may be wrong.
    assert "group 0  7" in text and "group 1  8" in text and "RUNNING" in text
    assert "step 2, reward 0.500, restarts 1" in text
    gone = job_status("9", tmp_path, FakeSlurmClient(accounted={"9": [JobComponent("9", 0, "COMPLETED", "n1")]}))
    assert gone.source == "sacct" and gone.components[0][1].state == "COMPLETED"
    assert job_status("9", None, FakeSlurmClient()).source == "none"


def test_pin_paths_keeps_absolute_paths(tmp_path: Path) -> None:
    spec = load_spec(QWEN)
    pinned = pin_paths(spec, tmp_path)
    assert pinned.model.path == "/models/Qwen3-Omni-30B-A3B-Instruct"
    assert pinned.job.output_dir == str(tmp_path / "runs" / "qwen3_omni")


def test_status_names_the_groups_from_the_submitted_spec(tmp_path: Path) -> None:
    spec = load_spec(REPO / "tests/launch/specs/colocate_1node.toml")
    (tmp_path / "spec.submit.toml").write_text(spec_to_toml(spec))
    fake = FakeSlurmClient(jobs={"7": [JobComponent("7", 0, "RUNNING", "g1"), JobComponent("8", 1, "RUNNING", "g2"),
                                       JobComponent("9", 2, "RUNNING", "g3")]})
    names = [name for name, _ in job_status("7", tmp_path, fake).components]
    assert names == ["trainer", "forward", "group 2"]  # colocated: group 1 is forward, not rollout


def test_waiting_for_the_head_names_any_dead_srun_not_only_the_heads(tmp_path: Path) -> None:
    # The wait watches every srun that starts a Ray node; a worker node's srun that died (its port
    # taken) is reported as such, before the join timeout (tests/slurm/test_relax_jobs.py runs it).
    import socket
    import time

    dead = subprocess.Popen(["true"])
    dead.wait()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(RuntimeError) as raised:
        incluster._wait_for_head(f"127.0.0.1:{port}", time.monotonic() + 60, [dead.pid])
    message = str(raised.value)
    assert f"an srun that starts Ray nodes exited early (PID [{dead.pid}])" in message
    assert "within the timeout" not in message and "ray-*.log" in message


def _fake_client_commands(bin_dir: Path, script: str) -> None:
    """squeue and sbatch that die by SIGPIPE (as one did when slurmctld dropped the connection
    mid-request) until they have been called twice, then answer; calls counted in bin_dir/calls."""
    bin_dir.mkdir()
    for name, answer in (("squeue", '{"jobs": []}'), ("sbatch", "42")):
        path = bin_dir / name
        path.write_text(script.format(name=name, answer=answer, calls=bin_dir / "calls"))
        path.chmod(0o755)


def test_a_slurm_query_killed_by_a_signal_is_asked_again_and_an_sbatch_never(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from relax_hpc.launch import slurm_client
    from relax_hpc.launch.slurm_client import SlurmError, SubprocessSlurmClient

    _fake_client_commands(tmp_path / "bin", "#!/bin/sh\necho {name} >> {calls}\n"
                          "[ $(grep -c {name} {calls}) -ge 3 ] && {{ echo '{answer}'; exit 0; }}\nkill -PIPE $$\n")
    monkeypatch.setattr(slurm_client, "QUERY_RETRY_S", 0.01)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    client = SubprocessSlurmClient(env=env)

    assert client.job_components("7") == []  # the third squeue answered
    with pytest.raises(SlurmError, match=r"sbatch --parsable .* exited -13"):
        client.sbatch(tmp_path / "job.sh", tmp_path, env)
    calls = (tmp_path / "bin" / "calls").read_text().split()
    assert (calls.count("squeue"), calls.count("sbatch")) == (3, 1)


def test_only_signal_deaths_and_unreachable_controllers_count_as_transient() -> None:
    from relax_hpc.launch.slurm_client import transient_failure

    assert transient_failure(-13, "")
    assert transient_failure(1, "squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation")
    assert transient_failure(1, "scontrol: error: Unable to contact slurm controller (connect failure)")
    assert not transient_failure(1, "slurm_load_jobs error: Invalid job id specified")
