"""The replicated namespace overlay: what the cluster changed that S3 does not hold yet.

The bucket is the namespace of record for everything clean. This state machine holds the
difference, keyed by S3 object key (a directory by its marker key, ending in "/"), as typed
entries (objcache.entries):

- FileEntry: a file created, written, renamed or re-attributed in the cluster and not
  uploaded yet (content: a sealed blob held by `holders`, an S3 object `base`, a symlink
  target, or nothing);
- DirEntry: a directory created or re-attributed here (its marker is due);
- Tombstone: an S3 object that was unlinked or renamed away; it is hidden from listings and
  deleted from S3 by its owner once no entry reads it as a `base`.

Every command is one Raft log entry, so a change touching many keys (create = parent +
child, a directory rename with all its descendants) is atomic: all nodes apply all of it
at the same log index or none of it. Commands are validated here against the state at
apply time, deterministically (same log, same result on every node), so two nodes racing
on one name get one winner. A command that cannot apply raises a domain error
(objcache.errors), whose code is the command's result on every node. Write-back clears an
entry with `clean`, which only succeeds if the entry is still at the version uploaded.

Each entry has `ver`, the log position (applied count) of its last change: unique and
increasing, so `clean` can compare it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from objcache.entries import (
    Attrs,
    DirEntry,
    Entry,
    FileEntry,
    NsChange,
    ObjectRef,
    Tombstone,
    dir_from_wire,
    file_from_wire,
)
from objcache.errors import Exists, Gone, IsADirectory, NotADirectory, NotEmpty, NotFound

MAX_RENAME_OBJECTS = 100_000  # a directory rename is one log entry; bounded

# One S3 object a rename moves, as the coordinator listed it:
# [key, etag, size, mode, uid, gid, mtime_ns(, atime_ns, ctime_ns, rdev)]
S3Object = tuple[str, str, int, Attrs]


def _s3_object(o: list[Any]) -> S3Object:
    times = [int(x) for x in o[7:10]] + [0] * (10 - max(len(o), 7))
    return (str(o[0]), str(o[1]), int(o[2]),
            Attrs(int(o[3]), int(o[4]), int(o[5]), int(o[6]), *times))


@dataclass(frozen=True, slots=True)
class Claim:
    """A node's exclusive right to change a key in S3 until `until` (its wall clock, as
    written in the command), or until its clean or release."""

    node: str
    until: float


class Namespace:
    """Attributes:
    entries: key -> entry (see the module docstring).
    changes: what the command being applied changed, for the hook that updates this node's
        caches.
    claims: key -> the node now writing it to S3 (see `_claim`).
    """

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self._keys: list[str] = []  # sorted, for prefix queries
        self._bases: dict[str, int] = {}  # S3 key -> entries reading it as their base
        self.changes: list[NsChange] = []
        self.claims: dict[str, Claim] = {}

    def __setstate__(self, d: dict[str, Any]) -> None:  # a snapshot from before claims
        self.__dict__.update(d)
        self.__dict__.setdefault("claims", {})

    # -- reading (callers hold the state lock) -----------------------------------------------

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def under(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        """Entries whose key starts with `prefix`, in key order."""
        i = bisect.bisect_left(self._keys, prefix)
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            k = self._keys[i]
            yield k, self.entries[k]
            i += 1

    def live_under(self, prefix: str) -> bool:
        return any(not isinstance(e, Tombstone) for k, e in self.under(prefix) if k != prefix)

    def referenced(self, key: str) -> bool:
        """Does an entry other than `key`'s own still read the S3 object `key` as its base?"""
        own = self.entries.get(key)
        mine = 1 if isinstance(own, FileEntry) and own.base and own.base.key == key else 0
        return self._bases.get(key, 0) > mine

    def _count_base(self, e: Entry | None, delta: int) -> None:
        if isinstance(e, FileEntry) and e.base:
            n = self._bases.get(e.base.key, 0) + delta
            if n:
                self._bases[e.base.key] = n
            else:
                self._bases.pop(e.base.key, None)

    def cids(self) -> set[str]:
        return {e.cid for e in self.entries.values() if isinstance(e, FileEntry) and e.cid}

    # -- applying -------------------------------------------------------------------------

    def _set(self, key: str, entry: Entry, ver: int) -> None:
        if key not in self.entries:
            bisect.insort(self._keys, key)
        entry = replace(entry, ver=ver)
        self._count_base(self.entries.get(key), -1)
        self._count_base(entry, +1)
        self.entries[key] = entry
        self.changes.append(NsChange(key, entry))

    def _del(self, key: str, uploaded: ObjectRef | None = None, moved: bool = False
             ) -> Entry | None:
        e = self.entries.pop(key, None)
        if e is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]
            self._count_base(e, -1)
            self.changes.append(NsChange(key, None, uploaded, moved))
        return e

    def _tomb(self, key: str, ver: int) -> None:
        self._set(key, Tombstone(), ver)

    def _live(self, key: str) -> FileEntry | DirEntry | None:
        e = self.entries.get(key)
        return None if e is None or isinstance(e, Tombstone) else e

    def apply(self, op: str, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """Apply one `ns.<op>` command; a refused one changes nothing and its result is the
        error's code. Malformed commands raise (KeyError, TypeError, ValueError) before any
        change."""
        self.changes = []
        handler = getattr(self, "_" + op)
        try:
            return handler(cmd, ver)
        except (NotFound, Exists, NotEmpty, IsADirectory, NotADirectory) as e:
            return {"error": e.code}

    def _noop(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        return {"ok": True}

    def _create(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """A new file, directory or symlink (S3 only changes through us, so what the
        coordinator saw there is not checked again)."""
        key = str(cmd["key"])
        is_dir = key.endswith("/")
        twin = key[:-1] if is_dir else key + "/"
        entry: Entry = dir_from_wire(cmd["e"]) if is_dir else file_from_wire(cmd["e"])
        a_dir = self._live(key if is_dir else twin) is not None \
            or self.live_under(key.rstrip("/") + "/")
        a_file = self._live(twin if is_dir else key) is not None
        if is_dir and (a_dir or a_file):
            raise Exists(key)
        if not is_dir and a_dir:
            raise IsADirectory(key)
        if not is_dir and a_file and cmd.get("excl", True):
            raise Exists(key)
        self._set(key, entry, ver)
        return {"ok": True, "ver": ver}

    def _commit(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """New content and/or attributes of a file (close, fsync, setattr). Refused if the
        file was unlinked meanwhile (an unlinked open file must not come back)."""
        key = str(cmd["key"])
        cur = self.entries.get(key)
        if cur is not None and not isinstance(cur, FileEntry):
            raise Gone(key)
        if cur is None and cmd.get("must_exist"):
            raise Gone(key)
        self._set(key, file_from_wire(cmd["e"]), ver)
        return {"ok": True, "ver": ver}

    def _setdir(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        key = str(cmd["key"])
        if isinstance(self.entries.get(key), Tombstone):
            raise Gone(key)
        self._set(key, dir_from_wire(cmd["e"]), ver)
        return {"ok": True, "ver": ver}

    def _unlink(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        key = str(cmd["key"])
        cur = self._live(key)
        if cur is None and not cmd.get("s3"):
            raise NotFound(key)
        if cur is not None and not isinstance(cur, FileEntry):
            raise IsADirectory(key)
        self._del(key)
        if cmd.get("s3") or key in self.claims:
            # (claimed: a write-back may be putting it into S3 right now; the tombstone
            # has the object deleted after it lands, or it would come back)
            self._tomb(key, ver)
        return {"ok": True}

    def _rmdir(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        key = str(cmd["key"])
        if not key.endswith("/"):
            raise ValueError("a directory key ends with /")
        if self.live_under(key):
            raise NotEmpty(key)
        if self._live(key) is None and not cmd.get("s3"):
            raise NotFound(key)
        self._del(key)  # tombstones below stay: their S3 objects still have to go
        if cmd.get("s3"):
            self._tomb(key, ver)
        return {"ok": True}

    def _rename(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """Move `src` to `dst` (a file, or a directory with everything below it).

        `objects`: what the coordinator listed in S3 under the source; entries here win
        over them. Each S3 object moves as an entry whose content is the old object (`base`)
        and is tombstoned at the old key."""
        src, dst, is_dir = str(cmd["src"]), str(cmd["dst"]), bool(cmd["dir"])
        raw = cmd.get("objects") or []
        if not isinstance(raw, list) or len(raw) > MAX_RENAME_OBJECTS:
            raise TypeError(f"objects must be a list of at most {MAX_RENAME_OBJECTS} entries")
        at = float(cmd.get("at", 0))
        # Everything is parsed before anything changes: a malformed command changes nothing.
        objects = [_s3_object(o) for o in raw]
        dir_attrs = replace(dir_from_wire(cmd["e"]), at=at) if is_dir else None
        if is_dir:
            sp, dp = src + "/", dst + "/"
            moved = list(self.under(sp))
            s3 = {o[0]: o for o in objects if o[0].startswith(sp)}
            if not moved and not s3:
                raise NotFound(src)
            if self.live_under(dp):
                raise NotEmpty(dst)
            if self._live(dst) is not None:
                raise NotADirectory(dst)
            plan = [(k, dp + k[len(sp):]) for k, _ in moved]
            plan += [(k, dp + k[len(sp):]) for k in s3 if k not in self.entries]
        else:
            s3 = {o[0]: o for o in objects if o[0] == src}
            cur = self.entries.get(src)
            if isinstance(cur, Tombstone) or (cur is None and not s3):
                raise NotFound(src)
            if self._live(dst + "/") is not None or self.live_under(dst + "/"):
                raise IsADirectory(dst)
            plan = [(src, dst)]
        if cmd.get("noreplace") and any(self._live(d) is not None for _, d in plan):
            raise Exists(dst)
        for old, new in plan:
            e = self.entries.get(old)
            if isinstance(e, Tombstone):
                continue  # an already deleted object stays deleted (and out of the move)
            if e is None:
                o = s3[old]
                attrs = o[3]
                e = (DirEntry(attrs, at) if old.endswith("/") else
                     FileEntry(attrs, o[2], base=ObjectRef(old, o[1], o[2]), at=at))
            else:
                self._del(old, moved=True)
                e = replace(e, at=at)
            if old in (src, src + "/"):  # what was renamed (not its contents): new ctime
                e = replace(e, attrs=e.attrs.changed_at(int(at * 1e9)))
            self._set(new, e, ver)
            if old in s3 or old in self.claims:  # (claimed: see _unlink)
                self._tomb(old, ver)
        if is_dir:
            if dir_attrs is not None and self._live(dp) is None:
                self._set(dp, dir_attrs, ver)
            self.changes.append(NsChange(src + "/", None, moved=True))  # the directory moved
        return {"ok": True, "moved": len(plan)}

    def _claim(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """`node` is about to change `key` in S3 to its entry at version `ver` (one PUT,
        the completion of a multipart upload, a copy or a delete). Granted only if that is
        still the entry's version and no other node holds an unexpired claim: so two nodes
        that both think they own a key (a membership change, a flush, a crowded cache)
        never write it at once, and an older version's write can never land after a newer
        one's was written and cleaned. The claim ends with the node's clean or release, or
        at `at + lease` (longer than the S3 call and its retries can take)."""
        key, node = str(cmd["key"]), str(cmd["node"])
        at, lease = float(cmd["at"]), float(cmd["lease"])
        cur = self.entries.get(key)
        if cur is None or cur.ver != int(cmd["ver"]):
            return {"ok": False, "stale": True}
        held = self.claims.get(key)
        if held is not None and held.node != node and held.until > at:
            return {"ok": False, "by": held.node}
        if len(self.claims) > 2 * len(self.entries) + 1024:  # expired ones, now and then
            self.claims = {k: c for k, c in self.claims.items()
                           if c.until > at and k in self.entries}
        self.claims[key] = Claim(node, at + lease)
        return {"ok": True}

    def _release(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        key, node = str(cmd["key"]), str(cmd["node"])
        held = self.claims.get(key)
        if held is not None and held.node == node:
            del self.claims[key]
        return {"ok": True}

    def _clean(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """Write-back finished `key` at version `ver`: forget the entry if it is unchanged
        (and, either way, the claim of the node that wrote it)."""
        key = str(cmd["key"])
        if "node" in cmd:
            self._release(cmd, ver)
        cur = self.entries.get(key)
        if cur is None or cur.ver != int(cmd["ver"]):
            return {"ok": False}
        etag = cmd.get("etag")
        size = cur.size if isinstance(cur, FileEntry) else 0
        # A directory's marker is in S3 now (it has no ETag worth keeping): that is an
        # upload, not a removal, to every node's view of the directory.
        stored = etag or (isinstance(cur, DirEntry) and cmd.get("stored", True))
        self._del(key, uploaded=ObjectRef(key, str(etag or ""), size) if stored else None)
        return {"ok": True}

    def _holders(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """Record that more nodes hold a blob (a new owner pulled it, or a drain handed it
        off); the entry's version does not change."""
        key = str(cmd["key"])
        cur = self.entries.get(key)
        if not isinstance(cur, FileEntry) or cur.cid != cmd.get("cid"):
            return {"ok": False}
        drop = {str(h) for h in cmd.get("remove") or []}
        hs = [h for h in cur.holders if h not in drop]
        hs += [str(h) for h in cmd.get("add") or [] if str(h) not in hs]
        self.entries[key] = replace(cur, holders=tuple(hs))
        return {"ok": True}

