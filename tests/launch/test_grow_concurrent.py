"""Two grow submissions at once (`relax-hpc grow` and the driver's grow policy both call
submit_grow) keep both records and each submits its own script (real threads, real files)."""

from __future__ import annotations

import threading
from pathlib import Path

from relax_hpc.launch.federation import grow_request, read_grow_jobs, submit_grow
from relax_hpc.launch.slurm_client import FakeSlurmClient
from relax_hpc.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


class OverlappingSlurm(FakeSlurmClient):
    """sbatch of the first caller waits until the second one has started (or gave up waiting):
    without a lock both are inside sbatch with their scripts at once."""

    def __init__(self) -> None:
        super().__init__(next_id=10)
        self.entered = threading.Event()
        self.first = True
        self.guard = threading.Lock()

    def sbatch(self, script: Path, cwd: Path, env: dict[str, str]) -> str:
        with self.guard:
            first, self.first = self.first, False
        text = script.read_text()
        if first:
            self.entered.wait(timeout=1.0)  # the other submission gets in now, if nothing stops it
        else:
            self.entered.set()
        assert script.read_text() == text  # nobody replaced the script sbatch is reading
        with self.guard:
            return super().sbatch(script, cwd, env)


def test_concurrent_grow_submissions_keep_both_records(tmp_path: Path) -> None:
    spec = load_spec(REPO / "jobspecs" / "tiny_slurm.toml")
    client = OverlappingSlurm()
    requests = [grow_request(tmp_path, "4242", spec, engines=n) for n in (1, 2)]
    ids: list[str] = []
    threads = [threading.Thread(target=lambda r=r: ids.append(submit_grow(r, client, tmp_path))) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs = read_grow_jobs(tmp_path)
    assert sorted(j["job_id"] for j in jobs) == sorted(ids) == ["10", "11"]
    engines_of = {j["job_id"]: j["engines"] for j in jobs}
    for job_id, text in zip(("10", "11"), (entry[1] for entry in client.submitted[:2]), strict=True):
        assert f"--engines {engines_of[job_id]} " in text  # each job got the script of its own request
    assert not list((tmp_path / "federation").glob("grow-next*"))
