"""POSIX attributes in S3 object metadata, in s3fs-fuse's convention.

x-amz-meta-mode, -uid, -gid (decimal strings) and -mtime (seconds); a symlink is an object
whose body is the target and whose mode has S_IFLNK. Buckets are interchangeable between
objcache and s3fs-fuse.
"""

from __future__ import annotations

import stat

from objcache.entries import Attrs


def _int(meta: dict[str, str], name: str) -> int | None:
    try:
        return int(meta[name])
    except (KeyError, ValueError):
        return None


def parse_meta(meta: dict[str, str], default_mode: int, uid: int, gid: int,
               mtime_ns: int) -> Attrs:
    """Attributes from s3fs-style metadata, with defaults for what is missing or
    malformed."""
    mode = _int(meta, "mode")
    if mode is None:
        mode = default_mode
    elif not stat.S_IFMT(mode):
        mode |= stat.S_IFMT(default_mode)  # permission bits only: keep the object's type
    u = _int(meta, "uid")
    g = _int(meta, "gid")
    mt = meta.get("mtime")
    if mt is not None:
        try:
            mtime_ns = int(float(mt) * 1e9)
        except ValueError:
            pass
    return Attrs(mode, uid if u is None else u, gid if g is None else g, mtime_ns)


def make_meta(a: Attrs) -> dict[str, str]:
    return {"mode": str(a.mode), "uid": str(a.uid), "gid": str(a.gid),
            "mtime": str(a.mtime_ns // 1_000_000_000)}
