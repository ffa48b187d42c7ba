"""A full set of weights in one byte buffer laid out bucket by bucket, as the channel sends them.

The channel moves bytes fastest when neither side copies: the sender broadcasts each bucket
straight out of a `FlatWeights` snapshot (taking the snapshot is the one copy the trainer must
make anyway, so the next training step can change its weights while the bytes move), and a
receiver broadcasts each bucket straight into a `FlatWeights` whose parameters its engine then
uses in place (`bind_module`: every parameter becomes a view into the buffer, no copy).

Receivers keep two: the engine runs on one while the next version arrives in the other, and the
two trade places at the engine's batch boundary (`WeightInbox` in endpoints.py).

A buffer lives where its holder needs the whole model, not necessarily on the wire's device: the
trainer's snapshot and the buffers of a rollout role whose engines are servers of their own
(SGLang) stay in host memory (pinned when CUDA is there, so the per-bucket copies to and from the
GPU are direct), and only a bucket or two at a time go through the GPU (`_broadcast_staged` in
channel.py). A whole-model buffer on a GPU is kept only where an engine computes with it in place.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from relax_hpc.weights.layout import Bucket, aligned, plan_buckets, view_param


def _signature(buckets: Sequence[Bucket]) -> tuple:
    # The direct flag only says how a loose tensor was sent; in a flat buffer every bucket is a slice.
    return tuple((b.nbytes, b.params) for b in buckets)


class FlatWeights:
    """Weights held in one uint8 buffer, each bucket at an aligned offset, each parameter a view."""

    def __init__(self, buckets: Sequence[Bucket], device: str | torch.device = "cpu", pin: bool = False) -> None:
        self.buckets = tuple(buckets)
        self.device = torch.device(device)
        self.starts: list[int] = []
        total = 0
        for b in self.buckets:
            self.starts.append(total)
            total = aligned(total + b.nbytes)
        # Pinned host memory only where a GPU copies to or from it (pinning needs CUDA).
        pinned = pin and self.device.type == "cpu" and torch.cuda.is_available()
        self.buffer = torch.empty(total, dtype=torch.uint8, device=self.device, pin_memory=pinned)
        self._signature = _signature(self.buckets)

    @classmethod
    def snapshot(
        cls, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, direct_bytes: int,
        device: str | torch.device = "cpu", reuse: FlatWeights | None = None, pin: bool = False,
    ) -> FlatWeights:
        """Copy `named_tensors` into a flat buffer laid out as the channel would bucket them.

        `reuse` is filled instead of allocating when its layout and device fit (the usual case:
        the same model every step); it must not be on the wire or in use meanwhile. `pin`: a host
        buffer that a GPU copies from is allocated in pinned memory.
        """
        named = list(named_tensors)
        buckets = plan_buckets(named, bucket_bytes, direct_bytes)
        flat = reuse if reuse is not None and reuse.fits(buckets, device) else cls(buckets, device, pin)
        flat.copy_from(named)
        return flat

    def fits(self, buckets: Sequence[Bucket], device: str | torch.device | None = None) -> bool:
        """True when `buckets` (e.g. a received header's) describe this buffer's layout."""
        same_device = device is None or torch.device(device) == self.device
        return same_device and _signature(buckets) == self._signature

    @property
    def nbytes(self) -> int:
        """The bytes this buffer holds (alignment included)."""
        return self.buffer.numel()

    def bucket(self, k: int) -> torch.Tensor:
        """Bucket `k`'s bytes: a uint8 view to broadcast from or receive into."""
        return self.buffer[self.starts[k] : self.starts[k] + self.buckets[k].nbytes]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter as a typed, shaped view into the buffer, in bucket order."""
        return [(p.name, view_param(self.bucket(k), p)) for k, b in enumerate(self.buckets) for p in b.params]

    def copy_from(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        views = dict(self.named())
        given = {name for name, _ in named_tensors}
        if given != set(views):
            raise ValueError(
                f"weights do not match this buffer's layout (missing {sorted(set(views) - given)[:5]}, "
                f"unknown {sorted(given - set(views))[:5]}); take a new snapshot"
            )
        with torch.no_grad():
            for name, tensor in named_tensors:
                views[name].copy_(tensor.detach())


def bind_module(module: torch.nn.Module, flat: FlatWeights) -> bool:
    """Make every tensor of `module.state_dict()` a view into `flat` (no copy); True when done.

    Returns False and changes nothing unless `flat` holds every one of them with the same
    dtype, shape and device (the caller then copies instead). Tied parameters appear under
    each of their names and end up on one of their views; both names keep sharing it.
    """
    views = dict(flat.named())
    own = module.state_dict(keep_vars=True)
    for name, tensor in own.items():
        view = views.get(name)
        if (
            view is None or view.dtype != tensor.dtype or view.shape != tensor.shape
            or view.device != tensor.device
        ):
            return False
    with torch.no_grad():
        for name, tensor in own.items():
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if attr in owner._parameters and owner._parameters[attr] is not None:
                owner._parameters[attr].data = views[name]
            elif attr in owner._buffers:
                owner._buffers[attr] = views[name]
            else:  # a state-dict entry of a custom module: copy it, the rest stays bound
                tensor.copy_(views[name])
    return True


def copy_into_module(module: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], who: str) -> None:
    """Copy weights into `module`'s own tensors in place (cast to their dtype and device): the
    fallback where `bind_module` cannot bind. `who` names the receiving model in the error for
    a weight it does not have."""
    own = module.state_dict()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in own:
                raise KeyError(
                    f"weight update names '{name}', which the {who} model does not have; "
                    "are the trainer and the engine loading the same architecture?"
                )
            own[name].copy_(tensor.to(own[name].device, own[name].dtype))
