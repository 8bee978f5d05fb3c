"""The interface between the filesystem core and what keeps the namespace and the dirty
data: a `Backend`.

The core (objcache.core.filesystem) runs every POSIX check and keeps inodes, handles and
working copies; then it calls the backend to make a change real, much as JuiceFS's
`baseMeta` checks and then calls an engine's `doMknod`/`doRename`. Two backends:

- objcache.backend.local.LocalBackend: one node. Namespace changes go to S3 at once; file
  data goes to the local journal and is uploaded by the write-back loop.
- objcache.backend.replicated.ReplicatedBackend: a cluster member. Every change is a Raft
  transaction on the replicated namespace overlay; closed files are replicated to other
  nodes; each key's owner writes it back.

What a backend knows beyond S3 are entries (objcache.entries: files, directories); the
core shows them over S3's own listing, and hears of changes (another node's, a finished
upload) through `take_changes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from objcache.entries import Attrs, DirEntry, FileEntry, FlushScope, ObjectRef

if TYPE_CHECKING:
    from objcache.cache.localfiles import LocalFile
    from objcache.store import ObjectStore


@dataclass(frozen=True, slots=True)
class Change:
    """Something that changed a key outside the core's own calls.

    `key` is a file's key or a directory's marker key (ending in "/"); `entry` what the
    backend now records for it (None: nothing: it is gone, or S3 holds it); `uploaded`
    the S3 version that now holds it, when write-back finished; `ours`: made by one of this
    node's own calls (which updated the core already); `resync`: the backend no longer
    knows what happened to it (this node fell behind the cluster's log and took a
    snapshot): what the core knows of it is asked for again."""

    key: str
    entry: FileEntry | DirEntry | None
    uploaded: ObjectRef | None = None
    ours: bool = False
    resync: bool = False


@dataclass(frozen=True, slots=True)
class Moved:
    """An S3 object a rename copied: its old key and version (if the backend knows it),
    and its new ones."""

    old_key: str
    old_etag: str | None
    new_key: str
    new_etag: str


@dataclass(frozen=True, slots=True)
class Stats:
    """Write-back figures for status and metrics."""

    dirty_files: int
    dirty_bytes: int
    oldest_dirty_seconds: float | None
    uploaded: int
    failed: int
    streamed: int = 0  # files whose upload ran while they were written
    stream_fallbacks: int = 0  # streams given up (a write behind the seal): sent whole
    quarantined: int = 0  # files S3 refused for good, kept in the cache dir's lost+found/
    # cluster: changes that answered ETIMEDOUT and are not settled yet, and the outcomes
    # of the last ones settled (objcache.txn.coordinator.TxnClient.submit)
    in_doubt: tuple[str, ...] = ()
    settled: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NsView:
    """What the backend records below a prefix, taken under one lock: live entries (in key
    order) and the keys hidden by tombstones (deleted from the namespace, maybe still in
    S3)."""

    live: list[tuple[str, FileEntry | DirEntry]]
    hidden: frozenset[str]


NO_VIEW = NsView([], frozenset())


# The attributes the core knows for a key (from a HEAD), if any.
AttrsOf = Callable[[str], Attrs | None]


class Backend(Protocol):
    """Attributes:
    store: the bucket as this backend shows it (in a cluster, without what was deleted).
    sync_is_local: `sync` waits for nobody (one node): a caller may skip awaiting it and
        take the changes itself.
    """

    store: ObjectStore
    sync_is_local: bool

    async def run(self, *, task_status: Any = ...) -> None:
        """Background work (write-back); started before the mount, runs until shutdown."""
        ...

    # -- what is known beyond S3 ------------------------------------------------------------

    def entry(self, key: str) -> FileEntry | DirEntry | None:
        """The live entry of a key (a directory's by its marker key), if any."""
        ...

    def live_under(self, prefix: str) -> bool:
        """Whether any live entry lies below `prefix` (which ends in "/")."""
        ...

    def view_under(self, prefix: str) -> NsView:
        """Live entries and tombstoned keys below `prefix`, at one moment."""
        ...

    async def sync(self) -> bool:
        """Catch up with changes committed elsewhere before this call (a read barrier).
        False if nothing can have changed (one node)."""
        ...

    def take_changes(self) -> list[Change]:
        """What changed since the last call, in order (never blocks)."""
        ...

    async def wait_changes(self) -> None:
        """Return once `take_changes` has something."""
        ...

    # -- namespace changes (the core has checked them) --------------------------------------

    async def create(self, key: str, attrs: Attrs, excl: bool) -> FileEntry | None:
        """A new, empty file. None: nothing records it but its working copy, which must
        be dirty (so that write-back makes it exist in S3)."""
        ...

    async def mkdir(self, key: str, attrs: Attrs) -> DirEntry | None:
        """A new directory (None: its marker is in S3 now)."""
        ...

    async def make_node(self, key: str, attrs: Attrs, body: bytes) -> FileEntry | ObjectRef:
        """A new symlink (`body` is its target) or special file (FIFO, socket, device;
        `body` is empty): its entry, or the S3 object that now holds it."""
        ...

    async def unlink(self, key: str, maybe_in_s3: bool) -> None:
        """Remove a file or symlink (`maybe_in_s3`: the core saw an S3 object)."""
        ...

    async def rmdir(self, key: str, maybe_in_s3: bool) -> None:
        """Remove an empty directory (`key` without the trailing "/")."""
        ...

    async def rename(self, src: str, dst: str, is_dir: bool, replaces_dir: bool,
                     noreplace: bool, dir_attrs: Attrs | None, attrs_of: AttrsOf
                     ) -> list[Moved]:
        """Move a file, or a directory and everything below it, with what this node
        keeps for it (working copies). `replaces_dir`: `dst` is an empty directory that
        goes. Returns the S3 objects copied to their new keys."""
        ...

    async def set_dir_attrs(self, key: str, attrs: Attrs) -> DirEntry | None:
        """New attributes of a directory (None: its marker in S3 carries them now)."""
        ...

    async def set_file_attrs(self, key: str, current: FileEntry | ObjectRef, attrs: Attrs
                             ) -> FileEntry | ObjectRef:
        """New attributes of a file that has no working copy here, whose content is
        `current`: its new entry, or the S3 object that now carries them."""
        ...

    # -- working copies (files written on this node) -----------------------------------------

    async def working_attrs_changed(self, lf: LocalFile) -> ObjectRef | None:
        """chmod/chown/utimens changed a working copy's attributes; the S3 object that
        carries them now, if they went there at once."""
        ...

    async def close(self, key: str, lf: LocalFile, final: bool = False
                    ) -> FileEntry | None:
        """close() of a handle that wrote: make the working copy's content durable (the
        close-to-open point). The entry now recorded for the file, if any. `final`: no
        handle open for writing is left after this one (nothing we know of writes the
        working copy again before it is opened anew)."""
        ...

    async def fsync(self, key: str, lf: LocalFile) -> FileEntry | ObjectRef | None:
        """fsync(): as durable as this backend makes anything (S3 on one node)."""
        ...

    def released(self, lf: LocalFile) -> None:
        """The last handle of a working copy was closed."""
        ...

    async def read_blob(self, e: FileEntry, offset: int, length: int) -> bytes:
        """Bytes of an entry's sealed blob (from whichever node holds it)."""
        ...

    # -- write-back -------------------------------------------------------------------------

    async def flush(self, scope: FlushScope) -> int:
        """Return once everything dirty in `scope` is in S3; how much was written back."""
        ...

    async def drain(self) -> int:
        """Before leaving: write back everything this node owns or holds."""
        ...

    def stats(self) -> Stats: ...
