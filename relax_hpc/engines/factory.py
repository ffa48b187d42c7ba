"""`make_engine`: the rollout engine a spec's `[rollout] engine` names, built where it will run.

Roles call it inside their own process (a Ray actor), so the model never crosses the wire;
tests hand a role an engine instance (relax_hpc.engines.memory.ScriptedEngine) instead.
"""

from __future__ import annotations

from relax_hpc.engines.base import RolloutEngine

ENGINES: tuple[str, ...] = ("native", "sglang")


def require_engine(engine: str) -> None:
    """ValueError saying what to set when this version cannot run `[rollout] engine = engine`."""
    if engine == "sglang":
        raise ValueError(
            'rollout.engine = "sglang" is not available in this version of relax-hpc (only the native '
            'torch engine is); set [rollout] engine = "native"'
        )
    if engine != "native":
        raise ValueError(f"rollout.engine = {engine!r}: allowed values are {', '.join(ENGINES)}")


def make_engine(engine: str, model_path: str, dtype: str = "float32", device: str = "cpu") -> RolloutEngine:
    """The engine named by `[rollout] engine`; ValueError naming the allowed values otherwise."""
    require_engine(engine)
    from relax_hpc.engines.native import NativeEngine

    return NativeEngine(model_path, dtype=dtype, device=device)
