"""Import-only stand-in for `sgl_kernel` (SGLang's compiled kernels), for SGLang on CPU.

No CPU wheel of sgl_kernel / sglang-kernel is published, yet SGLang imports it on the CPU path
(`SGLANG_USE_CPU_ENGINE=1`) in modules it loads for every model. This package lets those imports
succeed: any name, and any submodule (`sgl_kernel.kvcacheio`, `sgl_kernel.flash_attn`, ...), is a
stand-in that raises NotImplementedError naming the kernel when it is called. The server runs
with `--attention-backend torch_native --sampling-backend pytorch`, which call none of them.

Copied into the SGLang environment's site-packages by tools/setup-sglang-cpu; never put it on
the path of relax-hpc itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+cpu-stand-in"
STAND_IN = True


class MissingKernel:
    """A kernel that is not there: importable, falsy, and raising when called or used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._name} is an sgl_kernel stand-in (tools/sglang_cpu_stubs); this SGLang "
            "environment has no compiled kernels. Run the server with --device cpu "
            "--attention-backend torch_native --sampling-backend pytorch."
        )

    def __getattr__(self, attr: str) -> MissingKernel:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingKernel(f"{self._name}.{attr}")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


class StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> MissingKernel:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingKernel(f"{self.__name__}.{attr}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every `sgl_kernel.<anything>` submodule as a StandInModule."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name)
        module.__path__ = []  # a package, so that deeper submodules import too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def __getattr__(attr: str) -> MissingKernel:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return MissingKernel(f"{__name__}.{attr}")


if not any(isinstance(finder, _SubmoduleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())


# Some SGLang model files look CPU kernels up as `torch.ops.sgl_kernel.<name>` when they are
# imported (SGLang's Qwen-VL processor module imports them all, so without these names no VL
# processor registers: "No processor registered for architecture"). Their schemas are defined
# here, never implemented: the CPU server's paths for the tiny models do not call them.
CPU_OP_NAMES = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


def _define_cpu_op_names() -> Any:
    import torch

    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in CPU_OP_NAMES:
        if not hasattr(torch.ops.sgl_kernel, name):
            library.define(f"{name}(Tensor x) -> ()")
    return library  # the definitions live as long as this object


_CPU_OPS = _define_cpu_op_names()
