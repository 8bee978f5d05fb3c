"""The replicated state machine: what every Raft member applies, in log order.

It is deterministic and knows nothing of Raft: the same commands in the same order give
the same state and the same digest on every node (tests drive it directly). Commands are
msgpack maps with an `op` and, for exactly-once application, a transaction id `tx`: a
command whose id was applied already returns the first result again instead of applying
twice, so a client may retry a command whose reply it lost.

State: cluster members, versioned records by key (`cas` makes conditional updates
possible), and the namespace overlay (objcache.txn.namespace: dirty files, new
directories, pending deletes and renames), whose commands are the `ns.*` ops. After each
namespace command, `last_changes` holds what it changed, for the Raft member to hand to
this node's caches.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

import msgpack

from objcache.txn.namespace import Namespace

MAX_REMEMBERED_TX = 100_000  # ids of applied transactions kept for retries


_NS_OPS = {"noop", "create", "commit", "setdir", "unlink", "rmdir", "rename", "clean",
           "holders"}


class StateError(Exception):
    """A command that does not parse: it is rejected the same way on every node."""


class ClusterState:
    def __init__(self) -> None:
        self.members: dict[str, dict[str, Any]] = {}
        self.records: dict[str, tuple[int, Any]] = {}  # key -> (version, value)
        self.applied = 0
        self.ns = Namespace()
        self._tx: OrderedDict[str, Any] = OrderedDict()
        self.last_changes: list[Any] = []
        # Raft applies on its own thread while trio reads: one lock around both.
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # Raft snapshots pickle the state
        with self.lock:
            d = dict(self.__dict__)
        del d["lock"]
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.lock = threading.Lock()

    # -- applying --------------------------------------------------------------------------

    def apply(self, cmd: dict[str, Any]) -> Any:
        with self.lock:
            self.ns.changes = []
            result = self._apply(cmd)
            self.last_changes, self.ns.changes = self.ns.changes, []
        return result

    def _apply(self, cmd: dict[str, Any]) -> Any:
        tx = cmd.get("tx")
        if tx is not None:
            if not isinstance(tx, str):
                raise StateError("tx must be a string")
            if tx in self._tx:
                return self._tx[tx]
        op = cmd.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        if isinstance(op, str) and op.startswith("ns.") and op[3:] in _NS_OPS:
            handler = self._op_ns
        if handler is None:
            result: Any = {"error": f"unknown op {op!r}"}
        else:
            try:
                result = handler(cmd)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
                result = {"error": f"malformed {op}: {e}"}
        self.applied += 1
        if tx is not None:
            self._tx[tx] = result
            while len(self._tx) > MAX_REMEMBERED_TX:
                self._tx.popitem(last=False)
        return result

    def _op_member(self, cmd: dict[str, Any]) -> Any:
        node = str(cmd["node"])
        if cmd.get("remove"):
            self.members.pop(node, None)
        else:
            self.members[node] = {"addr": str(cmd["addr"]), "cap": int(cmd["cap"])}
        return {"ok": True}

    def _op_put(self, cmd: dict[str, Any]) -> Any:
        key = str(cmd["key"])
        version = self.records.get(key, (0, None))[0] + 1
        self.records[key] = (version, cmd["value"])
        return {"ok": True, "version": version}

    def _op_cas(self, cmd: dict[str, Any]) -> Any:
        """Put (or delete, with value None) only if the key is still at `version`."""
        key = str(cmd["key"])
        current = self.records.get(key, (0, None))[0]
        if current != int(cmd["version"]):
            return {"ok": False, "version": current}
        if cmd.get("value") is None:
            self.records.pop(key, None)
            return {"ok": True, "version": 0}
        self.records[key] = (current + 1, cmd["value"])
        return {"ok": True, "version": current + 1}

    def _op_multi(self, cmd: dict[str, Any]) -> Any:
        """Several conditional updates, all or none: one transaction in one log entry."""
        ops = cmd["ops"]
        if not isinstance(ops, list):
            raise TypeError("ops must be a list")
        for o in ops:
            if self.records.get(str(o["key"]), (0, None))[0] != int(o["version"]):
                return {"ok": False, "conflict": str(o["key"])}
        versions = []
        for o in ops:
            versions.append(self._op_cas(o)["version"])
        return {"ok": True, "versions": versions}

    def _op_ns(self, cmd: dict[str, Any]) -> Any:
        return self.ns.apply(cmd["op"][3:], cmd, self.applied + 1)

    def _op_delete(self, cmd: dict[str, Any]) -> Any:
        return {"ok": self.records.pop(str(cmd["key"]), None) is not None}

    # -- reading -----------------------------------------------------------------------------

    def get(self, key: str) -> tuple[int, Any]:
        with self.lock:
            return self.records.get(key, (0, None))

    def digest(self) -> str:
        """A fingerprint of the whole state, equal on nodes that applied the same log."""
        with self.lock:
            members = sorted(self.members.items())
            records = sorted((k, list(v)) for k, v in self.records.items())
            entries = sorted((k, sorted(e.items())) for k, e in self.ns.entries.items())
            applied = self.applied
        blob = msgpack.packb([members, records, entries, applied], use_bin_type=True)
        return hashlib.sha256(blob).hexdigest()
