"""`objcache prefetch`: warm the cluster's cache with files and directories of a mount.

The command only names the data; the daemons move it. Directories are listed by the
daemon straight from S3 (one LIST per 1000 objects, no per-file stat), a page at a time, so
memory stays flat however big the dataset is. Files go to the daemon in batches; the daemon
asks each chunk's owner to fetch it, all owners in parallel, so bytes flow from S3 to the
owners and never through this process or the calling node. Chunks already cached are
skipped, which makes a second run cheap and an interrupted run resumable. A failing path
is reported and the rest still completes.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from objcache import control
from objcache.errors import UserError

BATCH_FILES = 256
BATCH_BYTES = 64 << 20  # also the unit of resumption: an interrupted run loses at most this
# What a chunk's failure code (objcache.errors) means to the user; others show their text.
_MEANING = {"notfound": "no longer in S3",
            "stale": "changed in S3 while prefetching (run prefetch again)"}


@dataclass
class Batch:
    ctl: str  # a path in the mount, to reach its daemon
    base_path: str  # the path the user named, and its key, to name failures by path
    base_key: str
    is_dir: bool = False
    files: list[list[Any]] = field(default_factory=list)  # [key, size, etag]
    bytes: int = 0


@dataclass
class Totals:
    files: int = 0
    bytes: int = 0
    cached: int = 0
    fetched: int = 0
    listed_files: int = 0
    listed_bytes: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def expand(paths: list[str], manifest: str | None) -> list[str]:
    """Arguments and manifest lines, with globs expanded (a glob matching nothing stays, so
    it is reported as missing)."""
    names = list(paths)
    if manifest:
        try:
            with open(manifest) as f:
                names += [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
        except OSError as e:
            raise UserError(f"cannot read manifest {manifest}: {e.strerror}") from None
    out: list[str] = []
    for name in names:
        matches = sorted(glob.glob(name)) if glob.has_magic(name) else []
        out += matches or [name]
    if not out:
        raise UserError("nothing to prefetch: give paths or --manifest FILE")
    return out


def _describe(error: str) -> str:
    """A chunk failure 'error:<code>:<text>' (objcache.cache.pins.failure) in words."""
    _, code, text = error.split(":", 2) if error.count(":") >= 2 else ("", "", error)
    return _MEANING.get(code, text)


class Prefetcher:
    def __init__(self, jobs: int, pin: bool, progress: bool) -> None:
        self.jobs = max(1, jobs)
        self.pin = pin
        self.totals = Totals()
        self.queue: queue.Queue[Batch | None] = queue.Queue(maxsize=self.jobs * 2)
        self.bar: Any = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024,
                            dynamic_ncols=True, desc="prefetch", file=sys.stderr)

    def _fail(self, path: str, error: str) -> None:
        with self.totals.lock:
            self.totals.failures.append({"path": path, "error": error})
        if self.bar is not None:
            self.bar.write(f"objcache prefetch: {path}: {error}", file=sys.stderr)

    def _listed(self, n: int, size: int) -> None:
        with self.totals.lock:
            self.totals.listed_files += n
            self.totals.listed_bytes += size
        if self.bar is not None:
            self.bar.total = self.totals.listed_bytes
            self.bar.refresh()

    # -- producing batches ----------------------------------------------------------------

    def _put(self, batch: Batch) -> None:
        if batch.files:
            self._listed(len(batch.files), batch.bytes)
            self.queue.put(batch)

    def _add(self, batch: Batch, f: list[Any]) -> Batch:
        batch.files.append(f)
        batch.bytes += int(f[1])
        if len(batch.files) >= BATCH_FILES or batch.bytes >= BATCH_BYTES:
            self._put(batch)
            return Batch(batch.ctl, batch.base_path, batch.base_key, batch.is_dir)
        return batch

    def produce(self, paths: list[str]) -> None:
        singles: Batch | None = None
        for path in paths:
            try:
                ino = os.lstat(path).st_ino
            except FileNotFoundError:
                self._fail(path, "no such file or directory")
                continue
            except OSError as e:
                self._fail(path, e.strerror or str(e))
                continue
            try:
                info = control.request(path, {"op": "resolve", "ino": ino})
                if info["dir"]:
                    self._produce_dir(path, info["key"])
                elif info["etag"] is None:
                    # Written here and not uploaded yet: its data is already local.
                    self._listed(1, int(info["size"]))
                    self._record([[info["key"], info["size"], ""]], [[0, info["size"], None]],
                                 Batch(path, os.path.dirname(path), ""))
                else:
                    parent = os.path.dirname(os.path.abspath(path))
                    if singles is None or singles.ctl != parent:
                        if singles is not None:
                            self._put(singles)
                        singles = Batch(parent, parent, "")
                    singles = self._add(singles, [info["key"], info["size"], info["etag"]])
            except UserError as e:
                self._fail(path, str(e))
        if singles is not None:
            self._put(singles)

    def _produce_dir(self, path: str, key: str) -> None:
        batch = Batch(path, path, key, is_dir=True)
        after = ""
        while True:
            page = control.request(path, {"op": "list", "prefix": key, "after": after,
                                          "limit": 1000})
            for f in page["files"]:
                batch = self._add(batch, f)
            if not page["next"]:
                break
            after = page["next"]
        self._put(batch)

    # -- consuming ------------------------------------------------------------------------

    @staticmethod
    def _path_of(batch: Batch, key: str) -> str:
        if batch.is_dir:
            return os.path.join(batch.base_path, key[len(batch.base_key) + 1:]
                                if batch.base_key else key)
        return os.path.join(batch.base_path, os.path.basename(key))

    def _record(self, files: list[list[Any]], results: list[list[Any]], batch: Batch) -> None:
        done = 0
        for f, (fetched, cached, error) in zip(files, results, strict=True):
            if error:
                self._fail(self._path_of(batch, f[0]), _describe(error))
            with self.totals.lock:
                self.totals.files += 1
                self.totals.bytes += int(f[1])
                self.totals.fetched += int(fetched)
                self.totals.cached += int(cached)
            done += int(f[1])
        if self.bar is not None:
            self.bar.update(done)
            self.bar.set_postfix(files=self.totals.files, refresh=False)

    def consume(self) -> None:
        while (batch := self.queue.get()) is not None:
            try:
                reply = control.request(batch.ctl, {"op": "prefetch", "files": batch.files,
                                                    "pin": self.pin})
                self._record(batch.files, reply["results"], batch)
            except UserError as e:
                for f in batch.files:
                    self._fail(self._path_of(batch, f[0]), str(e))

    def run(self, paths: list[str]) -> Totals:
        workers = [threading.Thread(target=self.consume, daemon=True)
                   for _ in range(self.jobs)]
        for w in workers:
            w.start()
        try:
            self.produce(paths)
        finally:
            for _ in workers:
                self.queue.put(None)
        for w in workers:
            w.join()
        if self.bar is not None:
            self.bar.close()
        return self.totals


def run(paths: list[str], manifest: str | None, jobs: int, pin: bool, as_json: bool) -> int:
    names = expand(paths, manifest)
    t0 = time.monotonic()
    totals = Prefetcher(jobs, pin, progress=not as_json and sys.stderr.isatty()).run(names)
    seconds = time.monotonic() - t0
    summary = {"files": totals.files, "bytes": totals.bytes,
               "bytes_cached_before": totals.cached, "bytes_fetched": totals.fetched,
               "seconds": round(seconds, 3), "pinned": pin,
               "files_per_second": round(totals.files / seconds, 1) if seconds else None,
               "mb_per_second": round(totals.bytes / seconds / 1e6, 1) if seconds else None,
               "failures": totals.failures}
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        if not sys.stderr.isatty():  # the progress bar already showed them on a terminal
            for f in totals.failures:
                print(f"objcache prefetch: {f['path']}: {f['error']}", file=sys.stderr)
        print(f"prefetched {totals.files} files, {totals.bytes / (1 << 20):.1f} MiB "
              f"({totals.cached / (1 << 20):.1f} MiB already cached) in {seconds:.1f}s"
              + (", pinned" if pin else "")
              + (f"; {len(totals.failures)} failed" if totals.failures else ""))
    return 1 if totals.failures else 0
