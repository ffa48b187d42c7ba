"""Killable reward workers: plain reward functions scored in worker processes.

Why processes: a reward that runs pure-Python work (sympy expanding a power tower, a regex on a
long response) holds the interpreter lock. On a thread, nothing can interrupt it: the pool's
timeout never fires and one sample stalls rollout forever. In a worker process it can be
killed. `RewardWorkers.run(fn, sample, timeout_s)` sends the reward (by reference: a
module-level function or a picklable object) and the sample to an idle worker and waits; a
worker that has not answered in `timeout_s` is killed (SIGKILL) and replaced, and the call
raises `TimeoutError`. A worker that dies (out of memory, a crash in a C extension) is replaced
the same way and the call raises `RewardWorkerDied`.

Workers start lazily (none for a run whose rewards are all inline or async), at most
`processes` of them, each a fresh interpreter (`python -m relax_hpc.rewards.workers`) talking
over two pipes. A new worker says it is ready once its interpreter has started, and loads a
reward function (imports its module) before it scores with it, each within `START_TIMEOUT_S`:
`timeout_s` is the reward's own time on a sample, never a worker's start-up or a module's
import, which take seconds on a busy node. The caller's threads (Ray's, the engine's) are never
forked, and the caller's main module is never re-imported. A worker exits when the caller does
(its pipe closes, and on Linux the kernel sends it SIGKILL when its parent dies). Each worker
optionally caps its address space (`memory_mb`), so a runaway reward gets a MemoryError instead
of the node's memory. Workers start without the job's credentials in their environment
(`relax_hpc.auth.worker_env`): a reward may run code a response wrote.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.connection
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
from typing import Any

from relax_hpc.auth.worker_env import worker_environment
from relax_hpc.data.sample import Sample
from relax_hpc.rewards.registry import RewardFn, RewardResult


START_TIMEOUT_S = 120.0  # a new worker's interpreter start-up (imports); not part of a reward's timeout


class RewardWorkerDied(RuntimeError):
    """A worker process ended while it scored a sample, or never came up."""


def can_run_in_worker(fn: RewardFn) -> bool:
    """True when `fn` can be sent to a worker: it pickles (module-level functions do)."""
    try:
        pickle.dumps(fn)
    except Exception:  # closures, lambdas, objects holding locks or sockets
        return False
    return True


_LOAD, _SCORE = b"L", b"S"  # a request's first byte: load a reward function, score a sample with it


def _serve_pair(requests: multiprocessing.connection.Connection,
                replies: multiprocessing.connection.Connection) -> None:
    """A worker's loop: receive a reward to load or a sample to score with the one loaded; answer
    ("ok", result) or ("error", message)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    fn: RewardFn | None = None
    while True:
        try:
            request = requests.recv_bytes()
        except (EOFError, OSError):  # the caller closed its end: shut down
            return
        kind, body = request[:1], request[1:]
        try:
            if kind == _LOAD:
                fn = pickle.loads(body)  # imports the reward's module: that is the load's time
                replies.send(("ok", None))
            elif fn is None:
                replies.send(("error", "no reward function loaded"))
            else:
                replies.send(("ok", fn(pickle.loads(body))))
        except Exception as e:  # the reward's own failure (or an unpicklable result) is reported
            replies.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, memory_mb: int) -> None:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        try:
            # The caller's import path, so that a reward it can import ("my_pkg.rewards:fn",
            # a module on a path added at run time) unpickles in the worker too.
            # Without the job's credentials: a reward may run code a response wrote.
            env = {**worker_environment(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(to_worker_r), str(from_worker_w), str(memory_mb)],
                pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL, env=env,
            )
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self.requests = multiprocessing.connection.Connection(to_worker_w, readable=False)
        self.replies = multiprocessing.connection.Connection(from_worker_r, writable=False)
        self._loaded: bytes | None = None  # the pickled reward function the worker holds
        self._wait_ready()

    def _wait_ready(self) -> None:
        try:
            if self.replies.poll(START_TIMEOUT_S) and self.replies.recv() == ("ready", None):
                return
            why = f"did not say it was ready within {START_TIMEOUT_S:g} s"
        except (EOFError, OSError):
            why = f"exited while starting (exit code {self.process.poll()})"
        self.kill()
        raise RewardWorkerDied(f"a reward worker process {why}; run `{sys.executable} -m {__name__}` "
                               "by hand to see why it cannot start (an import error, a full disk)")

    def call(self, fn: RewardFn, sample: Sample, timeout_s: float) -> RewardResult:
        """Score one sample; TimeoutError / RewardWorkerDied leave this worker unusable.

        A reward the worker has not loaded yet is loaded first, within START_TIMEOUT_S: importing
        its module (sympy, a tokenizer) is not the reward's time on a sample."""
        # Pickle first: an unpicklable reward or sample fails here and leaves the worker usable.
        reward = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        payload = pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
        if reward != self._loaded:
            self._exchange(_LOAD + reward, START_TIMEOUT_S, "loading the reward function")
            self._loaded = reward
        return self._exchange(_SCORE + payload, timeout_s, "scoring")  # type: ignore[no-any-return]

    def _exchange(self, request: bytes, timeout_s: float, doing: str) -> Any:
        try:
            self.requests.send_bytes(request)
            answered = self.replies.poll(timeout_s)
            if answered:
                status, value = self.replies.recv()
        except (EOFError, OSError) as e:
            try:
                code: int | None = self.process.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            raise RewardWorkerDied(
                f"the reward worker process died while {doing} (exit code {code}); "
                "if it ran out of memory, raise [reward] worker_memory_mb"
            ) from e
        if not answered:
            raise TimeoutError(f"no answer within {timeout_s:g} s ({doing})")
        if status == "error":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self._close_pipes()

    def stop(self) -> None:
        self._close_pipes()  # the worker's recv sees EOF and it returns
        try:
            self.process.wait(2.0)
        except subprocess.TimeoutExpired:
            self.kill()

    def _close_pipes(self) -> None:
        self.requests.close()
        self.replies.close()


