"""The job specs that ship inside the package, so an installed wheel can run them from anywhere.

    relax-hpc run tiny_local               # also: tiny_local.toml, jobspecs/tiny_local.toml
    relax-hpc render tiny_slurm            # tiny_slurm_fwd: a third component for ActorFwd + Reference

This folder holds the real files; the checkout's jobspecs/tiny_{local,slurm,slurm_fwd}.toml and
jobspecs/data/tiny_sum.jsonl are symlinks to them. The folder mirrors the checkout's layout
(``jobspecs/<name>.toml``, ``jobspecs/data/...`` under relax_hpc/), so the relative paths
written in these specs hold from the checkout root and from the installed package alike.

A spec argument that is an existing file is always that file. Otherwise an embedded name
selects the packaged copy, and its relative ``[data] path`` is taken from the package
(outputs and the tiny model still go under the current directory).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from relax_hpc.spec import JobSpec

__all__ = ["embedded_dir", "embedded_names", "resolve_spec_path", "with_embedded_inputs"]


def embedded_dir() -> Path:
    """This folder: the installed (or checked-out) relax_hpc/jobspecs/."""
    return Path(__file__).resolve().parent


def embedded_names() -> list[str]:
    return sorted(p.stem for p in embedded_dir().glob("*.toml"))


def _embedded_name(arg: str) -> str | None:
    name = Path(arg).name.removesuffix(".toml")
    # A bare name, NAME.toml, or the checkout-relative jobspecs/NAME.toml of the README.
    if arg in (name, f"{name}.toml", f"jobspecs/{name}.toml") and name in embedded_names():
        return name
    return None


def resolve_spec_path(arg: str) -> str:
    """The spec file a command-line argument names: the file itself, else the embedded copy.

    Anything else comes back unchanged, for load_spec to report.
    """
    if Path(arg).is_file():
        return arg
    name = _embedded_name(arg)
    return arg if name is None else str(embedded_dir() / f"{name}.toml")


def with_embedded_inputs(spec: JobSpec, spec_path: str | Path) -> JobSpec:
    """``spec`` with a relative ``[data] path`` taken from the package, if it is an embedded spec."""
    if Path(spec_path).absolute().parent != embedded_dir() or Path(spec.data.path).is_absolute():
        return spec
    data = dataclasses.replace(spec.data, path=str(embedded_dir().parent / spec.data.path))
    return dataclasses.replace(spec, data=data)
