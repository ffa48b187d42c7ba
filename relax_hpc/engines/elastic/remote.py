"""`RemoteEngineClient`: an engine server reached over HTTP, driven by the router as a rollout engine.

A federated ("grow job") engine is `relax-hpc serve-engine MODEL_DIR --weights-root ROOT` in a
Slurm job of its own; the training job's `EngineRouter` drives it through this client like any
other `EngineClient`: it generates through `POST /generate`, and new weights travel through the
shared filesystem. `share` writes each version once to `ROOT/v<N>/model.safetensors` (a temp
directory, then a rename; disk_weights.py) and every remote client has its server load that
directory (`POST /update_weights_from_disk`, SGLang's route and body).

    client = RemoteEngineClient("grow-0", "http://node7:30000", engine_token(), Path("/shared/run/weights"))
    shared = client.share(model.named_parameters(), version=3)     # once per update
    client.load_weights(shared, 3).result()                        # per remote client
    client.submit(prompts, SamplingParams(max_new_tokens=64), seed=7).result()

Nothing is retried behind the router's back on `/generate`: a request re-issued after a failure
comes from the router (on another engine), so no prompt is answered twice. The exception is a
busy server: 503 (its connection limit, answered before a request is read) and 429 are asked
again, after `Retry-After` or a backoff, for up to the client's timeout; only then is the engine
failed. So sockets that anyone opens to the port cannot make the router drop the engine. The remote server
belongs to its own job: `close` stops this client, never the server.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from relax_hpc.engines.base import EngineGone, SamplingParams
from relax_hpc.engines.disk_weights import (
    WEIGHTS_FILE,
    prune_versions,
    read_weights_dir,
    version_dir,
    write_safetensors_dir,
)
from relax_hpc.engines.http.client import EngineAuthError, EngineHttpError, HttpEngine
from relax_hpc.engines.router import WeightsUnavailable
from relax_hpc.engines.sglang.requests import update_weights_from_disk_request
from relax_hpc.media.items import PromptMedia

__all__ = ["RemoteEngineClient", "WeightLoadError", "write_weights_dir"]

Future = concurrent.futures.Future
# The engine calls the router makes around weight updates and colocated steps: a remote engine
# runs on its own devices in its own job, so none of them has anything to do there.
NO_OP_CALLS = {"pause": None, "resume": None, "release_memory": 0, "resume_memory": None}
CONTROL_RETRIES = 2  # /health, /model_info and weight loads are idempotent: retried on a hiccup

# Version directories this process wrote, and the lock that makes each written once. A directory
# left by an earlier run of the job is never reused: a resumed run repeats version numbers with
# other weights.
_written: set[Path] = set()
_write_lock = threading.Lock()


class WeightLoadError(EngineHttpError):
    """An engine server did not load a weight version; the message names the server and why."""


def write_weights_dir(named_tensors: Iterable[tuple[str, torch.Tensor]], root: Path, version: int) -> Path:
    """`root/v<version>`, written once per process (a second call for the version returns the
    directory as it is), then the older versions pruned but the one before it (an engine may
    still be loading that one)."""
    target = version_dir(Path(root), version).absolute()
    with _write_lock:
        if target in _written and (target / WEIGHTS_FILE).is_file():
            return target
        target = write_safetensors_dir(named_tensors, target.parent, version).absolute()
        _written.add(target)
        for gone in prune_versions(target.parent, target):
            _written.discard(gone.absolute())
    return target


class RemoteEngineClient:
    """An `EngineClient` (router.py) for an engine server at `url`; see the module docstring.

    Construction asks the server once for `/health` and `/model_info`: an error says when it does
    not answer, refuses `token` (EngineAuthError), serves no generation model, or serves another
    `model_type` than the one given. `weights_root` is the training job's side of the shared
    directory; the server's `--weights-root` must be the same directory."""

    def __init__(self, id: str, url: str, token: str | None, weights_root: Path, timeout_s: float = 600.0,
                 model_type: str | None = None) -> None:
        self.id, self.address = id, url
        self.weights_root = Path(weights_root)
        # busy_wait_s: a 503 or 429 (busy, nothing was served) is asked again for up to the timeout.
        self._http = HttpEngine(url, token=token, timeout_s=timeout_s, retries=0, busy_wait_s=timeout_s)
        self._control = HttpEngine(url, token=token, timeout_s=timeout_s, retries=CONTROL_RETRIES,
                                   busy_wait_s=timeout_s)
        self.weight_version = self._check_server(model_type)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=id)

    def _check_server(self, model_type: str | None) -> int:
        """The server's weight version, after checking it is the engine this client expects."""
        if not self._control.health():  # EngineAuthError when it answers but refuses the token
            raise EngineHttpError(f"engine {self.id} at {self.address} does not answer GET /health; is its "
                                  "`relax-hpc serve-engine` running, and reachable from this node?")
        info = self._control.model_info()
        if info.get("is_generation") is False:
            raise EngineHttpError(f"engine {self.id} at {self.address} serves a model that does not generate "
                                  f"({info.get('model_path')}); serve the policy model there")
        if model_type is not None and info.get("model_type") != model_type:
            raise EngineHttpError(f"engine {self.id} at {self.address} serves model type "
                                  f"{info.get('model_type')!r} ({info.get('model_path')}), the policy is "
                                  f"{model_type!r}; serve the policy's model directory there")
        version = info.get("weight_version", 0)
        if isinstance(version, str) and version.isdigit():  # SGLang's form
            version = int(version)
        return version if isinstance(version, int) and not isinstance(version, bool) else 0

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
               media: Sequence[PromptMedia | None] | None = None) -> Future:
        return self._thread.submit(self._http.generate, prompts, params, seed, media)

    def share(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
        """The update as every remote client loads it: the directory of `version` under the
        weights root, written once (`write_weights_dir`). The router calls it once per update
        for all its remote clients."""
        return write_weights_dir(named_tensors, self.weights_root, version)

    def load_weights(self, shared: Path, version: int) -> Future:
        """Have the server load `shared` (the directory `share` returned) as `version`; the
        future raises WeightLoadError when it did not."""
        return self._thread.submit(self._load, Path(shared), version)

    def _load(self, directory: Path, version: int) -> None:
        try:
            reply = self._control.send("POST", "/update_weights_from_disk",
                                       update_weights_from_disk_request(str(directory), version))
        except EngineAuthError:
            raise
        except EngineHttpError as e:
            raise WeightLoadError(f"engine {self.id} did not load weight version {version} from {directory}: {e}. "
                                  "Its serve-engine must run with --weights-root set to the directory this job "
                                  f"writes ({self.weights_root}), on a filesystem both nodes see") from e
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise WeightLoadError(f"engine {self.id} at {self.address} answered the load of weight version {version} "
                                  f"with {str(reply)[:300]}; expected {{'success': true, ...}}")
        self.weight_version = version

    def current_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The version this engine last loaded, read back from its directory (a joining engine
        takes the job's weights from here when no engine of the job can hand them over)."""
        directory = version_dir(self.weights_root, self.weight_version)
        if not (directory / WEIGHTS_FILE).is_file():
            raise WeightsUnavailable(f"engine {self.id} runs weight version {self.weight_version}, whose "
                                      f"directory {directory} is gone")
        return read_weights_dir(directory, self.weights_root)

    def call(self, method: str) -> Future:
        """`pause`, `resume`, `release_memory` (0 bytes) and `resume_memory` do nothing here."""
        future: Future = Future()
        if method in NO_OP_CALLS:
            future.set_result(NO_OP_CALLS[method])
        else:
            future.set_exception(ValueError(f"engine call {method!r} is not one of {sorted(NO_OP_CALLS)}"))
        return future

    def died(self, error: BaseException) -> bool:
        """Whether the router should stop using this engine and give its work to the others.

        True for every failure of the server or of the way to it: connection refused or reset, a
        timeout, HTTP 5xx (503 and 429 only once the server stayed busy for the whole timeout:
        the client asks again until then), a reply that cannot be read, a weight load it refused (it would serve
        stale weights) and also a 4xx on `/generate`. The request is the router's own and
        well-formed, so a 4xx says this server cannot serve it (limits lower than the chunk,
        another vocabulary): re-issued elsewhere, nothing is lost, and the router logs the
        server's message. False, so the caller sees the error, for an `EngineAuthError` (the
        job's token is configuration to fix, not an engine to drop; construction already checked
        it) and for anything raised before a request was sent (a programming error, e.g. media
        for this text-only client)."""
        if isinstance(error, EngineAuthError):
            return False
        return isinstance(error, (EngineHttpError, EngineGone, ConnectionError, TimeoutError))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
