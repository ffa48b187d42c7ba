"""`SGLangServer`: start, watch and stop an SGLang server process from its own environment.

SGLang pins its own torch, so the server runs on the python of a separate venv (built by
tools/setup-sglang-cpu) and is reached over HTTP by `SGLangEngine` (sglang/engine.py).

    with SGLangServer(".venv-sglang/bin/python", model_dir, device="cpu", log_path=run / "sglang.log") as server:
        engine = SGLangEngine(server.url, model_dir)

`start()` waits for `/health` (SGLang answers 503 until its scheduler is up) with a deadline and
fails at once, naming the log, when the process exits. `stop()` sends SIGTERM to the server's
PID (SGLang then ends its scheduler and detokenizer), waits, then SIGKILLs what is left of the
process group it was started in (its own session, so nothing else is in it).

No orphans: beside each server runs a small watcher (python, its own session) that SIGKILLs the
server's process group once the process that started it is gone, however it went (a SIGKILL
from Ray included); `stop()` ends the watcher by its PID first. With `api_key` the server
requires `Authorization: Bearer <key>` on every route but /health; the key reaches it in an
owner-only `--config` file beside the log, never on the command line (which others can read);
the log is owner-only too, since SGLang writes its arguments there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from relax_hpc.auth.secret import write_private_text
from relax_hpc.ops.http import TRANSPORT_ERRORS, thread_client

__all__ = ["CPU_FLAGS", "SGLangServer", "SGLangServerError", "free_port"]

# Run beside each server: once the process that started it (this watcher's parent) is gone, kill
# the server's process group. The parent's death re-parents the watcher, which it sees at once.
WATCHER = """
import os, signal, sys, time
owner, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == owner:
    time.sleep(1)
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""

# The flags under which SGLang 0.5.23 serves on CPU: only its torch-native attention and sampling
# call no compiled kernel; token ids in and out; a KV cache of 4096 tokens (without the cap it
# takes ~70% of host memory); and a scheduler that waits on its sockets when it has nothing to do
# (without --sleep-on-idle it polls them, a whole core per server even when idle, taken from the
# trainer between rollouts). docs/engines.md, "SGLang on CPU".
CPU_FLAGS = (
    "--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--dtype", "float32",
    "--max-total-tokens", "4096", "--sleep-on-idle",
)


# SGLang's cache of multimodal encoder outputs, in MB (see SGLangServer.environment).
VLM_CACHE_VARIABLE = "SGLANG_VLM_CACHE_SIZE_MB"


class SGLangServerError(RuntimeError):
    """The SGLang server process did not start or stopped answering."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bind to port 0 and read what the OS chose)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SGLangServer:
    """One `python -m sglang.launch_server` process."""

    def __init__(
        self,
        python: str | Path,
        model_path: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        device: str = "cpu",
        extra_args: tuple[str, ...] | list[str] = (),
        log_path: str | Path | None = None,
        start_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ) -> None:
        """`python`: the SGLang environment's interpreter. `extra_args`: more launch_server flags
        (on CPU, `CPU_FLAGS` come first, so these can override them). `env`: extra environment.
        `api_key`: the bearer token the server requires (see the module docstring)."""
        self.python, self.model_path = Path(python), Path(model_path)
        self.host, self.device = host, device
        self.port = port if port is not None else free_port(host)
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path is not None else Path(
            tempfile.mkdtemp(prefix="relax-sglang-")) / "server.log"
        self.start_timeout_s = start_timeout_s
        self.extra_env = dict(env or {})
        self.api_key = api_key
        self.process: subprocess.Popen[bytes] | None = None
        self._watcher: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def config_path(self) -> Path:
        """The owner-only `--config` file that carries the API key."""
        return self.log_path.with_name(self.log_path.stem + ".config.yaml")

    def command(self) -> list[str]:
        device_flags = ("--device", self.device, *(CPU_FLAGS if self.device == "cpu" else ()))
        config = ("--config", str(self.config_path)) if self.api_key else ()
        return [str(self.python), "-m", "sglang.launch_server", "--model-path", str(self.model_path),
                "--host", self.host, "--port", str(self.port), "--skip-tokenizer-init",
                *device_flags, *self.extra_args, *config]

    def environment(self) -> dict[str, str]:
        """This process's environment minus what points into relax-hpc's own venv."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        # No cache of vision / audio encoder outputs: SGLang 0.5.23 keeps it across weight updates
        # (no route clears it), so an image seen before an update would be read with the old
        # encoder. Within one batch an image is still encoded once (the samples of a group).
        env[VLM_CACHE_VARIABLE] = "0"
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.update(self.extra_env)
        return env

    def start(self) -> SGLangServer:
        if self.process is not None and self.process.poll() is None:
            raise SGLangServerError(f"the SGLang server at {self.url} is already running (PID {self.process.pid})")
        if not self.python.exists():
            raise SGLangServerError(f"no python at {self.python}: build the SGLang environment with "
                                    "tools/setup-sglang-cpu (or `make sglang-env`)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.api_key:
            write_private_text(self.config_path, f"api-key: {json.dumps(self.api_key)}\n")
        # Owner-only: SGLang writes its arguments, the API key among them, into the log.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "ab") as log:
            self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self._watcher = subprocess.Popen(
            [sys.executable, "-c", WATCHER, str(os.getpid()), str(self.process.pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise SGLangServerError(f"the SGLang server exited with code {code} while starting; "
                                        f"see its log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise SGLangServerError(
                    f"the SGLang server did not answer {self.url}/health within {self.start_timeout_s} s "
                    f"(start_timeout_s); see its log {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def healthy(self, timeout_s: float = 10.0) -> bool:
        """True when GET /health answers 200 (SGLang runs a one-token generation for it when idle)."""
        try:
            return thread_client(timeout_s).get(self.url + "/health").status_code == 200
        except TRANSPORT_ERRORS:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's PID, wait up to `timeout_s`, then SIGKILL its process group."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.kill()
            watcher.wait(timeout=timeout_s)
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the scheduler and detokenizer, if they outlived it
        except (ProcessLookupError, PermissionError):
            pass
        process.wait(timeout=timeout_s)

    def restart(self) -> SGLangServer:
        """Stop and start again on the same port, appending to the same log."""
        self.stop()
        return self.start()

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
