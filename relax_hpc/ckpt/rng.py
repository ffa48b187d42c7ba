"""Capture and restore every random number generator a training process uses.

The state is a dict of tensors and plain Python values only, so it can be written with
``torch.save`` and read back with ``torch.load(weights_only=True)`` (no pickled code).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """Snapshot the torch CPU, CUDA (when available), numpy and Python ``random`` states."""
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(bit_generator),
            # int64 because torch has only partial uint32 support; values fit exactly.
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": int(version), "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back a state from :func:`capture_rng_state`.

    A CUDA state is restored for as many devices as both the snapshot and this process
    have; without CUDA it is ignored, so a GPU checkpoint still resumes on CPU.
    """
    missing = [key for key in ("torch", "numpy", "python") if key not in state]
    if missing:
        raise ValueError(f"RNG state is missing {missing}; expected a dict from capture_rng_state()")
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["bit_generator"],
            np.asarray(np_state["keys"].numpy(), dtype=np.uint32),
            int(np_state["pos"]),
            int(np_state["has_gauss"]),
            float(np_state["cached_gaussian"]),
        )
    )
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(py_state["internal"]), py_state["gauss_next"]))
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        for device, device_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)
