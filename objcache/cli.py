"""The `objcache` command: mount, umount, flush, status, prefetch, unpin, evict.

Errors are one line on stderr and a non-zero exit. `mount` without --foreground starts the
daemon as a detached child and returns once the mount is ready (or prints why it is not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from objcache import __version__, control
from objcache.config import (
    MountConfig,
    load_config_file,
    parse_source,
    set_option,
    startup_warnings,
)
from objcache.errors import UserError

_MOUNT_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--endpoint-url", {"metavar": "URL", "help": "S3 endpoint (default: boto3's own "
                        "resolution, e.g. AWS_ENDPOINT_URL)"}),
    ("--region", {"help": "S3 region (default: boto3's own resolution)"}),
    ("--cache-dir", {"metavar": "DIR", "help": "where chunks and dirty files live"}),
    ("--cache-size", {"metavar": "SIZE", "help": "cache capacity, e.g. 100G (default 10G)"}),
    ("--chunk-size", {"metavar": "SIZE", "help": "chunk size, >= 5M (default 16M)"}),
    ("--writeback-delay", {"metavar": "SECONDS",
                           "help": "upload a closed file this long after its last change "
                           "(default 5)"}),
    ("--metadata-ttl", {"metavar": "SECONDS",
                        "help": "revalidate S3 metadata after this long (default 30)"}),
    ("--readahead", {"metavar": "SIZE", "help": "sequential readahead window (default 64M)"}),
    ("--s3-concurrency", {"metavar": "N", "type": int,
                          "help": "parallel S3 transfers (default 16)"}),
    ("--listen", {"metavar": "HOST:PORT", "help": "join a cluster: this node's peer "
                  "address (without it the daemon runs alone)"}),
    ("--peers", {"metavar": "HOST:PORT,...", "help": "members to join through (none "
                 "reachable: form a new cluster)"}),
    ("--cluster-secret-file", {"metavar": "FILE", "help": "the shared cluster key"}),
    ("--node-id", {"metavar": "ID", "help": "this node's name in the cluster (default: "
                   "the --listen address)"}),
    ("--near-cache-size", {"metavar": "SIZE", "help": "bytes of other nodes' hot chunks "
                           "kept here (default: a tenth of --cache-size)"}),
    ("--raft-port", {"metavar": "PORT", "help": "this node's Raft port (default: the "
                     "--listen port + 1)"}),
    ("--raft-voters", {"metavar": "N", "type": int, "help": "members that vote in Raft; "
                       "the others follow the log without voting (default 5)"}),
    ("--raft-compact-entries", {"metavar": "N", "type": int, "help": "a voter dumps the "
                                "state and drops its Raft log every N entries; the log is "
                                "held in memory until then (default 10000)"}),
    ("--peer-timeout", {"metavar": "SECONDS", "help": "take a silent peer off the ring "
                        "after this long (default 5)"}),
    ("--replicas", {"metavar": "N", "type": int, "help": "nodes holding each closed, not "
                    "yet uploaded file (default 2; fewer if fewer nodes are up)"}),
    ("--txn-timeout", {"metavar": "SECONDS", "help": "fail a namespace change with EIO if "
                       "the cluster cannot commit it in this long (default 10)"}),
    ("--catch-up-seconds", {"metavar": "SECONDS", "help": "mount after this long even if "
                            "the cluster's log could not be caught up with yet (default "
                            "60)"}),
    ("--metrics-addr", {"metavar": "HOST:PORT", "help": "serve Prometheus metrics at "
                        "http://HOST:PORT/metrics"}),
    ("--log-level", {"metavar": "LEVEL", "help": "debug, info, warning or "
                     "error; then LOGGER=LEVEL pairs, e.g. info,objcache.txn.flusher=debug"}),
    ("--log-file", {"metavar": "FILE", "help": "log here (default: stderr in the "
                    "foreground, CACHE_DIR/objcache.log otherwise)"}),
]
_MOUNT_SWITCHES = ["--foreground", "--read-only", "--allow-other", "--recover-mount",
                   "--no-passthrough", "--sign-payload"]


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="objcache", description="Cache an S3 bucket on local NVMe and "
                       "mount it as a POSIX directory.")
    p.add_argument("--version", action="version", version=f"objcache {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mount", help="mount s3://BUCKET[/PREFIX] at MOUNTPOINT")
    m.add_argument("source", metavar="s3://BUCKET[/PREFIX]")
    m.add_argument("mountpoint")
    m.add_argument("--config", metavar="FILE", help="TOML file with any of the options")
    for flag, kw in _MOUNT_FLAGS:
        m.add_argument(flag, default=None, **kw)
    for flag in _MOUNT_SWITCHES:
        m.add_argument(flag, action="store_const", const=True, default=None)
    m.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)

    u = sub.add_parser("umount", help="upload every dirty file, then unmount")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the daemon to exit after unmounting")

    dr = sub.add_parser("drain", help="cluster: upload or hand off everything this node "
                        "owns or holds, leave the cluster, unmount")
    dr.add_argument("mountpoint")
    dr.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds to wait for the node to finish and exit")

    f = sub.add_parser("flush", help="return once everything dirty under PATH is in S3")
    f.add_argument("path", metavar="MOUNTPOINT[/PATH]")

    pf = sub.add_parser("prefetch", help="warm the cache with files and directories")
    pf.add_argument("paths", nargs="*", metavar="PATH", help="files, directories or globs "
                    "inside a mount")
    pf.add_argument("--manifest", metavar="FILE", help="a file with one path per line")
    pf.add_argument("--jobs", type=int, default=8, help="batches in flight (default 8)")
    pf.add_argument("--pin", action="store_true", help="keep the data until unpin")
    pf.add_argument("--json", action="store_true", help="print a JSON summary")

    up = sub.add_parser("unpin", help="let pinned data under PATH be evicted again")
    up.add_argument("paths", nargs="+", metavar="PATH")
    ev = sub.add_parser("evict", help="drop clean cached data under PATH")
    ev.add_argument("paths", nargs="+", metavar="PATH")
    vf = sub.add_parser("verify", help="check cached data under PATH against its checksums "
                        "(corrupt chunks are dropped and fetched again)")
    vf.add_argument("paths", nargs="+", metavar="PATH")

    bn = sub.add_parser("bench", help="benchmark a mounted directory")
    bn.add_argument("path", metavar="PATH")
    bn.add_argument("--big-size", default="256M", help="size of each big file (256M)")
    bn.add_argument("--big-files", type=int, default=None,
                    help="big files, one per thread at a time (default: --threads)")
    bn.add_argument("--small-count", type=int, default=1000, help="small files (1000)")
    bn.add_argument("--small-size", default="16K", help="size of each small file (16K)")
    bn.add_argument("--threads", type=int, default=4, help="parallel workers (4)")
    bn.add_argument("--json", action="store_true", help="machine-readable output")

    cn = sub.add_parser("csi-node", help="run the Kubernetes CSI node plugin")
    cn.add_argument("--endpoint", required=True, metavar="unix:///PATH",
                    help="the gRPC socket kubelet talks to")
    cn.add_argument("--node-id", required=True, metavar="ID", help="this Kubernetes node")
    cn.add_argument("--mount-root", default="/var/lib/objcache/mounts", metavar="DIR",
                    help="where this node's objcache mounts live, one directory per mount")
    cn.add_argument("--log-level", default="info", metavar="LEVEL")

    s = sub.add_parser("status", help="cache and write-back state of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--local", action="store_true",
                   help="this node only: ask no other member for its row")
    return p


def build_config(args: argparse.Namespace) -> MountConfig:
    cfg = MountConfig()
    if args.config:
        load_config_file(cfg, args.config)
    cfg.bucket, cfg.prefix = parse_source(args.source)
    cfg.mountpoint = args.mountpoint
    for flag, _ in _MOUNT_FLAGS:
        dest = flag[2:].replace("-", "_")
        value = getattr(args, dest)
        if value is not None:
            set_option(cfg, dest, value, "the command line")
    for flag in _MOUNT_SWITCHES:
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest):
            setattr(cfg, dest, True)
    cfg.validate()
    return cfg


def _cmd_mount(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    if cfg.foreground or args.ready_fd is not None:
        return _run_daemon(cfg, args.ready_fd)
    for warning in startup_warnings(cfg):
        print(f"objcache mount: warning: {warning}", file=sys.stderr)
    # Start the daemon detached and wait for it to say it is mounted (or why not).
    r, w = os.pipe()
    argv = [sys.executable, "-m", "objcache", *sys.argv[1:], "--ready-fd", str(w)]
    proc = subprocess.Popen(argv, pass_fds=(w,), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    os.close(w)
    with os.fdopen(r) as pipe:
        line = pipe.readline().strip()
    if line == "ok":
        proc.stderr.close()  # type: ignore[union-attr]
        return 0
    if line.startswith("error: "):
        raise UserError(line[len("error: "):])
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    err = (proc.stderr.read().decode(errors="replace").strip().splitlines()  # type: ignore
           or [f"exit status {proc.returncode}"])
    raise UserError(f"the objcache daemon failed to start: {err[-1]}")


def _run_daemon(cfg: MountConfig, ready_fd: int | None) -> int:
    from objcache.daemon import Daemon, setup_logging

    log_file = cfg.log_file
    if ready_fd is not None and log_file is None:
        cache_dir = cfg.cache_dir or cfg.default_cache_dir()
        log_file = os.path.join(cache_dir, "objcache.log")
    try:
        if log_file is not None:
            os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        setup_logging(cfg.log_level, log_file)
    except OSError as e:
        err = UserError(f"cannot write the log file {log_file}: {e.strerror}")
        if ready_fd is None:
            raise err from None
        os.write(ready_fd, f"error: {err}\n".encode())
        os.close(ready_fd)
        return err.exit_code

    readied = False

    def ready() -> None:
        nonlocal readied
        readied = True
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)
            # The parent stops reading our stderr now: send stray output to the log.
            fd = os.open(log_file or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)

    daemon = Daemon(cfg)
    try:
        daemon.prepare()
        daemon.run(ready)
    except UserError as e:
        if ready_fd is not None and not readied:
            os.write(ready_fd, f"error: {e}\n".encode())
            os.close(ready_fd)
            return e.exit_code
        raise
    return 0


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its parent has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _cmd_umount(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    if not os.path.ismount(mnt):
        raise UserError(f"{mnt} is not mounted")
    reply = control.request(mnt, {"op": "drain" if args.command == "drain" else "unmount"})
    if args.command == "drain":
        print(f"drained {mnt}: {reply.get('flushed', 0)} entries written back in "
              f"{reply.get('seconds', 0):.2f}s; leaving the cluster")
    pid = int(reply["pid"])
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not os.path.ismount(mnt) and not _running(pid):
            return 0
        time.sleep(0.05)
    if os.path.ismount(mnt):
        raise UserError(f"{mnt} is still mounted after {args.timeout:.0f}s (busy?)")
    return 0  # unmounted; the daemon process may live in another PID namespace


def _cmd_flush(args: argparse.Namespace) -> int:
    try:
        ino = os.lstat(args.path).st_ino
    except FileNotFoundError:
        raise UserError(f"{args.path} does not exist") from None
    reply = control.request(args.path, {"op": "flush", "ino": ino})
    print(f"flushed {args.path} in {reply['seconds']:.2f}s")
    return 0


def _cmd_prefetch(args: argparse.Namespace) -> int:
    from objcache import prefetch
    return prefetch.run(args.paths, args.manifest, args.jobs, args.pin, args.json)


def _per_path(args: argparse.Namespace, show: Callable[[str, dict[str, Any]], bool]) -> int:
    """Run args.command on the mount's key of each path in args.paths; show(path, reply)
    prints the outcome and says whether it failed. 1 when any path failed."""
    failed = False
    for path in args.paths:
        try:
            try:
                ino = os.lstat(path).st_ino
            except FileNotFoundError:
                raise UserError(f"{path}: no such file or directory") from None
            key = control.request(path, {"op": "resolve", "ino": ino})["key"]
            r = control.request(path, {"op": args.command, "prefix": key})
        except UserError as e:
            print(f"objcache {args.command}: {e}", file=sys.stderr)
            failed = True
            continue
        failed = show(path, r) or failed
    return 1 if failed else 0


def _not_reached(r: dict[str, Any]) -> str:
    return f"; not reached: {', '.join(r['unreachable'])}" if r.get("unreachable") else ""


def _cmd_unpin_or_evict(args: argparse.Namespace) -> int:
    what = "unpinned" if args.command == "unpin" else "evicted"

    def show(path: str, r: dict[str, Any]) -> bool:
        extra = (f", {_size(r['pinned_kept'])} pinned kept (unpin first)"
                 if r.get("pinned_kept") else "")
        print(f"{path}: {what} {_size(r['bytes'])}{extra}{_not_reached(r)}")
        return bool(r.get("unreachable"))
    return _per_path(args, show)


def _cmd_verify(args: argparse.Namespace) -> int:
    def show(path: str, r: dict[str, Any]) -> bool:
        print(f"{path}: {r['chunks']} chunks ({_size(r['bytes'])}) checked, "
              f"{r['corrupt']} corrupt (dropped){_not_reached(r)}")
        return bool(r["corrupt"] or r.get("unreachable"))
    return _per_path(args, show)


def _cmd_bench(args: argparse.Namespace) -> int:
    from objcache import bench
    if args.threads < 1 or args.small_count < 1:
        raise UserError("--threads and --small-count must be at least 1")
    return bench.main(args.path, args.big_size, args.big_files or args.threads,
                      args.small_count, args.small_size, args.threads, args.json)


def _cmd_csi_node(args: argparse.Namespace) -> int:
    from objcache.csi import node
    from objcache.daemon import setup_logging
    setup_logging(args.log_level, None)
    return node.run(args.endpoint, args.node_id, args.mount_root)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return str(n)


def _cmd_status(args: argparse.Namespace) -> int:
    st = control.request(args.mountpoint, {"op": "status", "local": args.local})
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    c, d, s3 = st["cache"], st["dirty"], st["s3"]
    ratio = "-" if c["hit_ratio"] is None else f"{100 * c['hit_ratio']:.1f}%"
    age = "-" if d["oldest_age_seconds"] is None else f"{d['oldest_age_seconds']:.1f}s"
    reqs = ", ".join(f"{k} {v}" for k, v in sorted(s3["requests"].items())) or "none"
    print(f"{st['source']} on {st['mountpoint']} (pid {st['pid']}, "
          f"up {st['uptime_seconds']:.0f}s)")
    print(f"cache:  {_size(c['used_bytes'])} used of {_size(c['capacity_bytes'])} "
          f"({c['chunks']} chunks, {_size(c['pinned_bytes'])} pinned), hit ratio {ratio}")
    print(f"dirty:  {d['files']} files, {_size(d['bytes'])}, oldest {age}")
    print(f"s3:     {reqs}; errors {sum(s3['errors'].values())}, "
          f"retries {sum(s3['retries'].values())}")
    fu = st.get("fuse")
    if fu:
        watched = fu.get("watched_files") or 0
        print(f"fuse:   {fu['mode']}; opens {fu['passthrough_opens']} passthrough, "
              f"{fu['daemon_opens']} by the daemon; {fu['requests']} requests"
              + (f"; {watched} files watched for writes through mappings" if watched else ""))
    cl = st.get("cluster")
    if cl:
        print(f"cluster: node {cl['node_id']} on {cl['listen']}, {len(cl['members'])} "
              f"known nodes; read from peers {_size(c['bytes_read_from_peers'])}, served "
              f"to peers {_size(c['bytes_served_to_peers'])}")
        print(f"  {'NODE':<22} {'STATE':<8} {'RING':>6} {'USED':>10} {'CAPACITY':>10} "
              f"{'PINNED':>10} {'DIRTY':>14} {'OLDEST':>7} {'HITS':>6} {'S3 REQ/ERR':>11}")
        for m in cl["members"]:
            ns = m.get("stats") or {}
            used = ns.get("cache_used_bytes", m["cache_used_bytes"])
            hit = ns.get("hit_ratio")
            age = ns.get("oldest_dirty_seconds")
            dirty = (f"{ns['dirty_files']}/{_size(ns['dirty_bytes'])}" if ns else "-")
            print(f"  {m['id']:<22} {m['state']:<8} {100 * m['ring_share']:5.1f}% "
                  f"{_size(used):>10} {_size(m['cache_capacity_bytes']):>10} "
                  f"{_size(ns.get('pinned_bytes')):>10} {dirty:>14} "
                  f"{'-' if age is None else f'{age:.0f}s':>7} "
                  f"{'-' if hit is None else f'{100 * hit:.0f}%':>6} "
                  f"{ns.get('s3_requests', '-')}/{ns.get('s3_errors', '-'):<5}")
        r = cl.get("raft")
        if r:
            source = f" (following {r['source']})" if r.get("source") else ""
            print(f"  raft: {r['role']}{source}, term {r['term']}, commit index "
                  f"{r['commit_index']}, apply lag {r['apply_lag']}, leader "
                  f"{r['leader'] or '-'}, {len(r['members'])} voters")
            if r.get("voting") is False:
                print("  raft: not voting until caught up with the leader's log "
                      "(started without a log)")
            if r.get("without_log"):
                print(f"  raft: NO LEADER CAN BE ELECTED: voters {', '.join(r['without_log'])}"
                      " came back without their logs; fewer than a majority of the voters "
                      "hold the log (docs/operations.md)")
        else:
            print("  raft: starting")
        pt = cl.get("partition") or {}
        if pt.get("cut_off"):
            since = pt.get("cut_off_seconds")
            print("  CUT OFF from the majority"
                  + (f" for {since:.0f}s" if since is not None else "")
                  + ": changes fail (EIO) or are in doubt (ETIMEDOUT) after --txn-timeout;"
                  " reads serve what this node has applied")
        for u in pt.get("unreachable") or []:
            seen = u.get("last_seen_seconds")
            print(f"  unreachable: {u['id']} ({u['state']}, "
                  + (f"last answered {seen:.0f}s ago)" if seen is not None
                     else "no answer on record)"))
        if pt.get("raft_unreachable"):
            print(f"  raft: no connection to {', '.join(pt['raft_unreachable'])}")
    tx = st.get("transactions") or {}
    for what in tx.get("in_doubt") or []:
        print(f"in doubt: {what} (answered ETIMEDOUT; settled when the node rejoins)")
    for what in tx.get("settled") or []:
        print(f"settled:  {what}")
    return 0


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line naming the cause (not the whole usage block)."""

    def error(self, message: str) -> NoReturn:
        hint = ""
        if "expected one argument" in message:
            hint = " (a value that starts with '-' is read as an option: write --flag=VALUE)"
        self.exit(2, f"{self.prog}: {message}{hint}\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"mount": _cmd_mount, "umount": _cmd_umount, "drain": _cmd_umount,
                "flush": _cmd_flush,
                "status": _cmd_status, "prefetch": _cmd_prefetch,
                "unpin": _cmd_unpin_or_evict, "evict": _cmd_unpin_or_evict,
                "verify": _cmd_verify,
                "csi-node": _cmd_csi_node, "bench": _cmd_bench,
                }[args.command](args)
    except UserError as e:
        print(f"objcache {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
