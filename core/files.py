"""Atomic file writes: a reader (or a resume after a crash) sees the old file or the new one, never half of one;
and file records (size and a CRC-32 per 64 MiB block) that find damage when a file is read back.
No torch here: the tokenizer's worker processes import this."""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np

CRC_BLOCK_BYTES = 64 << 20  # CRC-32 granularity of a file record: a mismatch names the damaged 64 MiB block


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` beside ``path``, then rename: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# What atomic_write and an export's directory swap (models.hf_io) leave where the writer is killed: the target's name,
# then tmp or old, the writer's pid and, for a directory, mkdtemp's suffix.
_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.(?:tmp|old)-(?P<pid>\d+)(?:-[A-Za-z0-9_]+)?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale_temporaries(directory: Path, target: str | None = None) -> list[Path]:
    """This project's temporaries in ``directory`` (of ``target`` only, where given) whose writing process is gone on
    this host: what a kill during a save leaves (``.model.safetensors.tmp-<pid>``, ``.hf.tmp-<pid>-*``). Nothing else,
    and none of a live process, is ever returned."""
    if not directory.is_dir():
        return []
    found = [(path, _TEMPORARY.match(path.name)) for path in directory.iterdir()]
    return sorted(path for path, m in found if m and (target is None or m["target"] == target)
                  and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])))


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists: where the free space of a file yet to be written is measured."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("/"))


def remove(path: Path) -> None:
    """A file, or a directory with what it holds: never through a symbolic link (the link alone goes)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_npy(path: Path, array: np.ndarray) -> None:
    """Write ``array`` atomically as the .npy file ``path``."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would append .npy to a path
            np.save(f, array)

    atomic_write(path, write)


_READ_BYTES = 4 << 20  # a block is read (and its CRC continued) in parts: 8 threads hold 32 MiB, not 512


def _block_crc(path: Path, block: int) -> int:
    crc, left = 0, CRC_BLOCK_BYTES
    with open(path, "rb") as f:
        f.seek(block * CRC_BLOCK_BYTES)
        while left and (part := f.read(min(left, _READ_BYTES))):
            crc, left = zlib.crc32(part, crc), left - len(part)
    return crc


def record_paths(paths: Iterable[Path]) -> dict[Path, dict[str, Any]]:
    """{path: {"bytes": size, "crc32": [one per 64 MiB block]}}; blocks are checksummed on a thread pool (file
    reads and zlib release the GIL: several GB/s)."""
    sizes = {p: p.stat().st_size for p in paths}
    jobs = [(p, b) for p, size in sizes.items() for b in range(max(1, -(-size // CRC_BLOCK_BYTES)))]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        crcs = list(pool.map(lambda job: _block_crc(*job), jobs))
    record: dict[Path, dict[str, Any]] = {p: {"bytes": size, "crc32": []} for p, size in sizes.items()}
    for (p, _), crc in zip(jobs, crcs):
        record[p]["crc32"].append(crc)
    return record


def record_problems(name: str, expected: dict[str, Any], got: dict[str, Any] | None) -> list[str]:
    """What differs between a file's record as written (``expected``) and as read back (``got``; None: the file
    is missing), each naming the file as ``name``: its size, or each 64 MiB block whose bytes changed."""
    if got is None:
        return [f"{name} is missing"]
    if got["bytes"] != expected["bytes"]:
        return [f"{name} has {got['bytes']} bytes, {expected['bytes']} were written"]
    size = got["bytes"]
    return [f"{name} bytes [{b * CRC_BLOCK_BYTES}, {min((b + 1) * CRC_BLOCK_BYTES, size)}) differ from what was "
            "written" for b, (g, e) in enumerate(zip(got["crc32"], expected["crc32"])) if g != e]


def file_kind(path: Path) -> str:
    """What ``path`` is, from its status alone (a FIFO is never opened: that would wait for a writer): 'file',
    'directory', 'missing' (a link to a missing target too), or what else it is: 'a FIFO', 'a socket', 'a character
    device', 'a block device'."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    for test, kind in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


# ------------------------------------------------------------------------------------------ failed writes
_WRITE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "file too large (a file-size limit: "
                 "ulimit -f)", errno.EDQUOT: "disk quota exceeded"}
# A folder made read-only under a running job (its permissions, or the file system remounted read-only).
_DENIED_ERRNOS = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                  errno.EROFS: "read-only file system"}


def write_failure(e: BaseException, what: str, path: Path) -> str | None:
    """``no space or file too large while writing <what>: <cause>`` (``path``: where it goes) when ``e`` (or what
    it wraps: DCP gathers every rank's exception) is a failed write, or ``could not write <what>: permission denied
    on <file> ...`` for a folder made read-only under the run, else None. torch's zip writer reports a full
    disk or a file-size limit as ``RuntimeError ... unexpected pos``, without an errno: then the free space says
    which."""
    pending, seen = [e], []
    while pending:
        cause = pending.pop()
        if cause is None or any(cause is s for s in seen):
            continue
        seen.append(cause)
        pending += [cause.__cause__, cause.__context__]
        pending += [failure[0] for failure in getattr(cause, "failures", {}).values()]
        code = cause.errno if isinstance(cause, OSError) else None
        if code in _DENIED_ERRNOS:
            return (f"could not write {what}: {_DENIED_ERRNOS[code]} on {cause.filename or path} (its folder made "
                    "read-only under the run?): make it writable again")
        if code not in _WRITE_ERRNOS and not (isinstance(cause, RuntimeError) and (
                "unexpected pos" in str(cause) or "failed writing" in str(cause))):
            continue
        where = nearest_existing(path)
        free = shutil.disk_usage(where).free
        why = _WRITE_ERRNOS.get(code) or ("no space left on the device" if free < 64 << 20 else
                                          "file too large (a file-size limit: ulimit -f) or a quota")
        return f"no space or file too large while writing {what}: {why} ({free / 2**30:.2f} GiB free on {where})"
    return None


# ------------------------------------------------------------------------------------------ held files
class LockHeld(RuntimeError):
    """Another process holds the lock file: ``holder`` is the line it wrote (pid, host, start)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def hold_lock_file(path: Path, owner: str = "") -> IO[str]:
    """An exclusive ``fcntl.flock`` on ``path`` (created if missing), with this process's line written in it (pid,
    host, start time, then ``owner``): the open file, which holds it until closed or the process dies (the OS releases
    it, however the process ends). LockHeld, naming the holder's line, if another process holds it."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not written its name yet"
        handle.close()
        raise LockHeld(holder) from None
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}{owner}\n")
    handle.flush()
    return handle
