"""Mount configuration: defaults, size parsing, the TOML config file, and validation.

Every command-line flag of `objcache mount` has a config-file key of the same name (dashes
or underscores). Flags given on the command line win over the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from objcache.errors import UserError

MIB = 1 << 20
MIN_CHUNK_SIZE = 5 * MIB  # an S3 multipart part (except the last) must be >= 5 MiB
# What S3-compatible servers accept (botocore's own check); AWS is stricter.
BUCKET_NAME = re.compile(r"^[a-zA-Z0-9.\-_]{1,255}$")
MAX_CHUNK_SIZE = 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_log_level(spec: str) -> tuple[str, dict[str, str]]:
    """'info' or 'info,objcache.txn.flusher=debug': the root level, then a level for each
    named logger (and the loggers below it). UserError on anything else."""
    parts = [p.strip() for p in str(spec).split(",")]
    root, named = parts[0].lower(), {}
    for part in parts[1:]:
        name, eq, level = part.partition("=")
        if not eq or not name.strip() or level.strip().lower() not in LOG_LEVELS:
            raise UserError(f"invalid log-level {spec!r}: after the first level, expected "
                            "LOGGER=LEVEL, e.g. info,objcache.txn.flusher=debug")
        named[name.strip()] = level.strip().lower()
    if root not in LOG_LEVELS:
        raise UserError(f"invalid log-level {spec!r}: expected one of "
                        + ", ".join(LOG_LEVELS) + ", then optional LOGGER=LEVEL pairs")
    return root, named


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse '16M', '16MiB', '1.5G', '4096' (binary units) into bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UserError(f"invalid {what} {text!r}: must not be negative")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UserError(f"invalid {what} {text!r}: expected a number with an optional unit "
                        "K, M, G, T (binary), e.g. 16M or 100G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_duration(text: str | float | int, what: str) -> float:
    """Seconds, as a number or with an s/m/h suffix."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", str(text))
        if not m:
            raise UserError(f"invalid {what} {text!r}: expected seconds, e.g. 5 or 2.5s or 1m")
        value = float(m.group(1)) * {"ms": 0.001, None: 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if value < 0:
        raise UserError(f"invalid {what} {text!r}: must not be negative")
    return value


@dataclass
class MountConfig:
    """Everything a mount needs. Field names are the config-file keys."""

    bucket: str = ""
    prefix: str = ""
    mountpoint: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    cache_dir: str | None = None
    cache_size: int = 10 << 30
    chunk_size: int = 16 * MIB
    writeback_delay: float = 5.0
    metadata_ttl: float = 30.0
    readahead: int = 64 * MIB
    s3_concurrency: int = 16
    s3_retry_seconds: float = 60.0
    foreground: bool = False
    read_only: bool = False
    allow_other: bool = False
    log_level: str = "info"
    log_file: str | None = None
    # Cluster (issue 3): without `listen` the daemon runs alone.
    listen: str | None = None
    peers: str | None = None  # comma-separated HOST:PORT of members to join through
    cluster_secret_file: str | None = None
    node_id: str | None = None
    near_cache_size: int | None = None  # default: a tenth of cache_size
    peer_timeout: float = 5.0
    raft_port: int | None = None  # default: the --listen port + 1
    # Members that vote in Raft; the others follow the log as learners (issue 28).
    raft_voters: int = 5
    # A voter compacts its Raft log (a dump of the state) every this many entries: the log
    # is held in memory until then (objcache.raft.node.COMPACT_ENTRIES).
    raft_compact_entries: int = 10_000
    metrics_addr: str | None = None  # HOST:PORT for Prometheus /metrics
    recover_mount: bool = False  # detach a dead mount left at the mountpoint by a crash
    # Serve opens whose bytes are all on this node through the kernel (FUSE passthrough):
    # reads, writes and mmap of them never reach the daemon. Off: every byte does.
    no_passthrough: bool = False
    # Uploads carry a CRC32 checksum header (signed) and no SHA-256 of their body
    # (UNSIGNED-PAYLOAD), over http as over https. On: botocore's default, a SHA-256 of
    # every body over plain http (a second pass over each part on our side and the
    # server's), for an http endpoint on a network that is not trusted.
    sign_payload: bool = False
    # Transactions (issue 4): copies of a closed, not yet uploaded file, and how long a
    # namespace change may wait for a Raft quorum before the call fails with EIO.
    replicas: int = 2
    txn_timeout: float = 10.0
    # A (re)starting member mounts after this long even if it could not catch up with the
    # cluster's log (too few members up yet); it catches up in the background.
    catch_up_seconds: float = 60.0

    def validate(self) -> None:
        if not self.bucket:
            raise UserError("missing bucket: expected s3://BUCKET[/PREFIX]")
        if not BUCKET_NAME.match(self.bucket):
            raise UserError(f"invalid bucket name {self.bucket!r}: expected 1-255 letters, "
                            "digits, '.', '-' or '_' (AWS: 3-63 lowercase letters, digits, "
                            "'.' and '-')")
        if self.endpoint_url is not None:
            u = urlsplit(self.endpoint_url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise UserError(f"invalid endpoint-url {self.endpoint_url!r}: expected "
                                "http(s)://HOST[:PORT]")
            try:
                u.port  # noqa: B018 - raises on a malformed port
            except ValueError:
                raise UserError(f"invalid endpoint-url {self.endpoint_url!r}: bad port") \
                    from None
        if self.chunk_size < MIN_CHUNK_SIZE or self.chunk_size > MAX_CHUNK_SIZE:
            raise UserError(f"invalid chunk-size {self.chunk_size}: must be between 5M and 1G "
                            "(a chunk is an S3 multipart part)")
        if self.cache_size < 2 * self.chunk_size:
            raise UserError(f"cache-size {self.cache_size} is too small: it must hold at least "
                            f"two chunks ({2 * self.chunk_size} bytes)")
        parse_log_level(self.log_level)
        if not 1 <= self.s3_concurrency <= 256:
            raise UserError("invalid s3-concurrency: expected 1..256")
        if self.listen is None:
            if self.peers or self.node_id:
                raise UserError("--peers and --node-id need --listen HOST:PORT (this node's "
                                "peer address)")
        else:
            if not re.match(r"^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$", self.listen):
                raise UserError(f"invalid --listen {self.listen!r}: expected HOST:PORT")
            if not self.cluster_secret_file:
                raise UserError("--listen needs --cluster-secret-file (the shared cluster key)")
            for peer in (self.peers or "").split(","):
                if peer.strip() and not re.match(r"^\S+:\d{1,5}$", peer.strip()):
                    raise UserError(f"invalid peer address {peer.strip()!r}: expected HOST:PORT")
        if not 1 <= self.raft_voters <= 15:
            raise UserError("invalid raft-voters: expected 1..15 (odd numbers: 3 or 5)")
        if self.raft_compact_entries < 100:
            raise UserError("invalid raft-compact-entries: must be at least 100 log entries")
        if not 1 <= self.replicas <= 5:
            raise UserError("invalid replicas: expected 1..5 copies of each dirty file")
        if self.txn_timeout < 1:
            raise UserError("invalid txn-timeout: must be at least 1 second")
        if self.catch_up_seconds < 1:
            raise UserError("invalid catch-up-seconds: must be at least 1 second")
        if self.peer_timeout < 0.5:
            raise UserError("invalid peer-timeout: must be at least 0.5 seconds")
        if self.near_cache_size is None:
            self.near_cache_size = self.cache_size // 10

    def default_cache_dir(self) -> str:
        """A per-(endpoint, bucket, prefix) directory, so two mounts never share chunks."""
        ident = f"{self.endpoint_url or ''}\0{self.bucket}\0{self.prefix}"
        digest = hashlib.sha256(ident.encode()).hexdigest()[:12]
        base = (Path("/var/cache/objcache") if os.geteuid() == 0
                else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "objcache")
        return str(base / f"{self.bucket}-{digest}")


_FIELDS = {f.name: f for f in dataclasses.fields(MountConfig)}
_SIZE_KEYS = {"cache_size", "chunk_size", "readahead", "near_cache_size"}
_DURATION_KEYS = {"writeback_delay", "metadata_ttl", "s3_retry_seconds", "peer_timeout",
                  "txn_timeout", "catch_up_seconds"}
_BOOL_KEYS = {"foreground", "read_only", "allow_other", "recover_mount", "no_passthrough",
              "sign_payload"}
_INT_KEYS = {"s3_concurrency", "replicas", "raft_voters", "raft_compact_entries"}


def parse_source(source: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix' -> ('bucket', 'some/prefix')."""
    if not source.startswith("s3://"):
        raise UserError(f"invalid source {source!r}: expected s3://BUCKET[/PREFIX]")
    rest = source[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UserError(f"invalid source {source!r}: the bucket name is empty")
    return bucket, prefix.strip("/")


def set_option(cfg: MountConfig, key: str, value: object, origin: str) -> None:
    """Set one option by its flag/config name, converting and checking its type."""
    name = key.replace("-", "_")
    if name not in _FIELDS or name in ("bucket", "prefix", "mountpoint"):
        raise UserError(f"unknown config key {key!r} in {origin}")
    if name in _SIZE_KEYS:
        value = parse_size(value, name.replace("_", "-"))  # type: ignore[arg-type]
    elif name in _DURATION_KEYS:
        value = parse_duration(value, name.replace("_", "-"))  # type: ignore[arg-type]
    elif name in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise UserError(f"invalid value for {key!r} in {origin}: expected true or false")
    elif name == "raft_port":
        try:
            value = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UserError(f"invalid value for {key!r} in {origin}: expected a port") \
                from None
        if not 0 < value < 65536:
            raise UserError(f"invalid value for {key!r} in {origin}: expected a port")
    elif name in _INT_KEYS:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserError(f"invalid value for {key!r} in {origin}: expected an integer")
    elif name == "peers" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # a config file may give a list
    elif value is not None and not isinstance(value, str):
        raise UserError(f"invalid value for {key!r} in {origin}: expected a string")
    setattr(cfg, name, value)


def load_config_file(cfg: MountConfig, path: str) -> None:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not TOML: it is not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"config file {path} is not readable: {e.strerror}") from None
    for key, value in data.items():
        if key in ("source", "bucket"):
            # A config file may name the bucket too: `source = "s3://bucket/prefix"`.
            cfg.bucket, cfg.prefix = parse_source(str(value) if key == "source"
                                                  else f"s3://{value}")
            continue
        set_option(cfg, key, value, f"config file {path}")


def disk_reserve(total: int) -> int:
    """Bytes of the cache dir's filesystem never filled with cache data: the state
    database (journal, chunk index) must always be able to commit."""
    return max(16 << 20, min(256 << 20, total // 50))


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def startup_warnings(cfg: MountConfig) -> list[str]:
    """What is accepted but probably not meant: one line each, printed by `mount` and
    logged by the daemon."""
    out = []
    cache_dir = Path(cfg.cache_dir or cfg.default_cache_dir())
    try:
        st = os.statvfs(_existing(cache_dir))
    except OSError:
        st = None
    if st is not None:
        total = st.f_blocks * st.f_frsize
        room = total - disk_reserve(total)
        if total > 0 and cfg.cache_size > room:  # (0: a pseudo filesystem; fails later)
            out.append(f"cache-size {cfg.cache_size} is more than the filesystem of "
                       f"{cache_dir} holds ({total} bytes); the cache uses at most what is "
                       f"free there, less a reserve of {disk_reserve(total)} bytes")
    if cfg.cluster_secret_file:
        try:
            mode = os.stat(cfg.cluster_secret_file).st_mode
        except OSError:
            mode = 0
        if mode & 0o077:
            out.append(f"cluster secret file {cfg.cluster_secret_file} is readable by other "
                       f"users (mode {mode & 0o777:o}): chmod 600 it")
    return out
