"""`make_engine`: the rollout engine a spec's `[rollout] engine` names, built where it will run.
(`engine = "sglang"`: SGLang servers are started by the fleet instead, fleet.py and sglang/fleet.py.)

Roles call it inside their own process (a Ray actor), so the model never crosses the wire;
tests hand a role an engine instance (relax_hpc.engines.memory.ScriptedEngine) instead.
"""

from __future__ import annotations

import sys

from relax_hpc.engines.base import RolloutEngine

ENGINES: tuple[str, ...] = ("native", "sglang")


def require_engine(engine: str) -> None:
    """ValueError saying what to set when this version cannot run `[rollout] engine = engine`."""
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine = {engine!r}: allowed values are {', '.join(ENGINES)}")


def require_sglang_python(python: str | None) -> None:
    """ValueError saying what to do when `[rollout.sglang] python` (None: this interpreter)
    cannot run SGLang: checked before anything starts; the servers' start checks the rest."""
    import importlib.util
    import os

    if python is None:
        if importlib.util.find_spec("sglang") is None:
            raise ValueError(
                f'rollout.engine = "sglang" but {sys.executable} cannot import sglang and [rollout.sglang] '
                "python is not set: set it to the interpreter of an environment with SGLang 0.5.23 "
                '(tools/setup-sglang-cpu builds .venv-sglang: python = ".venv-sglang/bin/python"), '
                'or set [rollout] engine = "native"')
    elif not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(
            f"[rollout.sglang] python = {python!r} is not an executable file (a relative path is relative to "
            "the working directory); build the SGLang environment with tools/setup-sglang-cpu (or `make "
            'sglang-env`), or set [rollout] engine = "native"')


def check_engine_available(engine: str, sglang_python: str | None) -> None:
    """ValueError saying what to set when this machine cannot run `[rollout] engine` (checked
    before anything starts): an unknown kind, or SGLang without an interpreter that has it."""
    require_engine(engine)
    if engine == "sglang":
        require_sglang_python(sglang_python)


def make_engine(engine: str, model_path: str, dtype: str = "float32", device: str = "cpu",
                record_routing: bool = False) -> RolloutEngine:
    """The engine named by `[rollout] engine`; ValueError naming the allowed values otherwise.
    `record_routing`: generations carry their routed experts ([algorithm] routing_replay)."""
    require_engine(engine)
    if engine == "sglang":
        raise ValueError('make_engine: SGLang engines are server processes that the rollout role starts '
                         '(relax_hpc.engines.fleet.EngineFleet), not built in place')
    from relax_hpc.engines.native import NativeEngine

    return NativeEngine(model_path, dtype=dtype, device=device, record_routing=record_routing)
