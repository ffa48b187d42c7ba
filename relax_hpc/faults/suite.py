"""The fault suite's driver: every fault in a run of its own (relax_hpc/faults/fault.py), or the
faults that can share a run in one (relax_hpc/faults/chain.py); the table, the last line
and OUT/faults.json. `relax-hpc faults` calls `run_suite`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from relax_hpc.faults.chain import one_run_steps, run_in_one_run, split_for_one_run
from relax_hpc.faults.fault import (
    INJECT_AFTER,
    MIN_STEPS,
    ONE_RUN,
    REPORT,
    Fault,
    FaultRow,
    cells,
    checked_spec_text,
    derive_spec,
    format_table,
    last_line,
    run_fault,
    suite_ok,
)
from relax_hpc.spec import JobSpec


def run_suite(spec: JobSpec, out: Path, faults: Sequence[Fault], steps: int, timeout_s: float,
              echo: Callable[[str], None] = print, in_one_run: bool = False) -> list[FaultRow]:
    """Every fault in turn, each in a run of its own; with `in_one_run` the faults that can share
    a run in one (relax_hpc/faults/chain.py) and the others each in its own. Prints a line
    per fault as it ends, then the table and the last line, and writes OUT/faults.json."""
    if steps < MIN_STEPS:
        raise ValueError(f"--steps {steps}: the suite needs at least {MIN_STEPS} (a fault after step "
                         f"{INJECT_AFTER}, a failed save and a later one that succeeds)")
    out = out.absolute()
    chained, alone = split_for_one_run(faults) if in_one_run else ([], list(faults))
    if chained:  # every derived spec valid before the first run
        checked_spec_text(derive_spec(spec, chained, out / ONE_RUN, one_run_steps(steps, len(chained))), chained)
    for fault in alone:
        checked_spec_text(derive_spec(spec, fault, out / fault.name, steps), fault)
    rows: list[FaultRow] = []
    if chained:
        echo(f"faults {', '.join(f.name for f in chained)} in one run of {one_run_steps(steps, len(chained))} "
             f"steps (job dir {out / ONE_RUN})")
        for row in run_in_one_run(spec, chained, out / ONE_RUN, steps, timeout_s):
            echo(f"  {row.fault} -> {cells(row)[1]}" + (f": {row.note}" if row.note else ""))
            rows.append(row)
    for fault in alone:
        echo(f"fault {fault.name}: {fault.what} (job dir {out / fault.name})")
        row = run_fault(spec, fault, out / fault.name, steps, timeout_s)
        echo(f"  -> {cells(row)[1]}" + (f": {row.note}" if row.note else ""))
        rows.append(row)
    for line in ["", *format_table(rows), last_line(rows)]:
        echo(line)
    write_report(out / REPORT, rows, steps)
    return rows


def write_report(path: Path, rows: Sequence[FaultRow], steps: int) -> None:
    from relax_hpc.ckpt.fs import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"steps": steps, "rows": [dataclasses.asdict(row) for row in rows], "last_line": last_line(rows),
              "ok": suite_ok(rows)}
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
