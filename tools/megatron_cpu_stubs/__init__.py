"""Import-only stand-ins that let megatron-bridge import on a machine without GPU libraries.

Test and tool code only; relax_hpc itself never imports this. megatron-bridge 0.3.1 and
megatron-core 0.16.1 import two GPU-only packages unconditionally in a few modules, although
the code paths we use (the local layer spec, AutoBridge weight conversion) never call them:

- ``transformer_engine``: ``megatron/bridge/peft/lora_layers.py`` and ``peft/lora.py``
  (``import transformer_engine.pytorch as te``; TE classes are used as base classes and in
  isinstance checks). transformer-engine has no CPU wheel.
- ``triton``: ``megatron/core/inference/contexts/attention_context/triton/tensor_ops.py``
  (``@triton.jit`` kernels at module level). The real triton wheel imports on a CPU machine
  but is about 1 GB, so a stand-in is cheaper.

Why scoped and not a plain fake package on sys.path: many megatron-core modules probe
``import transformer_engine`` / ``import triton`` in ``try`` blocks and switch to TE or Triton
code paths when the import succeeds. A stand-in that any module can see flips those switches
(tried: ``HAVE_TE`` turned on in ``gpt_layer_specs``, ``attention``, ``transformer_block`` and
seven more modules). Here a stand-in is present in ``sys.modules`` only while one of the
modules listed in ``_STAND_INS_FOR`` executes, and that module's other imports run first,
without it, so no other module ever sees it. Every stand-in class raises when instantiated,
so a code path that really needs TE or Triton fails loudly instead of computing something wrong.

Usage (before the first ``import megatron.bridge``), in the environment tools/setup-megatron-cpu
builds, which copies this package into its site-packages (nowhere else)::

    import megatron_cpu_stubs
    megatron_cpu_stubs.install()
    from megatron.bridge import AutoBridge
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

_TE_NOTE = "transformer_engine stand-in (tools/megatron_cpu_stubs): TE is not installed"
_TRITON_NOTE = "triton stand-in (tools/megatron_cpu_stubs): triton is not installed"


def _unavailable_class(name: str, note: str) -> type:
    """A class that can be subclassed and used in isinstance checks but never instantiated."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{note}; {name} cannot be used on this machine")

    import torch

    return type(name, (torch.nn.Module,), {"__init__": __init__})


def _module(name: str, attrs: dict[str, Any], is_package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    if is_package:
        module.__path__ = []  # type: ignore[attr-defined]  # ``import name.sub`` resolves
    return module


@functools.cache  # one set per process: lora.py and lora_layers.py see the same classes
def _transformer_engine_modules() -> dict[str, types.ModuleType]:
    @contextlib.contextmanager
    def fp8_autocast(enabled: bool = False, **kwargs: Any) -> Iterator[None]:
        if enabled:
            raise RuntimeError(f"{_TE_NOTE}; fp8_autocast(enabled=True) is not available")
        yield

    op_names = (
        "Sequential", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Linear", "Dropout",
        "ConstantScale", "AddExtraInput",
    )  # fmt: skip
    ops = _module(
        "transformer_engine.pytorch.ops",
        {name: _unavailable_class(name, _TE_NOTE) for name in op_names},
    )
    pytorch = _module(
        "transformer_engine.pytorch",
        {
            "Linear": _unavailable_class("Linear", _TE_NOTE),
            "LayerNormLinear": _unavailable_class("LayerNormLinear", _TE_NOTE),
            "ops": ops,
            "fp8_autocast": fp8_autocast,
        },
        is_package=True,
    )
    te = _module(
        "transformer_engine",
        {"__version__": "0.0.0+stand-in", "pytorch": pytorch},
        is_package=True,
    )
    return {m.__name__: m for m in (te, pytorch, ops)}


@functools.cache
def _triton_modules() -> dict[str, types.ModuleType]:
    def jit(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        def wrap(kernel: Callable[..., Any]) -> Callable[..., Any]:
            def unavailable(*args: Any, **kw: Any) -> None:
                raise RuntimeError(f"{_TRITON_NOTE}; kernel {kernel.__name__} cannot run")

            unavailable.__name__ = kernel.__name__
            return unavailable

        return wrap(fn) if fn is not None else wrap

    # Kernel signatures annotate arguments with ``tl.constexpr``; nothing else runs at import.
    language = _module("triton.language", {"constexpr": type("constexpr", (), {})})
    triton = _module(
        "triton",
        {"__version__": "0.0.0+stand-in", "jit": jit, "language": language},
        is_package=True,
    )
    return {m.__name__: m for m in (triton, language)}


# Module that imports a GPU-only package unconditionally -> builder of that package's stand-in.
_STAND_INS_FOR: dict[str, Callable[[], dict[str, types.ModuleType]]] = {
    "megatron.bridge.peft.lora_layers": _transformer_engine_modules,
    "megatron.bridge.peft.lora": _transformer_engine_modules,
    "megatron.core.inference.contexts.attention_context.triton.tensor_ops": _triton_modules,
}


def _is_installed(package: str) -> bool:
    return package in sys.modules or importlib.util.find_spec(package) is not None


def _import_dependencies_first(source: str, skip: set[str]) -> None:
    """Import every top-level import of ``source`` except the packages in ``skip``.

    Run before a stand-in is registered, so that those modules see the real environment.
    """
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in skip:
                continue
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as error:
                if error.name != name:  # ``from pkg import attr``: attr is not a module
                    raise


class _ScopedStandInLoader(importlib.abc.Loader):
    def __init__(
        self, real: importlib.abc.Loader, build: Callable[[], dict[str, types.ModuleType]]
    ):
        self._real = real
        self._build = build

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, get_resource_reader...: the real loader answers.
        return getattr(self._real, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        stand_ins = self._build()
        packages = {name.split(".")[0] for name in stand_ins}
        if all(_is_installed(package) for package in packages):
            self._real.exec_module(module)  # the real package is there: use it
            return
        source = self._real.get_source(module.__name__)  # type: ignore[attr-defined]
        _import_dependencies_first(source, skip=packages)
        added = [name for name in stand_ins if name not in sys.modules]
        sys.modules.update({name: stand_ins[name] for name in added})
        try:
            self._real.exec_module(module)
        finally:
            for name in added:
                sys.modules.pop(name, None)


class _ScopedStandInFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        build = _STAND_INS_FOR.get(fullname)
        if build is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ScopedStandInLoader(spec.loader, build)
                return spec
        return None


def install() -> None:
    """Register the scoped stand-ins; call before the first ``import megatron.bridge``."""
    already = [name for name in _STAND_INS_FOR if name in sys.modules]
    if already:
        raise RuntimeError(
            f"megatron_cpu_stubs.install() must run before {already[0]} is imported; "
            "call it at the top of the test or tool, before importing megatron.bridge"
        )
    if not any(isinstance(finder, _ScopedStandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ScopedStandInFinder())
