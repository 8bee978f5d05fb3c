"""POSIX attributes in S3 object metadata, in s3fs-fuse's convention.

x-amz-meta-mode, -uid, -gid (decimal strings); -mtime, -atime and -ctime in seconds, with
nine decimals when the time has nanoseconds ("1600000000.987654321"), as s3fs 1.90 writes
them; -rdev (decimal) for character and block devices. A symlink is an object whose body is
the target and whose mode has S_IFLNK; a FIFO, socket or device is an empty object whose
mode has its type. Buckets are interchangeable between objcache and s3fs-fuse.
"""

from __future__ import annotations

import stat

from objcache.entries import Attrs


def _int(meta: dict[str, str], name: str) -> int | None:
    try:
        return int(meta[name])
    except (KeyError, ValueError):
        return None


def parse_time(text: str | None) -> int | None:
    """Nanoseconds from "SECONDS[.FRACTION]" (exact: no float rounding), None if
    malformed."""
    if not text:
        return None
    sec, _, frac = text.strip().partition(".")
    if not sec.lstrip("-").isdigit() or (frac and not frac.isdigit()):
        return None
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])


def format_time(ns: int) -> str:
    sec, frac = divmod(ns, 1_000_000_000)
    return f"{sec}.{frac:09d}" if frac else str(sec)


def parse_meta(meta: dict[str, str], default_mode: int, uid: int, gid: int,
               mtime_ns: int) -> Attrs:
    """Attributes from s3fs-style metadata, with defaults for what is missing or
    malformed (times missing: the object's mtime, LastModified without metadata)."""
    mode = _int(meta, "mode")
    if mode is None:
        mode = default_mode
    elif not stat.S_IFMT(mode):
        mode |= stat.S_IFMT(default_mode)  # permission bits only: keep the object's type
    u = _int(meta, "uid")
    g = _int(meta, "gid")
    mt = parse_time(meta.get("mtime"))
    if mt is not None:
        mtime_ns = mt
    rdev = _int(meta, "rdev") if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else None
    return Attrs(mode, uid if u is None else u, gid if g is None else g, mtime_ns,
                 parse_time(meta.get("atime")) or mtime_ns,
                 parse_time(meta.get("ctime")) or mtime_ns, rdev or 0)


def make_meta(a: Attrs) -> dict[str, str]:
    meta = {"mode": str(a.mode), "uid": str(a.uid), "gid": str(a.gid),
            "mtime": format_time(a.mtime_ns), "atime": format_time(a.shown_atime),
            "ctime": format_time(a.shown_ctime)}
    if a.rdev:
        meta["rdev"] = str(a.rdev)
    return meta
