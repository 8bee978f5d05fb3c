"""The replicated namespace overlay: what the cluster changed that S3 does not hold yet.

The bucket is the namespace of record for everything clean. This state machine holds the
difference, keyed by S3 object key (a directory by its marker key, ending in "/"):

- file entries ("f"): a file created, written, renamed or re-attributed in the cluster and
  not uploaded yet. Its content is a sealed blob `cid` held by the nodes in `holders`
  (replication), or the S3 object `base` (a renamed or chmod'ed clean file, copied
  server-side at write-back), or empty. Symlinks are file entries with a `target`.
- directory entries ("d"): a directory created or re-attributed here (its marker is due).
- tombstones ("x"): an S3 object that was unlinked or renamed away; it is hidden from
  listings and deleted from S3 by its owner once no entry reads it as a `base`.

Every command is one Raft log entry, so a change touching many keys (create = parent +
child, a directory rename with all its descendants) is atomic: all nodes apply all of it
at the same log index or none of it. Commands are validated here against the state at
apply time, deterministically (same log, same result on every node), so two nodes racing
on one name get one winner. Write-back clears an entry with `clean`, which only succeeds if
the entry is still at the version that was uploaded: a write racing an upload stays dirty.

Each entry has `ver`, the log position (applied count) of its last change: unique and
increasing, so `clean` can compare it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

FILE, DIR, TOMB = "f", "d", "x"
_ATTRS = ("mode", "uid", "gid", "mtime")
MAX_RENAME_OBJECTS = 100_000  # a directory rename is one log entry; bounded


class NsError(Exception):
    """A command that cannot apply; `code` becomes the result's error (same everywhere)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _file_entry(e: dict[str, Any]) -> dict[str, Any]:
    """A validated copy of a file entry from a command."""
    out = {"t": FILE, "size": int(e.get("size", 0)), "cid": e.get("cid"),
           "holders": [str(h) for h in e.get("holders") or []],
           "base": e.get("base"), "target": e.get("target"), "at": float(e.get("at", 0))}
    for a in _ATTRS:
        out[a] = int(e[a])
    if out["cid"] is not None and not isinstance(out["cid"], str):
        raise TypeError("cid must be a string")
    b = out["base"]
    if b is not None and not (isinstance(b, list) and len(b) == 3 and isinstance(b[0], str)
                              and isinstance(b[1], str) and isinstance(b[2], int)):
        raise TypeError("base must be [key, etag, size]")
    if out["target"] is not None and not isinstance(out["target"], bytes):
        raise TypeError("target must be bytes")
    return out


def _dir_entry(e: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"t": DIR, "at": float(e.get("at", 0))}
    for a in _ATTRS:
        out[a] = int(e[a])
    return out


