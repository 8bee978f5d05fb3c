"""objcache: a caching FUSE filesystem over S3-compatible object storage."""

from __future__ import annotations

__version__ = "0.1.0"

#: Name of the virtual control file that exists in every directory of a mount (not listed).
CTRL_NAME = ".objcache-ctl"
