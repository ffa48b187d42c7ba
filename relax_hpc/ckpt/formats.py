"""Which training backend wrote a checkpoint directory, from its files alone (nothing unpickled).

The two backends write different layouts under the same ``step_<N>`` names:

- the torch backend (``CheckpointManager.save``): DCP files whose keys are ``model.<HF name>`` and
  ``optim.<...>``;
- the Megatron backend (``relax_hpc.backends.megatron_ckpt``): megatron-core's dist_checkpointing,
  DCP files keyed by Megatron's own names (``embedding.word_embeddings.weight``,
  ``decoder.layers.*``, ``optimizer.state.*``) plus ``common.pt`` and a ``metadata.json`` that
  names its ``sharded_backend``.

``checkpoint_backend`` tells them apart so that export (and resume) can pick the right reader,
and names what it found when it is neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from torch.distributed.checkpoint import FileSystemReader

__all__ = ["MEGATRON_METADATA_FILE", "CheckpointBackend", "UnknownCheckpointLayout", "checkpoint_backend"]

CheckpointBackend = Literal["torch", "megatron"]
MEGATRON_METADATA_FILE = "metadata.json"  # dist_checkpointing's, next to DCP's own .metadata
# Top-level names of a Megatron GPT model's and its optimizer's sharded state.
_MEGATRON_PREFIXES = ("embedding.", "decoder.", "output_layer.", "optimizer.")


class UnknownCheckpointLayout(ValueError):
    """The checkpoint's keys are neither the torch backend's nor the Megatron backend's."""


def checkpoint_backend(checkpoint_dir: Path) -> CheckpointBackend:
    """"megatron" for a dist_checkpointing directory, "torch" for ``CheckpointManager.save``'s.

    Raises UnknownCheckpointLayout, with some of its keys, for anything else (a checkpoint of
    another program, or a Megatron one that lost its metadata.json).
    """
    checkpoint_dir = Path(checkpoint_dir)
    marker = checkpoint_dir / MEGATRON_METADATA_FILE
    if marker.is_file():
        try:
            sharded = json.loads(marker.read_text()).get("sharded_backend")
        except (ValueError, AttributeError):
            sharded = None
        if sharded is None:
            raise UnknownCheckpointLayout(
                f"{marker} is not megatron-core's dist_checkpointing metadata (no sharded_backend); "
                "a checkpoint of the megatron backend holds it as written, so this directory was "
                "changed or was written by another program"
            )
        return "megatron"
    keys = list(FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata)
    if keys and all(key.split(".", 1)[0] in ("model", "optim") for key in keys):
        return "torch"
    sample = ", ".join(sorted(keys)[:4]) or "none"
    if any(key.startswith(_MEGATRON_PREFIXES) for key in keys):
        raise UnknownCheckpointLayout(
            f"{checkpoint_dir} holds Megatron-named tensors (e.g. {sample}) but no {MEGATRON_METADATA_FILE}: "
            "a megatron backend checkpoint always has one, so this one is incomplete; use another step_<N>"
        )
    raise UnknownCheckpointLayout(
        f"{checkpoint_dir} is not a relax-hpc checkpoint: its tensors (e.g. {sample}) are neither the torch "
        f"backend's (model.* and optim.*) nor the megatron backend's ({MEGATRON_METADATA_FILE} and Megatron "
        "names); export takes a step_<N> directory that a relax-hpc run wrote"
    )
