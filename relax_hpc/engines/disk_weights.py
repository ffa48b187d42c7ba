"""Weight versions as safetensors directories on a filesystem that the trainer and the engines share.

The writer puts version N into `<root>/v<N>/model.safetensors`, staged in a temp directory beside
it and renamed, so a directory named `v<N>` is always complete. An engine server loads one with
`POST /update_weights_from_disk` (SGLang's route): `SGLangEngine` writes for an SGLang server,
`RemoteEngineClient` (elastic/remote.py) for a `relax-hpc serve-engine --weights-root ROOT`, whose
`EngineServer` reads through `read_weights_dir`. Reading is bounded to the server's root: the
requested directory, and every file read in it, must resolve (symlinks followed) inside it.

    target = write_safetensors_dir(model.named_parameters(), root, version=3)   # root/v3
    named = read_weights_dir(resolve_weights_dir(str(target), root), root, parameter_shapes(engine))
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads where tensors are handled, not for the command line's FEDERATION_WEIGHTS
    import torch

__all__ = [
    "WEIGHTS_FILE",
    "WeightsDirError",
    "parameter_shapes",
    "prune_versions",
    "read_weights_dir",
    "resolve_weights_dir",
    "version_dir",
    "write_safetensors_dir",
]

# Where a job writes the versions for engines that joined over HTTP, under its job directory on
# the shared filesystem; a grow job's serve-engine runs with --weights-root JOBDIR/federation/weights.
FEDERATION_WEIGHTS = Path("federation") / "weights"
WEIGHTS_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"v(\d+)")
_SHOWN = 5  # names listed in an error; the count says how many more


class WeightsDirError(ValueError):
    """A weights directory that cannot be loaded; the message names the path and the problem."""


def version_dir(root: Path, version: int) -> Path:
    """Where version `version` lives under `root`."""
    return Path(root) / f"v{int(version)}"


def write_safetensors_dir(named_tensors: Iterable[tuple[str, torch.Tensor]], root: Path, version: int) -> Path:
    """Write the tensors to `root/v<version>/model.safetensors` through a temp directory and a
    rename (an existing `v<version>` is replaced); returns that directory."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share storage (tied embeddings): copy the second one.
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    if not tensors:
        raise ValueError("a weight update got no tensors")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = version_dir(root, version)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-v{version}-", dir=root))
    try:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def prune_versions(root: Path, keep: Path) -> list[Path]:
    """Delete the `v<N>` directories under `root` except `keep` and the newest one below it (an
    engine may still be loading that one); returns what was deleted. Directories numbered above
    `keep` are left over from an earlier run of the job that got further, and go too: their
    numbers will be reused for other weights."""
    match = _VERSION_DIR.fullmatch(keep.name)
    if match is None:
        raise ValueError(f"prune_versions keeps a version directory (v<N>), got {keep}")
    kept = int(match.group(1))
    versions = {}
    for path in Path(root).iterdir():
        match = _VERSION_DIR.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink():
            versions[int(match.group(1))] = path
    previous = max((v for v in versions if v < kept), default=None)
    gone = [path for v, path in versions.items() if v not in (kept, previous)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def resolve_weights_dir(model_path: str, root: Path) -> Path:
    """The directory `model_path` names, resolved with symlinks followed; relative paths are
    taken from `root`. WeightsDirError unless it is an existing directory inside `root`."""
    base = Path(root).resolve()
    path = Path(model_path)
    resolved = (path if path.is_absolute() else base / path).resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise WeightsDirError(f"model_path {model_path!r} resolves to {resolved}, which is not inside this server's "
                              f"weights root {base} (--weights-root); only directories under it are loaded")
    if not resolved.is_dir():
        what = "does not exist" if not resolved.exists() else "is not a directory"
        raise WeightsDirError(f"model_path {model_path!r} ({resolved}) {what}; send a directory of *.safetensors "
                              f"files under {base}, e.g. {base / 'v1'}")
    return resolved


def read_weights_dir(directory: Path, root: Path,
                     expected: Mapping[str, torch.Size] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the `*.safetensors` files in `directory`, in memory. `expected` (name ->
    shape, `parameter_shapes`) checks that each name exists and has its shape; a subset is fine
    (tied weights travel under one name). WeightsDirError names the file or tensors at fault."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    base = Path(root).resolve()
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsDirError(f"{directory} holds no *.safetensors file; a weight version is written as "
                              f"{directory / WEIGHTS_FILE}")
    named: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.resolve().is_relative_to(base):  # a symlink out of the root
            raise WeightsDirError(f"{file} links to {file.resolve()}, outside this server's weights root {base}")
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightsDirError(f"cannot read {file} as safetensors ({type(e).__name__}: {e}); the file is "
                                  "corrupt or incomplete: write it again (write_safetensors_dir)") from None
        twice = sorted(set(tensors) & set(named))
        if twice:
            raise WeightsDirError(f"{file} holds tensors another file in {directory} holds too: {_few(twice)}")
        named.update(tensors)
    if expected is not None:
        _check_against(named, expected, directory)
    return list(named.items())


def _check_against(named: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], where: Path) -> None:
    unknown = sorted(set(named) - set(expected))
    if unknown:
        raise WeightsDirError(f"{where} holds {len(unknown)} tensor(s) the served model does not have: "
                              f"{_few(unknown)}; are the trainer and this engine the same architecture?")
    wrong = [f"{name} {list(t.shape)} (the model's: {list(expected[name])})"
             for name, t in named.items() if t.shape != expected[name]]
    if wrong:
        raise WeightsDirError(f"{where} holds {len(wrong)} tensor(s) of the wrong shape: {_few(wrong)}; "
                              "are the trainer and this engine the same model size?")


def _few(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def parameter_shapes(engine: Any) -> dict[str, torch.Size] | None:
    """Name -> shape of what the engine's `update_weights` takes: its torch model's state dict
    (tied weights under each name); None for an engine without a torch `model` (nothing to check)."""
    model = getattr(engine, "model", None)
    import torch

    if not isinstance(model, torch.nn.Module):
        return None
    return {name: t.shape for name, t in model.state_dict().items()}
