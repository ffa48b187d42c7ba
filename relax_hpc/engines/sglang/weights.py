"""How a new weight version reaches an SGLang server: `DistributedWeightPush` over a
torch.distributed group whose rank 0 is this process, or `TensorWeightPush` through shared
memory (a server on this host; the colocated default).

SGLang's `/init_weights_update_group` makes the server's ranks join a group (ranks 1..world-1)
whose store rank 0 hosts; `/update_weights_from_distributed` then names the tensors of one bucket
and the server receives them by broadcast from rank 0. This module is rank 0: it binds the
store's listening socket to one address (the one the server reaches it by, not every interface),
forms the group as SGLang's own `init_custom_process_group` does (a group outside the default
one, hence torch's private `_new_process_group_helper`), and sends the buckets.

    push = DistributedWeightPush(host="127.0.0.1", port=0, world_size=2, backend="gloo",
                                 bucket_bytes=512 << 20)
    engine = SGLangEngine(url, model_path, weight_push=push)   # engine.update_weights uses it
    ...
    push.close(engine)

One push object serves one server life: a restarted server needs a new group (a new object).
The rendezvous store is not authenticated (torch's TCPStore has no secret): docs/security.md.

`TensorWeightPush` sends `/update_weights_from_tensor` with each bucket pickled as SGLang's own
client does (`ForkingPickler`: the tensors' storage moves to shared memory and only its name
travels), under torch's "file_system" sharing strategy, which this process then keeps: the
default one passes file descriptors over a socket that SGLang's scheduler cannot authenticate
to ("digest sent was rejected"). A pickle from this torch loads in the server's newer one.

SGLang's `load_weights` reads weights by their names in the model's checkpoint, whatever the
update route. transformers 5 renames some on load (Qwen2.5-VL's `model.*` becomes
`model.language_model.*`, a Qwen3-Omni thinker loses `thinker.`, MoE experts are fused into
3-D tensors), so `checkpoint_named` turns the trainer's names back before any push; an unknown
name would otherwise stop the server (KeyError in its scheduler).
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import itertools
import logging
import os
import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch

from relax_hpc.engines.sglang import requests as requests

__all__ = [
    "DistributedWeightPush", "RequestSender", "TensorWeightPush", "WeightPush", "buckets", "checkpoint_named",
]

log = logging.getLogger(__name__)
_GROUPS = itertools.count()  # a fresh group name per group this process forms


class RequestSender(Protocol):
    """What a push needs of the engine: one HTTP request, no retry (`SGLangEngine.post`)."""

    base_url: str

    def post(self, path: str, body: Any) -> Any: ...


class WeightPush(Protocol):
    """Replaces a server's weights; called between /begin_weight_update and /end_weight_update."""

    def push(self, server: RequestSender, named: list[tuple[str, torch.Tensor]], version: int) -> None: ...

    def close(self, server: RequestSender | None) -> None: ...


# model_type -> (trainer prefix, checkpoint prefix), first match wins: the renames transformers 5
# makes on load, undone (checked against relax_hpc.models.hf.checkpoint_state_dict by the tests).
# Families absent here keep their names (Qwen3-VL's checkpoints use the in-memory ones).
_CHECKPOINT_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
    "qwen3_omni_moe": (("model.language_model.", "thinker.model."), ("model.", "thinker."),
                       ("lm_head.", "thinker.lm_head.")),
}
_FUSED_EXPERTS = ("qwen3_omni_moe",)  # families whose checkpoints store one tensor per expert


def checkpoint_named(named: Iterable[tuple[str, torch.Tensor]], model_type: str) -> list[tuple[str, torch.Tensor]]:
    """`named` (a transformers-5 model's state-dict names) with the names and layout of the
    model's checkpoint, which SGLang's loaders read. Names already in checkpoint form pass
    unchanged, so a backend that exports checkpoint names is not affected."""
    prefixes = _CHECKPOINT_PREFIXES.get(model_type, ())
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        for ours, theirs in prefixes:
            if name.startswith(ours):
                name = theirs + name[len(ours):]
                break
        if model_type in _FUSED_EXPERTS and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            out.extend(_split_experts(name, tensor))
        else:
            out.append((name, tensor))
    return out


