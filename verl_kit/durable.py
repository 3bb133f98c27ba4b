"""Durable writes: what a crash, a power loss or a full disk leaves must be the old version or the new one, never half
of either. A file or directory is written under a temporary name, flushed to the device (fsync of every file and of
its directory), and only then renamed into place; a directory that is replaced is renamed aside first and deleted
last (torch distributed checkpointing's FileSystemWriter: data, then `.metadata` last). Only os and shutil: every
layer of the kit may use it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

# A failed write the user can act on (free space, quota, permissions, a failing disk), not a bug of the kit.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EIO)
LOW_SPACE_BYTES = 64 << 20


def fsync_dir(path: str) -> None:
    """Make the names in directory `path` (a rename, a new or removed entry) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under `root`, then every directory, deepest first."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def write_text(path: str, text: str) -> None:
    """Replace file `path` by `text` atomically and durably (a temporary beside it, fsync, rename, fsync the dir)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def replace_dir(tmp: str, final: str) -> None:
    """Move the complete directory `tmp` to `final` durably: `tmp` synced, an existing `final` renamed aside to
    `final.old`, `tmp` renamed in, the parent synced, then `final.old` deleted. A failed rename puts the old one
    back; a crash at any point leaves `final` or `final.old` whole (sweep_aside puts the old one back)."""
    fsync_tree(tmp)
    old = f"{final.rstrip('/')}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if os.path.exists(old) and not os.path.exists(final):
            os.rename(old, final)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def remove_dir(path: str) -> None:
    """Delete a directory so that a crash midway leaves it whole or gone, never half: renamed to `.deleted-<name>`
    beside it first (one atomic rename), then deleted; sweep_deleted removes what a crash left of the deletion."""
    parent, name = os.path.split(path.rstrip("/"))
    gone = os.path.join(parent, f".deleted-{name}")
    shutil.rmtree(gone, ignore_errors=True)
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def sweep_deleted(parent: str) -> None:
    """The remains of remove_dir calls a crash interrupted, in `parent`."""
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        if name.startswith(".deleted-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def sweep_aside(final: str) -> None:
    """After a crash inside replace_dir: `final.old` is put back when `final` is missing, deleted otherwise."""
    old = f"{final.rstrip('/')}.old"
    if os.path.isdir(old):
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, final)


def write_failure(e: BaseException, directory: str) -> str | None:
    """Why writing into `directory` failed, in words, when `e` is the device's or the file system's doing (no space,
    quota, read-only, I/O error); None for any other error (a bug: let it raise). torch.save reports a full disk as
    a RuntimeError without errno ("unexpected pos ..."), so an error is also the device's when little space is left."""
    seen, chain = e, []
    while seen is not None and len(chain) < 10:  # the error, its cause, the cause's cause...
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for err in list(chain):  # torch.distributed.checkpoint's CheckpointException: each rank's (error, traceback)
        chain += [f[0] if isinstance(f, tuple) else f for f in (getattr(err, "failures", None) or {}).values()]
    for err in chain:
        if isinstance(err, OSError) and err.errno in WRITE_ERRNOS:
            return os.strerror(err.errno)
        if "No space left on device" in str(err):
            return os.strerror(errno.ENOSPC)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if free < LOW_SPACE_BYTES:
        return f"{str(e).splitlines()[0] if str(e) else type(e).__name__}, with {free >> 20} MiB left on the device"
    return None
