"""Same-host shared-memory data path of the ZMQ transfer queue.

When a client runs on the server's host, tensor and array payloads do not travel through the
server: the producer copies them into one *payload file* per ``put``/``write`` under the
server's shm directory (``/dev/shm/relax-tq-<uuid>/``, tmpfs) and sends only references
(``["s", kind, dtype, shapes, file, offsets]`` per column). Payload files are *segments* the
producer keeps mapped (:class:`SegmentPool`): when the server releases one, the producer reuses
its memory for a later put under a new name, because allocating and freeing fresh tmpfs pages costs several times
the copy itself (measured: 0.35 ms to write and 0.14 ms to delete a new 1 MiB file, 0.03 ms to
refill a mapped one).
The server stores references and never touches the bytes, except to inline them for a client
that cannot see the directory (another host, or ``RELAX_TQ_SHM=0``). A consumer on the host
copies the bytes from its cached read-only mappings of those segments (:class:`ShmMaps`) into
freshly allocated tensors (one copy out of shared memory), so what it receives owns its memory
and stays valid after the partition is cleared.

Lifetime rules (the server enforces them through :class:`ShmStore`):

* a payload file belongs to the partition its put/write named; clearing the partition
  *releases* its files (renames ``name`` to ``.free-name``, which no reference can name), and
  the producer that made the segment reuses it; stopping the server deletes the whole directory,
  and a server that died without stopping has its directory deleted by the next server of the
  same user on the host (:func:`remove_abandoned`, through the directory's owner file);
* a file named by a refused, malformed or expired request is released at once (unless a live
  partition owns it);
* anything nobody references (a segment its producer no longer reuses, a file of a producer that
  died between writing it and the server recording the put, a leftover temporary file) is an
  orphan: the server deletes files it does not know whose last change (mtime or ctime: a rename
  counts) is older than ``ORPHAN_GRACE_S`` when a partition is cleared (at most once per
  ``SWEEP_INTERVAL_S``), and everything at stop.

New segments are written under a dot-prefixed temporary name and then renamed; a reused one is
renamed to its new name before it is refilled, and the new name is sent only after the copy.
References are plain names (``wire.SHM_NAME``: no ``/``, no ``.``), so a reference can never
name a temporary or released file nor a path outside the directory. Regular files only: symlinks
are refused. A consumer checks after copying that the name still names the inode it copied from: a batch
read while its partition is being cleared fails loudly instead of returning recycled bytes.
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from relax_hpc.transfer.queue import Value
from relax_hpc.transfer.wire import Buffer, Encoded, EncodedRow, WireError
from relax_hpc.transfer.wire_decode import materialize_blocks

SHM_ROOT = "/dev/shm"
DIR_PREFIX = "relax-tq-"
ORPHAN_GRACE_S = 60.0
SWEEP_INTERVAL_S = 10.0
FREE_PREFIX = ".free-"
OWNER_FILE = ".owner"  # "<pid> <pid namespace>" of the server: lets a later server reap the directory
SOCKET_FILE = ".sock"  # the server's same-host (ipc://) endpoint: requests skip the TCP loopback
_MAX_IPC_PATH = 100  # AF_UNIX paths hold 107 bytes on Linux
MAX_SEGMENTS = 256  # segments one producer keeps mapped; older ones are left to the sweep
_REUSE_TRIES = 2  # released segments are usually the oldest: look at a few, not all
_MIN_SEGMENT = 64 * 1024


def shm_enabled_by_env() -> bool:
    """``RELAX_TQ_SHM=0`` turns the shared-memory path off (server and clients)."""
    return os.environ.get("RELAX_TQ_SHM", "1").strip().lower() not in ("0", "false", "no", "off")


def local_host_id() -> str:
    """Hostname plus kernel boot id: equal only for processes on the same machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{os.uname().nodename}/{boot}"


