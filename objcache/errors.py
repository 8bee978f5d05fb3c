"""Domain exceptions and the one table of error codes.

Every layer below the FUSE adapter raises these. Each kind has one row in `_TABLE`: its
errno (what the application sees) and its code (what crosses the wire: peer replies and
the results of replicated namespace commands). `errno_of` is the one place where an
exception becomes an errno, `error_from_code` the one place where a code becomes an
exception again. Anything not listed here is a bug and becomes EIO (logged).
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Iterator
from contextlib import contextmanager


class ObjcacheError(Exception):
    """Base class: `errno` is what the FUSE layer replies, `code` what the wire carries
    (both set from `_TABLE` below)."""

    errno: int = _errno.EIO
    code: str = "failed"


class NotFound(ObjcacheError):
    pass


class Gone(NotFound):
    """A file was removed (by another node) before this change to it committed."""


class Exists(ObjcacheError):
    pass


class NotEmpty(ObjcacheError):
    pass


class IsADirectory(ObjcacheError):
    pass


class NotADirectory(ObjcacheError):
    pass


class NoSpace(ObjcacheError):
    """The cache holds only dirty or pinned data; nothing clean is left to evict."""


class ReadOnly(ObjcacheError):
    pass


class Invalid(ObjcacheError):
    pass


class NameTooLong(ObjcacheError):
    pass


class FileTooBig(ObjcacheError):
    """Beyond the largest object the multipart part schedule can upload."""


class StaleObject(ObjcacheError):
    """The object changed in S3 while a handle was reading the old version."""


class StoreError(ObjcacheError):
    """A permanent object-store failure (after retries, or not retryable)."""


class StoreUnavailable(StoreError):
    """The object store could not be reached within the retry budget."""


class StoreRefused(StoreError):
    """The object store refused a request for good (a 4xx other than throttling): retrying
    the same request cannot help."""


class NoQuorum(ObjcacheError):
    """A replicated change could not be committed in time (no leader, or no majority).
    Raised to a FUSE call only once it is settled that the change never takes effect.
    `maybe_sent`: (raft layer) the command may have reached a leader's log."""

    maybe_sent = True


class InDoubt(NoQuorum):
    """A change that could not commit in time and whose outcome could not be settled
    either (this node is cut off from the majority): it may still take effect, once,
    whole. ETIMEDOUT, so that an application can tell it from EIO (it did not and never
    will); `objcache status` shows the outcome once it is settled."""


class PeerError(ObjcacheError):
    """A peer could not answer (unreachable, timed out, closed, or failed). Readers fall back
    to another owner or to S3; it reaches a FUSE reply only as EIO if everything failed.
    `answered`: the peer replied with this error (it is alive)."""

    answered = False


class Conflict(PeerError):
    """A peer refused a request because it contradicts what it knows (a node id in use)."""

    answered = True


class ProtocolError(PeerError):
    """A peer sent something that is not a valid frame or message: drop the connection."""


class AuthError(ProtocolError):
    """A peer does not hold the cluster secret (or we do not hold its)."""


class BadChecksum(ProtocolError):
    """A peer's chunk bytes do not match the block sums it sent with them."""


# The one table: exception -> (wire code, errno). Codes are stable: they are in Raft logs.
_TABLE: dict[type[ObjcacheError], tuple[str, int]] = {
    ObjcacheError: ("failed", _errno.EIO),
    NotFound: ("notfound", _errno.ENOENT),
    Gone: ("gone", _errno.ENOENT),
    Exists: ("exists", _errno.EEXIST),
    NotEmpty: ("notempty", _errno.ENOTEMPTY),
    IsADirectory: ("isdir", _errno.EISDIR),
    NotADirectory: ("notdir", _errno.ENOTDIR),
    NoSpace: ("nospace", _errno.ENOSPC),
    ReadOnly: ("readonly", _errno.EROFS),
    Invalid: ("invalid", _errno.EINVAL),
    NameTooLong: ("nametoolong", _errno.ENAMETOOLONG),
    FileTooBig: ("toobig", _errno.EFBIG),
    StaleObject: ("stale", _errno.ESTALE),
    StoreError: ("store", _errno.EIO),
    StoreUnavailable: ("unavailable", _errno.EIO),
    StoreRefused: ("refused", _errno.EIO),
    NoQuorum: ("noquorum", _errno.EIO),
    InDoubt: ("indoubt", _errno.ETIMEDOUT),
    PeerError: ("peer", _errno.EIO),
    Conflict: ("conflict", _errno.EIO),
    ProtocolError: ("protocol", _errno.EIO),
    AuthError: ("auth", _errno.EIO),
    BadChecksum: ("badsum", _errno.EIO),
}
for _cls, (_code, _no) in _TABLE.items():
    _cls.code, _cls.errno = _code, _no
_BY_CODE = {code: cls for cls, (code, _) in _TABLE.items()}


def error_from_code(code: object, message: str) -> ObjcacheError:
    """The exception a wire code stands for (an unknown code is a plain failure)."""
    cls = _BY_CODE.get(code if isinstance(code, str) else "", ObjcacheError)
    return cls(message)


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
    """The errno for a domain exception; a full disk is ENOSPC; everything else is EIO."""
    exc = unwrap(exc)
    if isinstance(exc, ObjcacheError):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
        # A full cache disk: the write was not acknowledged, so nothing is lost.
        return _errno.ENOSPC
    return _errno.EIO


@contextmanager
def first_error() -> Iterator[None]:
    """Around a trio nursery: re-raise the first failure itself instead of a group, so
    callers can catch domain exceptions by type."""
    try:
        yield
    except BaseExceptionGroup as eg:
        raise unwrap(eg) from None
