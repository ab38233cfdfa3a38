"""File plumbing shared by the CLI's files (:mod:`eplb.io`) and :class:`eplb.LoadRecorder`: weights-only
``torch.load`` with a plain reason, and atomic writes (all files or none)."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Callable

import torch

__all__ = ["atomic_write", "atomic_write_all"]


def _torch_load(path):
    """torch.load, weights only, without the unpickler's warnings on bad bytes. A file torch cannot
    read raises ValueError with the first sentence of torch's reason (its full text suggests
    ``weights_only=False``, wrong advice for a corrupt file); a missing one raises OSError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as exc:
        first = _reason(exc).split(". ")[0].rstrip(".")
        raise ValueError(f"corrupt, truncated or not a weights-only torch.save file: {first}") from exc


def _reason(exc: BaseException) -> str:
    """First line of an exception's message (its type name when it has none)."""
    msg = str(exc).strip()
    if isinstance(exc, KeyError):
        msg = f"missing key {msg}"
    return msg.splitlines()[0] if msg else type(exc).__name__


def _fsync(path: str, folder: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _named(exc: OSError, path: str) -> OSError:
    """The same OSError with the user's path instead of a temporary file name."""
    return OSError(f"cannot write {path}: {exc.strerror or _reason(exc)}")


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write one file atomically (see `atomic_write_all`)."""
    atomic_write_all([(path, write)])


def atomic_write_all(items: list[tuple[str, Callable[[str], None]]]) -> None:
    """Write several files all or none: each ``write(tmp)`` fills a temporary file in its target's
    folder, which is fsynced; only when every one succeeded are they renamed into place (os.replace,
    atomic per file) and the folders fsynced. A crash or error before that leaves every previous file
    as it was (a killed process may leave a ``.tmp-*`` file behind). Errors name the target path,
    never the temporary one (OSError for the file system, the writer's own exception otherwise)."""
    umask = os.umask(0)
    os.umask(umask)
    done: list[tuple[str, str]] = []
    try:
        for path, write in items:
            tmp = None
            try:
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(path)))
                os.close(fd)
                done.append((path, tmp))
                write(tmp)
                os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
                _fsync(tmp)
            except OSError as exc:
                raise _named(exc, path) from exc
        for path, tmp in done:
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise _named(exc, path) from exc
        for folder in {os.path.dirname(os.path.abspath(p)) for p, _ in done}:
            try:
                _fsync(folder, folder=True)
            except OSError:
                pass  # some file systems cannot fsync a folder; the files themselves are synced
    finally:
        for _, tmp in done:
            if os.path.exists(tmp):
                os.unlink(tmp)
