"""Domain exceptions and the single table that maps them to errno values.

Every layer below the FUSE adapter raises these; `errno_of` is the one place where an
exception becomes an errno. Anything not listed here is a bug and becomes EIO (logged).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager


class ObjcacheError(Exception):
    """Base class; `errno` is what the FUSE layer replies with."""

    errno: int = errno.EIO


class NotFound(ObjcacheError):
    errno = errno.ENOENT


class Exists(ObjcacheError):
    errno = errno.EEXIST


class NotEmpty(ObjcacheError):
    errno = errno.ENOTEMPTY


class IsADirectory(ObjcacheError):
    errno = errno.EISDIR


class NotADirectory(ObjcacheError):
    errno = errno.ENOTDIR


class NoSpace(ObjcacheError):
    """The cache holds only dirty or pinned data; nothing clean is left to evict."""

    errno = errno.ENOSPC


class ReadOnly(ObjcacheError):
    errno = errno.EROFS


class Invalid(ObjcacheError):
    errno = errno.EINVAL


class NotSupported(ObjcacheError):
    errno = errno.ENOTSUP


class NameTooLong(ObjcacheError):
    errno = errno.ENAMETOOLONG


class StaleObject(ObjcacheError):
    """The object changed in S3 while a handle was reading the old version."""

    errno = errno.ESTALE


class StoreError(ObjcacheError):
    """A permanent object-store failure (after retries, or not retryable)."""

    errno = errno.EIO


class StoreUnavailable(StoreError):
    """The object store could not be reached within the retry budget."""


class PeerError(ObjcacheError):
    """A peer could not answer (unreachable, timed out, closed, or failed). Readers fall back
    to another owner or to S3; it reaches a FUSE reply only as EIO if everything failed."""

    errno = errno.EIO


class ProtocolError(PeerError):
    """A peer sent something that is not a valid frame or message: drop the connection."""


class AuthError(ProtocolError):
    """A peer does not hold the cluster secret (or we do not hold its)."""


class UserError(Exception):
    """A CLI-level error: printed as one line, then the command exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def unwrap(exc: BaseException) -> BaseException:
    """The first error inside (nested) exception groups, which trio nurseries raise."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def errno_of(exc: BaseException) -> int:
    """The errno for a domain exception; OSError keeps its own; everything else is EIO."""
    exc = unwrap(exc)
    if isinstance(exc, ObjcacheError):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        # A full cache disk: the write was not acknowledged, so nothing is lost.
        return errno.ENOSPC
    return errno.EIO


@contextmanager
def first_error() -> Iterator[None]:
    """Around a trio nursery: re-raise the first failure itself instead of a group, so
    callers can catch domain exceptions by type."""
    try:
        yield
    except BaseExceptionGroup as eg:
        raise unwrap(eg) from None
