"""The shipped production specs: the job specs of a directory that name GPUs.

`tools/rehearse-production` rehearses each of them (`python -m relax_hpc.launch.production_specs
jobspecs` prints their paths, one a line); a spec is a production one when any of its Slurm
components asks for GPUs, whatever its devices are set to today.
"""

from __future__ import annotations

import sys
from pathlib import Path

from relax_hpc.spec import load_spec
from relax_hpc.spec.schema import JobSpec


def names_gpus(spec: JobSpec) -> bool:
    cluster = spec.cluster
    components = (cluster.trainer, cluster.rollout, cluster.forward)
    return any(c is not None and c.gpus_per_node > 0 for c in components)


def production_specs(directory: Path) -> list[Path]:
    return [path for path in sorted(directory.glob("*.toml")) if names_gpus(load_spec(path))]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m relax_hpc.launch.production_specs DIR", file=sys.stderr)
        return 2
    for path in production_specs(Path(argv[0])):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
