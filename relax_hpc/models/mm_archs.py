"""The multimodal architectures `relax-hpc make-tiny` can write, by name alone (no torch), so the
command line builds its --arch choices without loading the model code (relax_hpc/models/tiny_mm.py)."""

from __future__ import annotations

TINY_MM_ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni")


def is_omni(arch: str) -> bool:
    return arch.endswith("_omni")