class Namespace:
    """Attributes:
    entries: key -> entry (see the module docstring).
    changes: (key, entry or None, extra) of the command being applied, for the hook that
        updates this node's caches (the daemon resets it after each command).
    """

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self._keys: list[str] = []  # sorted, for prefix queries
        self._bases: dict[str, int] = {}  # S3 key -> entries reading it as their base
        self.changes: list[tuple[str, dict[str, Any] | None, Any]] = []

    # -- reading (callers hold the state lock) -----------------------------------------------

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def under(self, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Entries whose key starts with `prefix`, in key order."""
        i = bisect.bisect_left(self._keys, prefix)
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            k = self._keys[i]
            yield k, self.entries[k]
            i += 1

    def live_under(self, prefix: str) -> bool:
        return any(e["t"] != TOMB for k, e in self.under(prefix) if k != prefix)

    def referenced(self, key: str) -> bool:
        """Does an entry other than `key`'s own still read the S3 object `key` as its base?"""
        own = self.entries.get(key)
        mine = 1 if own is not None and own.get("base") and own["base"][0] == key else 0
        return self._bases.get(key, 0) > mine

    def _count_base(self, e: dict[str, Any] | None, delta: int) -> None:
        b = e.get("base") if e is not None else None
        if b:
            n = self._bases.get(b[0], 0) + delta
            if n:
                self._bases[b[0]] = n
            else:
                self._bases.pop(b[0], None)

    def cids(self) -> set[str]:
        return {e["cid"] for e in self.entries.values() if e.get("cid")}

    # -- applying -------------------------------------------------------------------------

    def _set(self, key: str, entry: dict[str, Any], ver: int, extra: Any = None) -> None:
        if key not in self.entries:
            bisect.insort(self._keys, key)
        self._count_base(self.entries.get(key), -1)
        self._count_base(entry, +1)
        entry["ver"] = ver
        self.entries[key] = entry
        self.changes.append((key, entry, extra))

    def _del(self, key: str, extra: Any = None) -> dict[str, Any] | None:
        e = self.entries.pop(key, None)
        if e is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]
            self._count_base(e, -1)
            self.changes.append((key, None, extra))
        return e

    def _tomb(self, key: str, ver: int) -> None:
        self._set(key, {"t": TOMB, "at": 0.0}, ver)

    def _live(self, key: str) -> dict[str, Any] | None:
        e = self.entries.get(key)
        return e if e is not None and e["t"] != TOMB else None

    def apply(self, op: str, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        self.changes = []
        try:
            return getattr(self, "_" + op)(cmd, ver)
        except NsError as e:
            return {"error": e.code}

    def _noop(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        return {"ok": True}

    def _create(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """A new file, directory or symlink. `exists_in_s3`: the coordinator saw the name
        taken in S3 (it re-checks nothing here: S3 only changes through us)."""
        key = str(cmd["key"])
        is_dir = key.endswith("/")
        twin = key[:-1] if is_dir else key + "/"
        entry = _dir_entry(cmd["e"]) if is_dir else _file_entry(cmd["e"])
        a_dir = self._live(key if is_dir else twin) is not None \
            or self.live_under(key.rstrip("/") + "/")
        a_file = self._live(twin if is_dir else key) is not None
        if is_dir and (a_dir or a_file):
            raise NsError("exists")
        if not is_dir and a_dir:
            raise NsError("isdir")
        if not is_dir and a_file and cmd.get("excl", True):
            raise NsError("exists")
        self._set(key, entry, ver)
        return {"ok": True, "ver": ver}

    def _commit(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """New content and/or attributes of a file (close, fsync, setattr). Refused if the
        file was unlinked meanwhile (an unlinked open file must not come back)."""
        key = str(cmd["key"])
        cur = self.entries.get(key)
        if cur is not None and cur["t"] != FILE:
            raise NsError("gone")
        if cur is None and cmd.get("must_exist"):
            raise NsError("gone")
        entry = _file_entry(cmd["e"])
        self._set(key, entry, ver)
        return {"ok": True, "ver": ver}

    def _setdir(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        key = str(cmd["key"])
        cur = self.entries.get(key)
        if cur is not None and cur["t"] == TOMB:
            raise NsError("gone")
        self._set(key, _dir_entry(cmd["e"]), ver)
        return {"ok": True, "ver": ver}

    def _unlink(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        key = str(cmd["key"])
        cur = self._live(key)
        if cur is None and not cmd.get("s3"):
            raise NsError("notfound")
        if cur is not None and cur["t"] != FILE:
            raise NsError("isdir")
        self._del(key)
        if cmd.get("s3"):
            self._tomb(key, ver)
        return {"ok": True}

    def _rmdir(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        key = str(cmd["key"])
        if not key.endswith("/"):
            raise ValueError("a directory key ends with /")
        if self.live_under(key):
            raise NsError("notempty")
        if self._live(key) is None and not cmd.get("s3"):
            raise NsError("notfound")
        self._del(key)  # tombstones below stay: their S3 objects still have to go
        if cmd.get("s3"):
            self._tomb(key, ver)
        return {"ok": True}

    def _rename(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """Move `src` to `dst` (a file, or a directory with everything below it).

        `objects`: what the coordinator listed in S3 under the source ([key, etag, size,
        mode, uid, gid, mtime]); entries here win over them. Each S3 object moves as an
        entry whose content is the old object (`base`) and is tombstoned at the old key.
        `replace_s3`: the destination existed in S3 (so a directory destination's marker is
        superseded)."""
        src, dst, is_dir = str(cmd["src"]), str(cmd["dst"]), bool(cmd["dir"])
        objects = cmd.get("objects") or []
        if not isinstance(objects, list) or len(objects) > MAX_RENAME_OBJECTS:
            raise TypeError("objects must be a list of at most "
                            f"{MAX_RENAME_OBJECTS} entries")
        at = float(cmd.get("at", 0))
        # Everything is parsed before anything changes: a malformed command changes nothing.
        objects = [(str(o[0]), str(o[1]), int(o[2]), int(o[3]), int(o[4]), int(o[5]),
                    int(o[6])) for o in objects]
        dir_attrs = _dir_entry(dict(cmd["e"], at=at)) if is_dir else None
        if is_dir:
            sp, dp = src + "/", dst + "/"
            moved = list(self.under(sp))
            s3 = {o[0]: o for o in objects if o[0].startswith(sp)}
            if not moved and not s3:
                raise NsError("notfound")
            if self.live_under(dp):
                raise NsError("notempty")
            if self._live(dst) is not None:
                raise NsError("notdir")
            plan = [(k, dp + k[len(sp):]) for k, _ in moved]
            plan += [(k, dp + k[len(sp):]) for k in s3 if k not in self.entries]
        else:
            s3 = {o[0]: o for o in objects if o[0] == src}
            cur = self.entries.get(src)
            if (cur is not None and cur["t"] == TOMB) or (cur is None and not s3):
                raise NsError("notfound")
            if self._live(dst + "/") is not None or self.live_under(dst + "/"):
                raise NsError("isdir")
            plan = [(src, dst)]
        if cmd.get("noreplace") and any(self._live(d) is not None for _, d in plan):
            raise NsError("exists")
        for old, new in plan:
            e = self.entries.get(old)
            if e is not None and e["t"] == TOMB:
                continue  # an already deleted object stays deleted (and out of the move)
            if e is None:
                o = s3[old]
                if old.endswith("/"):
                    e = {"t": DIR, "mode": o[3], "uid": o[4], "gid": o[5], "mtime": o[6],
                         "at": at}
                else:
                    e = {"t": FILE, "size": o[2], "cid": None, "holders": [],
                         "base": [old, o[1], o[2]], "target": None, "at": at,
                         "mode": o[3], "uid": o[4], "gid": o[5], "mtime": o[6]}
            else:
                self._del(old, extra=new)
                e = dict(e, at=at)
            self._set(new, e, ver, extra=old)
            if old in s3:
                self._tomb(old, ver)
        if dir_attrs is not None and self._live(dp) is None:
            self._set(dp, dir_attrs, ver)
        if is_dir:
            self.changes.append((src + "/", None, dp))  # the directory itself moved
        return {"ok": True, "moved": len(plan)}

    def _clean(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """Write-back finished `key` at version `ver`: forget the entry if it is unchanged."""
        key = str(cmd["key"])
        cur = self.entries.get(key)
        if cur is None or cur["ver"] != int(cmd["ver"]):
            return {"ok": False}
        self._del(key, extra={"etag": cmd.get("etag"), "size": cur.get("size")})
        return {"ok": True}

    def _holders(self, cmd: dict[str, Any], ver: int) -> dict[str, Any]:
        """Record that more nodes hold a blob (a new owner pulled it, or a drain handed it
        off); the entry's version does not change."""
        key = str(cmd["key"])
        cur = self.entries.get(key)
        if cur is None or cur.get("cid") != cmd.get("cid"):
            return {"ok": False}
        drop = set(cmd.get("remove") or [])
        hs = [h for h in cur["holders"] if h not in drop]
        hs += [str(h) for h in cmd.get("add") or [] if str(h) not in hs]
        cur["holders"] = hs
        return {"ok": True}
