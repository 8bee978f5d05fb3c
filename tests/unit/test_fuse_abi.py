"""The FUSE wire format objcache speaks (objcache.fs.abi, objcache.fs.kernel): layouts of
the kernel's sizes (include/uapi/linux/fuse.h), dirent records aligned as the kernel reads
them, and open flags the kernel accepts with passthrough."""

from __future__ import annotations

from dataclasses import dataclass

from objcache.fs import abi
from objcache.fs.kernel import DirBuffer, Opened


def test_layouts_have_the_kernels_sizes() -> None:
    sizes = {abi.IN_HEADER: 40, abi.OUT_HEADER: 16, abi.ENTRY_OUT: 128, abi.ATTR_OUT: 104,
             abi.OPEN_OUT: 16, abi.INIT_OUT: 64, abi.SETATTR_IN: 88, abi.READ_IN: 40,
             abi.WRITE_IN: 40, abi.RELEASE_IN: 24, abi.FLUSH_IN: 24, abi.STATFS_OUT: 80,
             abi.CREATE_IN: 16, abi.MKNOD_IN: 16, abi.DIRENT: 24, abi.BACKING_MAP: 16,
             abi.NOTIFY_INVAL_ENTRY_OUT: 16, abi.NOTIFY_INVAL_INODE_OUT: 24,
             abi.NOTIFY_DELETE_OUT: 24}
    assert {s.format: s.size for s in sizes} == {s.format: n for s, n in sizes.items()}
    # _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t)
    assert abi.DEV_IOC_BACKING_OPEN == (1 << 30) | (16 << 16) | (229 << 8) | 1
    assert abi.DEV_IOC_BACKING_CLOSE == (1 << 30) | (4 << 16) | (229 << 8) | 2
    assert abi.PASSTHROUGH >> 32 == 1 << 5  # bit 5 of flags2


@dataclass
class A:
    ino: int = 7
    mode: int = 0o100644
    size: int = 5
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 1_500_000_000_123
    atime_ns: int = 0
    ctime_ns: int = 0
    nlink: int = 1
    rdev: int = 0
    cache_timeout: float = 1.5


def test_dirents_are_aligned_and_stop_when_full() -> None:
    out = DirBuffer(200, plus=False, blksize=4096)
    assert out.add(b"abc", 7, A.mode, A(), 1)  # 24 + 3 -> 32
    assert out.add(b"a" * 9, 8, A.mode, None, 2)  # 24 + 9 -> 40
    assert len(out.buf) == 72
    ino, off, namelen, typ = abi.DIRENT.unpack_from(out.buf, 32)
    assert (ino, off, namelen, typ) == (8, 2, 9, 0o10)  # DT_REG
    while out.add(b"x" * 20, 9, A.mode, A(), 3):
        pass
    assert len(out.buf) <= 200
    plus = DirBuffer(4096, plus=True, blksize=4096)
    assert plus.add(b"abc", 7, A.mode, A(), 1)
    assert plus.add(b"gone", 9, A.mode, None, 2)  # listed, nodeid 0: no attributes
    assert len(plus.buf) == 2 * (128 + 32)
    assert abi.ENTRY_OUT.unpack_from(plus.buf, 160)[0] == 0
    assert abi.DIRENT.unpack_from(plus.buf, 160 + 128)[:3] == (9, 2, 4)
    nodeid, _gen, entry_valid, attr_valid, ensec, ansec = abi.ENTRY_OUT.unpack_from(
        plus.buf)[:6]
    assert (nodeid, entry_valid, attr_valid, ensec, ansec) == (7, 1, 1, 500_000_000,
                                                                500_000_000)


def test_open_flags_the_kernel_accepts_with_passthrough() -> None:
    # KEEP_CACHE (and NONSEEKABLE) with PASSTHROUGH make the kernel fail the open (EIO).
    f = Opened(3, keep_cache=True, backing_id=2, noflush=True).flags()
    assert f == abi.FOPEN_PASSTHROUGH | abi.FOPEN_NOFLUSH
    assert Opened(3, keep_cache=True).flags() == abi.FOPEN_KEEP_CACHE
    assert Opened(3, keep_cache=True, cache_dir=True).flags() == (abi.FOPEN_KEEP_CACHE
                                                                  | abi.FOPEN_CACHE_DIR)