def _split_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers 5's fused experts -> one nn.Linear weight per expert: `gate_up_proj`
    (experts, 2 * intermediate, hidden) holds the gate rows, then the up rows; `down_proj` is
    (experts, hidden, intermediate)."""
    stem, kind = name.rsplit(".", 1)
    if kind == "down_proj":
        return [(f"{stem}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    half = tensor.shape[1] // 2
    return [(f"{stem}.{e}.{part}_proj.weight", tensor[e, rows])
            for e in range(tensor.shape[0]) for part, rows in (("gate", slice(0, half)), ("up", slice(half, None)))]


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of `named` of at most `bucket_bytes` each (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class DistributedWeightPush:
    """Rank 0 of one server's weight-update group (see the module docstring)."""

    def __init__(self, host: str, port: int, world_size: int, backend: str, bucket_bytes: int,
                 timeout_s: float = 300.0, skip: frozenset[str] = frozenset()) -> None:
        """`host`/`port`: where the group's store listens (port 0: any free one). `world_size`:
        1 + the server's tensor-parallel ranks. `skip`: names the server has no parameter for
        (the tied `lm_head.weight`)."""
        self.host, self.port, self.world_size, self.backend = host, port, world_size, backend
        self.bucket_bytes, self.timeout = bucket_bytes, timedelta(seconds=timeout_s)
        self.skip = skip
        self.group_name: str | None = None
        self._group: Any = None
        self._store: Any = None
        self._socket: socket.socket | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sglang-weights")

    def push(self, server: RequestSender, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        if self._group is None:
            self._open(server)
        import torch.distributed as dist

        send = [(n, t.detach().contiguous()) for n, t in named if n not in self.skip]  # gloo needs contiguous
        parts = list(buckets(send, self.bucket_bytes))
        for i, part in enumerate(parts):
            body = requests.update_weights_from_distributed_request(
                [n for n, _ in part], [str(t.dtype).removeprefix("torch.") for _, t in part],
                [list(t.shape) for _, t in part], str(self.group_name), version, last=i == len(parts) - 1)
            # The server answers once it has received every tensor of the bucket: ask, then send.
            reply = self._pool.submit(server.post, "/update_weights_from_distributed", body)
            for _, tensor in part:
                dist.broadcast(tensor, group=self._group, group_src=0)
            _check(reply.result(), server, f"bucket {i + 1} of {len(parts)} of weight version {version}")

    def _open(self, server: RequestSender) -> None:
        """Bind the store's socket, have the server join (its HTTP call blocks until the group
        is formed), and form the group as rank 0."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(64)
        except OSError as e:
            sock.close()
            raise OSError(f"cannot listen on {self.host}:{self.port} for the weight-update group of the SGLang "
                          f"server {server.base_url} ({e}); another process holds the port: see docs/slurm.md "
                          "'Ports'") from e
        port = sock.getsockname()[1]
        name = f"relax-weights-{os.getpid()}-{next(_GROUPS)}"
        body = requests.init_weights_update_group_request(self.host, port, self.world_size, name, self.backend)
        joined = self._pool.submit(server.post, "/init_weights_update_group", body)
        try:
            self._store, self._group = _form_group_as_rank0(sock, self.host, port, self.world_size, name,
                                                            self.backend, self.timeout)
        except BaseException:
            sock.close()
            raise
        self._socket, self.group_name = sock, name
        _check(joined.result(), server, f"joining the weight-update group at {self.host}:{port}")

    def close(self, server: RequestSender | None) -> None:
        """Leave the group; `server`: a live server to tell (None when it died)."""
        if self._group is None:
            self._pool.shutdown(wait=False)
            return
        import torch.distributed as dist

        if server is not None:
            try:
                server.post("/destroy_weights_update_group",
                            requests.destroy_weights_update_group_request(str(self.group_name)))
            except Exception as e:  # noqa: BLE001 - the server is going away anyway
                log.info("the SGLang server %s did not destroy its update group: %s", server.base_url, e)
        try:
            dist.destroy_process_group(self._group)
        except Exception as e:  # noqa: BLE001 - a group whose peer died cannot always say goodbye
            log.info("destroying the weight-update group %s: %s", self.group_name, e)
        if self._socket is not None:
            self._socket.close()
        self._group = self._store = self._socket = None
        self._pool.shutdown(wait=False)


class TensorWeightPush:
    """Weights through shared memory, for a server on this host (see the module docstring)."""

    def __init__(self, tp_size: int, bucket_bytes: int, skip: frozenset[str] = frozenset()) -> None:
        self.tp_size, self.bucket_bytes, self.skip = tp_size, bucket_bytes, skip

    def push(self, server: RequestSender, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        import torch.multiprocessing

        torch.multiprocessing.set_sharing_strategy("file_system")
        send = [(n, t.detach().contiguous()) for n, t in named if n not in self.skip]
        parts = list(buckets(send, self.bucket_bytes))
        for i, part in enumerate(parts):
            payload = _shared_pickle(part)
            body = requests.update_weights_from_tensor_request([payload] * self.tp_size, version,
                                                               last=i == len(parts) - 1)
            _check(server.post("/update_weights_from_tensor", body), server,
                   f"bucket {i + 1} of {len(parts)} of weight version {version}")

    def close(self, server: RequestSender | None) -> None:
        pass


def _shared_pickle(named: list[tuple[str, torch.Tensor]]) -> str:
    """`named` pickled with torch's reductions (storage in shared memory), base64."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _form_group_as_rank0(sock: socket.socket, host: str, port: int, world_size: int, name: str,
                         backend: str, timeout: timedelta) -> tuple[Any, Any]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    # The store listens on `sock`, already bound to `host` (TCPStore alone would bind every interface).
    store = dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=sock.fileno())
    group, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), PrefixStore(name, store),
                                         group_name=GroupName(name), timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return store, group


def _check(reply: Any, server: RequestSender, doing: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise RuntimeError(f"the SGLang server {server.base_url} failed {doing}: {reply.get('message')}; "
                           "see its log")