class RewardWorkers:
    """At most `processes` reward worker processes, shared by the caller's threads."""

    def __init__(self, processes: int, memory_mb: int = 0) -> None:
        if processes < 1:
            raise ValueError(f"[reward] worker_processes = {processes}: must be >= 1")
        self.processes, self.memory_mb = processes, memory_mb
        self.replaced = 0  # workers killed after a timeout or found dead
        self._idle: list[_Worker] = []
        self._running = 0  # workers that exist: idle or busy
        self._cond = threading.Condition()
        self._closed = False

    def run(self, fn: RewardFn, sample: Sample, timeout_s: float) -> RewardResult:
        """Score `sample` with `fn` in a worker; blocks the calling thread until done."""
        worker = self._acquire()
        try:
            result = worker.call(fn, sample, timeout_s)
        except (TimeoutError, RewardWorkerDied):
            self._discard(worker)
            raise
        except BaseException:
            self._release(worker)  # a reward error or an unpicklable sample: the worker is fine
            raise
        self._release(worker)
        return result

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the reward workers are closed")
                if self._idle:
                    return self._idle.pop()
                if self._running < self.processes:
                    self._running += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self.memory_mb)
        except BaseException:
            with self._cond:
                self._running -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                worker.stop()
                return
            self._idle.append(worker)
            self._cond.notify()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._cond:
            self._running -= 1
            self.replaced += 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for worker in idle:
            worker.stop()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent dies (best effort elsewhere).

    Linux ties this to the thread that started the worker: the pool's executor threads, which
    live until the pool is closed, when the workers are stopped anyway.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    """Worker entry point: `python -m relax_hpc.rewards.workers READ_FD WRITE_FD MEMORY_MB`."""
    read_fd, write_fd, memory_mb = (int(a) for a in argv)
    _die_with_parent()
    if os.getppid() == 1:  # the parent died before the line above took effect
        return
    if memory_mb > 0:
        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    requests = multiprocessing.connection.Connection(read_fd, writable=False)
    replies = multiprocessing.connection.Connection(write_fd, readable=False)
    replies.send(("ready", None))
    _serve_pair(requests, replies)


if __name__ == "__main__":
    main(sys.argv[1:])
