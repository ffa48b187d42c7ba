"""`relax-hpc convert`: export a job's DCP checkpoint to a Hugging Face model directory.

Runs here (``export_hf`` in this process), or with ``on_slurm`` as a one-node Slurm job through
submitit: a plain Python callable is exactly what submitit is for (it pickles the call, submits
it, and brings the result or the traceback back), whereas the training job itself is a
heterogeneous job that submitit cannot express and that relax_hpc renders itself.
"""

from __future__ import annotations

from pathlib import Path

from relax_hpc.ckpt.layout import LATEST_FILE, parse_latest, step_dir_name
from relax_hpc.spec import load_spec

__all__ = ["checkpoint_dir_of", "convert_checkpoint"]


def checkpoint_dir_of(job_dir: Path, step: int | None) -> Path:
    """The checkpoint directory of ``step`` (None: the one ``checkpoints/latest`` names)."""
    root = job_dir / "checkpoints"
    if step is None:
        latest = root / LATEST_FILE
        found = parse_latest(latest.read_text()) if latest.is_file() else None
        if found is None:
            raise FileNotFoundError(f"{latest} is missing or unreadable: no complete checkpoint to convert; "
                                    "pass --step N for a step_N directory")
        step = found
    path = root / step_dir_name(step)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist; steps there: "
                                f"{', '.join(sorted(p.name for p in root.glob('step_*'))) or 'none'}")
    return path


def _export(checkpoint: str, model_dir: str, out_dir: str) -> str:
    from relax_hpc.ckpt.export import export_hf

    return str(export_hf(Path(checkpoint), Path(model_dir), Path(out_dir)))


def convert_checkpoint(job_dir: Path, out_dir: Path, step: int | None = None, on_slurm: bool = False,
                       partition: str | None = None, time_min: int = 30) -> str:
    """Export; the output directory (local) or a line naming the submitted Slurm job."""
    spec = load_spec(job_dir / "spec.toml")
    checkpoint = checkpoint_dir_of(job_dir, step)
    args = (str(checkpoint), spec.model.path, str(out_dir.resolve()))
    if not on_slurm:
        return f"wrote {_export(*args)}"
    import submitit

    executor = submitit.AutoExecutor(folder=str(job_dir / "submitit" / "%j"), cluster="slurm")
    params: dict[str, object] = {"timeout_min": time_min, "nodes": 1, "tasks_per_node": 1,
                                 "cpus_per_task": 2, "name": f"{spec.job.name}-convert"}
    if partition is not None:
        params["slurm_partition"] = partition
    executor.update_parameters(**params)
    job = executor.submit(_export, *args)
    return (f"submitted convert job {job.job_id} ({checkpoint.name} -> {out_dir}); "
            f"its logs: {job_dir}/submitit/{job.job_id}/")
