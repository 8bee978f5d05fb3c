"""The FUSE kernel ABI: opcodes, flags and the layouts of the messages on /dev/fuse.

Values and layouts are those of the kernel's `include/uapi/linux/fuse.h` (protocol 7.45);
only what objcache speaks is here. Every layout is little-endian with the kernel's
explicit padding, so `struct` formats carry no implicit alignment ("<").
"""

from __future__ import annotations

import struct

KERNEL_MAJOR = 7
KERNEL_MINOR = 45  # the newest minor we speak; the kernel's if lower
MIN_MINOR = 31  # Linux 5.4: everything below (max_pages, cache_symlinks) we rely on

# -- opcodes ---------------------------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
GETLK = 31
SETLK = 32
SETLKW = 33
ACCESS = 34
CREATE = 35
INTERRUPT = 36
BMAP = 37
DESTROY = 38
IOCTL = 39
POLL = 40
NOTIFY_REPLY = 41
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
LSEEK = 46
COPY_FILE_RANGE = 47
SYNCFS = 50
TMPFILE = 51
STATX = 52

OPCODE_NAMES = {
    LOOKUP: "lookup", FORGET: "forget", GETATTR: "getattr", SETATTR: "setattr",
    READLINK: "readlink", SYMLINK: "symlink", MKNOD: "mknod", MKDIR: "mkdir",
    UNLINK: "unlink", RMDIR: "rmdir", RENAME: "rename", LINK: "link", OPEN: "open",
    READ: "read", WRITE: "write", STATFS: "statfs", RELEASE: "release", FSYNC: "fsync",
    SETXATTR: "setxattr", GETXATTR: "getxattr", LISTXATTR: "listxattr",
    REMOVEXATTR: "removexattr", FLUSH: "flush", INIT: "init", OPENDIR: "opendir",
    READDIR: "readdir", RELEASEDIR: "releasedir", FSYNCDIR: "fsyncdir", GETLK: "getlk",
    SETLK: "setlk", SETLKW: "setlkw", ACCESS: "access", CREATE: "create",
    INTERRUPT: "interrupt", BMAP: "bmap", DESTROY: "destroy", IOCTL: "ioctl", POLL: "poll",
    NOTIFY_REPLY: "notify_reply", BATCH_FORGET: "batch_forget", FALLOCATE: "fallocate",
    READDIRPLUS: "readdirplus", RENAME2: "rename2", LSEEK: "lseek",
    COPY_FILE_RANGE: "copy_file_range", SYNCFS: "syncfs", TMPFILE: "tmpfile",
    STATX: "statx",
}

# -- INIT flags (bits 32.. go into flags2) ---------------------------------------------
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
HAS_IOCTL_DIR = 1 << 11
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

# -- OPEN reply flags -------------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

# -- SETATTR valid bits -----------------------------------------------------------------
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8

GETATTR_FH = 1 << 0
FSYNC_FDATASYNC = 1 << 0

# -- notifications ----------------------------------------------------------------------
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_DELETE = 6

# -- /dev/fuse ioctls (_IOW(229, n, size)) ----------------------------------------------
DEV_IOC_BACKING_OPEN = 0x4010E501  # struct fuse_backing_map (16 bytes)
DEV_IOC_BACKING_CLOSE = 0x4004E502  # u32 backing id

# -- layouts ----------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
# fuse_attr: ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink
# uid gid rdev blksize flags
_ATTR = "QQQqqqIIIIIIIIII"  # times are signed (before 1970)
# fuse_entry_out: nodeid generation entry_valid attr_valid entry_valid_nsec
# attr_valid_nsec attr
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)
# fuse_attr_out: attr_valid attr_valid_nsec dummy attr
ATTR_OUT = struct.Struct("<QII" + _ATTR)
# fuse_open_out: fh open_flags backing_id
OPEN_OUT = struct.Struct("<QIi")
WRITE_OUT = struct.Struct("<II")
# fuse_kstatfs: blocks bfree bavail files ffree bsize namelen frsize padding spare[6]
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2
# major minor max_readahead flags max_background congestion_threshold max_write time_gran
# max_pages map_alignment flags2 max_stack_depth request_timeout unused[11]
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
GETATTR_IN = struct.Struct("<IIQ")  # getattr_flags dummy fh
# valid padding fh size lock_owner atime mtime ctime atimensec mtimensec ctimensec mode
# unused4 uid gid unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
LINK_IN = struct.Struct("<Q")
OPEN_IN = struct.Struct("<II")  # flags open_flags
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
RELEASE_IN = struct.Struct("<QIIQ")  # fh flags release_flags lock_owner
FLUSH_IN = struct.Struct("<QIIQ")  # fh unused padding lock_owner
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
GETXATTR_IN = struct.Struct("<II")  # size padding
GETXATTR_OUT = struct.Struct("<II")
ACCESS_IN = struct.Struct("<II")
INTERRUPT_IN = struct.Struct("<Q")
DIRENT = struct.Struct("<QQII")  # ino off namelen type
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino off len
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent namelen flags
NOTIFY_DELETE_OUT = struct.Struct("<QQII")  # parent child namelen padding
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding
