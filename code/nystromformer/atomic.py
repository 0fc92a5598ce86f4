"""Atomic file writes: write a temporary file beside the target, fsync, rename.

A reader (or a resumed run) sees either the old file or the complete new one, never half of one.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

PathLike = Union[str, os.PathLike]


def check_output_folder(path: PathLike, flag: str = "--output", inputs: Sequence[PathLike] = (),
                        error: Optional[type] = None) -> None:
    """A folder can be made at ``path``, and it is not one of the ``inputs`` folders or inside one (what is written
    there would be read back as input on the next run): checked before a command's slow work, so that either is one
    error line (``error``, default UserError), not a traceback at the end or data read twice."""
    from .errors import UserError
    error = error or UserError
    path = Path(path)
    for folder in map(Path, inputs):
        if folder.is_dir() and (path.resolve() == folder.resolve() or folder.resolve() in path.resolve().parents):
            raise error(f"{flag} {path}: is inside the input folder {folder}; write it elsewhere (its files would "
                        f"be read back as input)")
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise error(f"{flag} {path}: {p} is a file, not a folder")
            return


def check_writable_folder(path: PathLike, what: str) -> None:
    """``what`` can be written under ``path`` (or ``path`` made, if missing; nothing is created here): checked before
    a command's slow work, so that a read-only mount or another user's folder is one error line before training,
    not a traceback after it."""
    from .errors import UserError
    path = Path(path)
    check_output_folder(path, what)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):  # access() also reports a read-only file system
        raise UserError(f"{what} cannot be written to {path}: {existing} is not writable by this user "
                        f"(or is on a read-only file system)")


@contextmanager
def atomic_open(path: PathLike, mode: str = "wb") -> Iterator:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())  # mkstemp makes 0600; give the mode open() would
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def current_umask() -> int:
    """The process umask, read without changing it where possible (shared by every module that sets modes)."""
    # Read from /proc where there is one: setting the umask to read it back briefly changes it process-wide.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def swap_folder(new: Path, target: Path, aside: Path) -> None:
    """Rename ``target`` (if there is one) to ``aside`` and ``new`` into its place; the caller removes ``aside``.

    An exception between the renames (KeyboardInterrupt, SIGTERM raised as one) puts the old folder back; a kill
    there leaves no ``target`` but ``aside`` intact, for the caller's next run to restore."""
    try:
        if target.exists():
            os.rename(target, aside)
        os.rename(new, target)
    except BaseException:
        # Judged from the file system: the exception may arrive just before or just after either rename.
        if not os.path.lexists(target) and os.path.isdir(aside):
            os.rename(aside, target)
        raise
    fsync_dir(target.parent)


def write_json(path: PathLike, obj) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_text(path: PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def save_npy(path: PathLike, array: np.ndarray) -> None:
    with atomic_open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)


def torch_save(path: PathLike, obj) -> None:
    with atomic_open(path, "wb") as f:
        torch.save(obj, f)


# flock's errors on file systems that have none (Lustre without -o flock, some FUSE mounts)
NO_FLOCK_ERRNOS = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP}


@contextmanager
def exclusive_lock(path: Path, busy: Callable[[str], Exception], content: Optional[str] = None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created, then holding ``content``, by default "HOST pid PID") while the
    block runs; another process holding it raises ``busy(what the file says)`` at once. The lock goes with the
    process, so a killed one leaves none behind; on a file system without flock, a warning and no lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(os.read(fd, 200).decode(errors="replace").strip() or "another process") from None
        except OSError as e:
            if e.errno not in NO_FLOCK_ERRNOS:
                raise
            print(f"warning: {path}: this file system does not support locks ({e.strerror}); going on without one",
                  file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.write(fd, (content or f"{socket.gethostname()} pid {os.getpid()}\n").encode())
        yield
    finally:
        os.close(fd)
