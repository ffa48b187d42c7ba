"""`relax-hpc convert`: export a job's DCP checkpoint to a Hugging Face model directory.

Runs here (``export_checkpoint`` in this process, for either backend's checkpoint), or with
``on_slurm`` as a one-node Slurm job through submitit: a plain Python callable is exactly what
submitit is for (it pickles the call, submits it, and brings the result or the traceback back),
whereas the training job itself is a heterogeneous job that submitit cannot express and that
relax_hpc renders itself.
"""

from __future__ import annotations

from pathlib import Path

from relax_hpc.ckpt.layout import LATEST_FILE, parse_latest, step_dir_name
from relax_hpc.spec import load_spec

__all__ = ["checkpoint_dir_of", "convert_checkpoint", "export_checkpoint"]


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


def export_checkpoint(checkpoint: Path, model_dir: Path, out_dir: Path, *, overwrite: bool = False,
                      device: str = "cpu") -> Path:
    """Export a checkpoint of either backend to an HF directory at ``out_dir``; returns it.

    A torch backend checkpoint goes through ``relax_hpc.ckpt.export.export_hf`` (text, VL and
    omni models), a megatron backend one through megatron-bridge
    (``relax_hpc.backends.megatron_export``, built on ``device``); which wrote it is read from its
    files (``relax_hpc.ckpt.formats``), once it is known to be safe to read.
    """
    from relax_hpc.ckpt.export import check_export_paths, export_hf
    from relax_hpc.ckpt.formats import checkpoint_backend

    check_export_paths(checkpoint, model_dir, out_dir, overwrite=overwrite)
    if checkpoint_backend(Path(checkpoint)) == "megatron":
        from relax_hpc.backends.megatron_export import export_megatron_hf

        return export_megatron_hf(Path(checkpoint), Path(model_dir), Path(out_dir), overwrite=overwrite,
                                  device=device)
    return export_hf(Path(checkpoint), Path(model_dir), Path(out_dir), overwrite=overwrite)


def _export(checkpoint: str, model_dir: str, out_dir: str, device: str = "cpu") -> str:
    return str(export_checkpoint(Path(checkpoint), Path(model_dir), Path(out_dir), device=device))


def convert_checkpoint(job_dir: Path, out_dir: Path, step: int | None = None, on_slurm: bool = False,
                       partition: str | None = None, time_min: int = 30, device: str = "cpu") -> str:
    """Export; the output directory (local) or a line naming the submitted Slurm job."""
    spec = load_spec(job_dir / "spec.toml")
    checkpoint = checkpoint_dir_of(job_dir, step)
    args = (str(checkpoint), spec.model.path, str(out_dir.resolve()), device)
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
