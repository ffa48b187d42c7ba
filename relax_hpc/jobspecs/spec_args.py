"""The spec arguments every command that reads a job spec shares: SPEC... and --set KEY=VALUE.

    relax-hpc run base.toml overlay.toml --set train.lr=1e-6 --set rollout.num_engines=4

Files merge left to right and the overrides go on top (relax_hpc/spec/compose.py); each SPEC may
be a file or the name of a spec shipped in this package. It lives in jobspecs, below launch, so that the
commands of relax_hpc/cli/main.py and relax_hpc/cli/slurm_commands.py share it; kept free of torch
and Ray, like the commands that only read specs.

    add_spec_arguments(parser)        # in a command's parser
    composed = load_spec_args(args)   # in its handler: .spec, .label, .origins, .original_text()
"""

from __future__ import annotations

import argparse
import dataclasses

from relax_hpc.jobspecs import resolve_spec_path, with_embedded_inputs
from relax_hpc.spec.compose import ComposedSpec, compose_spec

__all__ = ["add_spec_arguments", "load_spec_args"]

SPECS_HELP = ("the job spec: a TOML file, or the name of a spec shipped in the package (tiny_local, "
              "tiny_slurm); several are merged left to right, tables key by key, a later value replacing "
              "an earlier one")
SET_HELP = ("set one key on top of the spec files, as a TOML value (--set train.lr=1e-6 --set "
            "cluster.trainer.nodes=2; text that is not a TOML value is a string); repeatable, later wins")


def add_spec_arguments(parser: argparse.ArgumentParser, optional: bool = False, help: str = SPECS_HELP) -> None:
    """SPEC [SPEC ...] (none allowed when ``optional``) and --set KEY=VALUE, repeatable."""
    parser.add_argument("spec", nargs="*" if optional else "+", metavar="SPEC", help=help)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


def load_spec_args(args: argparse.Namespace) -> ComposedSpec:
    """The spec the parsed arguments name; SpecError listing every problem, each with its file and
    line or its --set.

    An embedded spec's relative ``[data] path`` is taken from the package when that file gave it.
    """
    composed = compose_spec([resolve_spec_path(path) for path in args.spec], args.overrides)
    origin = composed.origins.given().get("data.path")
    if origin is None or origin.override is not None:
        return composed  # a --set path is the user's, relative to where they are
    return dataclasses.replace(composed, spec=with_embedded_inputs(composed.spec, origin.source))