def same_host_endpoint(directory: str, advertised: object) -> str | None:
    """The server's ipc:// endpoint when it advertised one inside its shm ``directory``."""
    expected = f"ipc://{os.path.join(directory, SOCKET_FILE)}"
    return expected if advertised == expected and os.path.exists(expected[len("ipc://"):]) else None


def client_can_use(host: object, directory: object) -> bool:
    """Whether this process shares the server's host and can read and write its shm directory."""
    if not isinstance(host, str) or not isinstance(directory, str) or not directory:
        return False
    if host != local_host_id():
        return False
    return os.path.isdir(directory) and os.access(directory, os.R_OK | os.W_OK | os.X_OK)


# --------------------------------------------------------------------------- producer side
class _Segment:
    def __init__(self, name: str, size: int, memory: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.memory = memory
        self.view = memoryview(memory)  # type: ignore[arg-type]


class SegmentPool:
    """A producer's mapped payload segments in the server's shm directory.

    ``write`` copies a put's buffers into a released segment of this producer when one is large
    enough (claimed atomically by renaming ``.free-<old>`` to the new name), else into a new
    segment (size rounded up to a power of two; tmpfs allocates only the pages touched).
    Not thread-safe: one pool per client, and a client serialises its calls.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._segments: list[_Segment] = []  # oldest use first

    def write(self, name: str, buffers: Sequence[Buffer]) -> list[int]:
        """Put ``buffers`` back to back into a segment now named ``name``; returns their offsets."""
        views = [memoryview(b).cast("B") for b in buffers]
        offsets, total = [], 0
        for view in views:
            offsets.append(total)
            total += view.nbytes
        segment = self._reuse(name, total)
        if segment is None:
            segment = self._create(name, total, views, offsets)
        else:
            _fill(segment.view, views, offsets)
        self._segments.append(segment)
        return offsets

    def release(self, name: str) -> None:
        """Give back the segment of a put the server refused, so it can be reused."""
        _rename(os.path.join(self.directory, name), os.path.join(self.directory, FREE_PREFIX + name))

    def close(self) -> None:
        """Unmap everything and delete the segments the server has released."""
        for segment in self._segments:
            _unlink(os.path.join(self.directory, FREE_PREFIX + segment.name))
            segment.view.release()
            segment.memory.close()
        self._segments.clear()

    def _reuse(self, name: str, total: int) -> _Segment | None:
        tried = 0
        for segment in list(self._segments):
            if segment.size < total:
                continue
            if tried == _REUSE_TRIES:
                break
            tried += 1
            old = os.path.join(self.directory, segment.name)
            try:
                os.rename(os.path.join(self.directory, FREE_PREFIX + segment.name), os.path.join(self.directory, name))
            except FileNotFoundError:
                if not os.path.exists(old):  # neither in use nor free: swept, forget it
                    self._drop(segment)
                continue
            self._segments.remove(segment)
            segment.name = name
            return segment
        return None

    def _create(self, name: str, total: int, views: list[memoryview], offsets: list[int]) -> _Segment:
        size = max(_MIN_SEGMENT, 1 << max(0, total - 1).bit_length())
        tmp = os.path.join(self.directory, f".{name}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        segment = _Segment(name, size, memory)
        _fill(segment.view, views, offsets)
        os.rename(tmp, os.path.join(self.directory, name))
        if len(self._segments) >= MAX_SEGMENTS:
            self._drop(self._segments[0])
        return segment

    def _drop(self, segment: _Segment) -> None:
        self._segments.remove(segment)
        segment.view.release()
        segment.memory.close()


def _fill(target: memoryview, views: list[memoryview], offsets: list[int]) -> None:
    for view, offset in zip(views, offsets):
        target[offset : offset + view.nbytes] = view


# --------------------------------------------------------------------------- consumer side
class ShmMaps:
    """A consumer's read-only mappings of payload files, kept across gets (a :data:`wire_decode.ShmReader`).

    Producers refill the same segments under new names, so a consumer meets the same few
    inodes again and again: it keeps each mapped, keyed by (device, inode), and a read is one
    ``stat`` of the name plus a memory copy (measured: 23 us for 1 MiB from a mapping, 63 us
    through ``preadv``). A mapping holds its inode, so its number cannot name another file
    while it is cached. At most ``max_maps`` mappings and ``max_bytes`` bytes stay mapped
    (least recently used go first); a mapping of a deleted file pins its memory only until then.

    Each read copies the rows' byte ranges into one new buffer; the tensors built on it own
    their memory and stay valid after the partition is cleared. :meth:`verify` then checks that
    every name read still names the inode read from: a batch read while its partition was
    cleared (and its segment handed back for reuse) fails loudly instead of returning recycled
    bytes. Thread-safe: reads are serialised.
    """

    def __init__(self, directory: str, max_maps: int = 64, max_bytes: int = 512 * 1024 * 1024) -> None:
        self.directory = directory
        self.max_maps = max_maps
        self.max_bytes = max_bytes
        self._maps: OrderedDict[tuple[int, int], _Mapping] = OrderedDict()
        self._bytes = 0
        self._read: dict[str, tuple[int, int]] = {}  # name -> inode, since the last verify
        self._lock = threading.RLock()

    def __call__(self, files: list[str], offsets: list[int], sizes: list[int]) -> np.ndarray:
        out = np.empty(sum(sizes), dtype=np.uint8)
        target = memoryview(out)
        at, i, n = 0, 0, len(files)
        with self._lock:
            while i < n:
                file, start, length = files[i], offsets[i], sizes[i]
                j = i + 1
                while j < n and files[j] == file and offsets[j] == start + length:  # coalesce
                    length += sizes[j]
                    j += 1
                if length:
                    source = self._mapping(file)
                    if start + length > source.size:
                        raise WireError(f"shm payload {file!r} ends before offset {start} + {length} bytes")
                    target[at : at + length] = source.view[start : start + length]
                at, i = at + length, j
        return out

    def verify(self) -> None:
        """Raise if a file read since the last call was released (its partition cleared) while
        it was read."""
        with self._lock:
            read, self._read = self._read, {}
            for file, key in read.items():
                if _inode(os.path.join(self.directory, file)) != key:
                    raise WireError(
                        f"shm payload {file!r} was released while this batch was read: its partition was "
                        "cleared during the get; get only from partitions that are not being cleared"
                    )

    def read_blocks(self, descs: Any, frames: Sequence[Buffer]) -> list[dict[str, Value]]:
        """Materialise a get reply whose array columns may reference payload files, then
        :meth:`verify` that none was released meanwhile."""
        with self._lock:
            rows = materialize_blocks(descs, frames, self)
            self.verify()
            return rows

    def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                mapping.close()
            self._maps.clear()
            self._bytes = 0
            self._read.clear()

    def _mapping(self, file: str) -> _Mapping:
        key = self._read.get(file)
        if key is None:
            key = _inode(os.path.join(self.directory, file))
        mapping = self._maps.get(key) if key is not None else None
        if mapping is None:
            key, mapping = self._map(file)
        else:
            self._maps.move_to_end(key)
        self._read[file] = key
        return mapping

    def _map(self, file: str) -> tuple[tuple[int, int], _Mapping]:
        fd = _open_payload(self.directory, file)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise WireError(f"shm payload {file!r} is not a regular file")
            key = (info.st_dev, info.st_ino)
            known = self._maps.get(key)
            if known is not None and known.size == info.st_size:  # renamed since the stat: same memory
                self._maps.move_to_end(key)
                return key, known
            if known is not None:  # never done by producers (segments keep their size); map anew
                del self._maps[key]
                self._bytes -= known.size
                known.close()
            memory = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ) if info.st_size else None
        finally:
            os.close(fd)
        mapping = _Mapping(info.st_size, memory)
        while self._maps and (len(self._maps) >= self.max_maps or self._bytes + mapping.size > self.max_bytes):
            _, oldest = self._maps.popitem(last=False)
            self._bytes -= oldest.size
            oldest.close()
        self._maps[key] = mapping
        self._bytes += mapping.size
        return key, mapping


class _Mapping:
    def __init__(self, size: int, memory: mmap.mmap | None) -> None:
        self.size = size
        self.memory = memory
        self.view = memoryview(memory) if memory is not None else memoryview(b"")  # type: ignore[arg-type]

    def close(self) -> None:
        self.view.release()
        if self.memory is not None:
            self.memory.close()


def read_blocks(directory: str, descs: Any, frames: Sequence[Buffer]) -> list[dict[str, Value]]:
    """Materialise one get reply that may reference payload files in ``directory``, mapping
    them for this call only (a client keeps its :class:`ShmMaps` instead)."""
    once = ShmMaps(directory)
    try:
        return once.read_blocks(descs, frames)
    finally:
        once.close()


def _inode(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino)


def _open_payload(directory: str, name: str) -> int:
    try:
        return os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise WireError(
            f"shm payload {name!r} is gone from {directory}: the partition was cleared (or the "
            "server stopped) while this batch was in flight; get from a live partition"
        ) from None


def _read_exact(fd: int, target: memoryview, file: str, offset: int) -> None:
    done = 0
    while done < target.nbytes:
        got = os.preadv(fd, [target[done:]], offset + done)
        if got <= 0:
            raise WireError(f"shm payload {file!r} ends before offset {offset} + {target.nbytes} bytes")
        done += got


# --------------------------------------------------------------------------- server side
class ShmStore:
    """The server's shm directory: validates references, tracks which partition owns which
    payload file, deletes files on clear/refusal/stop and sweeps orphans."""

    def __init__(self, root: str = SHM_ROOT) -> None:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"shared-memory root {root} does not exist")
        remove_abandoned(root)
        self.path = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{uuid.uuid4().hex[:12]}-", dir=root)
        os.chmod(self.path, 0o700)  # same user only: a job's roles share the uid
        with open(os.path.join(self.path, OWNER_FILE), "w", encoding="ascii") as f:
            f.write(f"{os.getpid()} {_pid_namespace()}\n")
        self.host = local_host_id()
        self._owner: dict[str, str] = {}  # file -> partition
        self._files: dict[str, set[str]] = {}  # partition -> files
        self._last_sweep = time.monotonic()

    def check(self, rows: Sequence[EncodedRow], partition: str) -> set[str]:
        """Validate every reference in ``rows`` against the directory; returns the files named.

        Raises :class:`WireError` for a missing or non-regular file, a byte range past the end
        of the file, or a file that another partition already owns.
        """
        sizes: dict[str, int] = {}
        for row in rows:
            for name, enc in row.items():
                if not enc.file:
                    continue
                size = sizes.get(enc.file)
                if size is None:
                    size = sizes[enc.file] = self._size(enc.file, partition)
                if enc.offset + enc.nbytes > size:
                    raise WireError(
                        f"field {name!r}: shm payload {enc.file!r} holds {size} bytes, the reference "
                        f"needs {enc.nbytes} bytes at offset {enc.offset}"
                    )
        return set(sizes)

    def _free(self, file: str) -> None:
        """Hand a segment back to its producer: no reference can name ``.free-*``."""
        _rename(os.path.join(self.path, file), os.path.join(self.path, FREE_PREFIX + file))

    def _size(self, file: str, partition: str) -> int:
        owner = self._owner.get(file)
        if owner is not None and owner != partition:
            raise WireError(f"shm payload {file!r} belongs to partition {owner!r}, not {partition!r}")
        try:
            info = os.stat(os.path.join(self.path, file), follow_symlinks=False)
        except FileNotFoundError:
            raise WireError(f"shm payload {file!r} does not exist in {self.path}") from None
        if not stat.S_ISREG(info.st_mode):
            raise WireError(f"shm payload {file!r} is not a regular file")
        return info.st_size

    def adopt(self, partition: str, files: Iterable[str]) -> None:
        """Record that ``partition`` references ``files`` (after the put/write was applied)."""
        owned = self._files.setdefault(partition, set())
        for file in files:
            owned.add(file)
            self._owner[file] = partition

    def discard(self, files: Iterable[str]) -> None:
        """Release files of a request that was not applied (never one a partition owns)."""
        for file in files:
            if file not in self._owner:
                self._free(file)

    def release(self, partition: str, pending: set[str]) -> None:
        """Release the files of a cleared partition, then sweep orphans if it is time."""
        for file in self._files.pop(partition, set()):
            self._owner.pop(file, None)
            self._free(file)
        if time.monotonic() - self._last_sweep >= SWEEP_INTERVAL_S:
            self.sweep(pending)

    def sweep(self, pending: set[str], grace_s: float | None = None) -> int:
        """Delete files nobody references that are older than ``grace_s``; returns how many.

        ``pending`` are files of requests the server holds but has not applied yet (parked puts).
        The grace period covers a put whose message is still on its way to the server.
        """
        self._last_sweep = time.monotonic()
        cutoff = time.time() - (ORPHAN_GRACE_S if grace_s is None else grace_s)
        removed = 0
        with os.scandir(self.path) as entries:
            for entry in entries:
                name = entry.name
                if name in self._owner or name in pending or name in (OWNER_FILE, SOCKET_FILE):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                    if max(info.st_mtime, info.st_ctime) > cutoff:
                        continue
                except FileNotFoundError:
                    continue
                _unlink(entry.path)
                removed += 1
        return removed

    def inline(self, rows: Sequence[EncodedRow]) -> list[EncodedRow]:
        """Replace references by frames holding the bytes, for a client that cannot see shm."""
        fds: dict[str, int] = {}
        try:
            out: list[EncodedRow] = []
            for row in rows:
                new: EncodedRow = {}
                for name, enc in row.items():
                    if enc.file:
                        fd = fds.get(enc.file)
                        if fd is None:
                            fd = fds[enc.file] = _open_payload(self.path, enc.file)
                        data = bytearray(enc.nbytes)
                        _read_exact(fd, memoryview(data), enc.file, enc.offset)
                        enc = Encoded(enc.kind, enc.dtype, enc.shape, data)
                    new[name] = enc
                out.append(new)
            return out
        finally:
            for fd in fds.values():
                os.close(fd)

    def close(self) -> None:
        """Delete the directory and everything in it (server stop)."""
        self._owner.clear()
        self._files.clear()
        shutil.rmtree(self.path, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        """What the ping reply advertises so that clients can decide to use shm."""
        return {"host": self.host, "shm": self.path}

    @property
    def ipc_address(self) -> str | None:
        """Where the server may also listen for same-host clients (None: path too long)."""
        path = os.path.join(self.path, SOCKET_FILE)
        return f"ipc://{path}" if len(path) <= _MAX_IPC_PATH else None


def remove_abandoned(root: str = SHM_ROOT) -> list[str]:
    """Delete the shm directories of this user's queue servers that died without `stop()`
    (SIGKILL, OOM kill, node-level kill); returns their paths.

    A directory is abandoned when its owner file names a process that no longer exists in this
    pid namespace. Directories of another pid namespace (a container sharing /dev/shm) or
    without an owner file are left alone: their owner cannot be checked from here.
    """
    removed: list[str] = []
    namespace = _pid_namespace()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(DIR_PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            with open(os.path.join(entry.path, OWNER_FILE), encoding="ascii") as f:
                pid_text, owner_namespace = f.read().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if owner_namespace != namespace or _alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "unknown"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _rename(source: str, target: str) -> None:
    try:
        os.rename(source, target)
    except FileNotFoundError:
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
