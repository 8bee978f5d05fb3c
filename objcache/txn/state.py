"""The replicated state of a cluster: what every Raft member applies, in log order.

It is deterministic and knows nothing of Raft: the same commands in the same order give
the same state and the same digest on every node (tests drive it directly). Commands are
msgpack maps with an `op` and, for exactly-once application, a transaction id `tx`: a
command whose id was applied already returns the first result again instead of applying
twice, so a client may retry a command whose reply it lost.

State: the cluster's members (`member`) and the namespace overlay (objcache.txn.namespace:
dirty files, new directories, pending deletes and renames), whose commands are the `ns.*`
ops. After each command, `last_changes` holds what it changed in the namespace, for the
hook that updates this node's caches.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import zlib
from collections import OrderedDict
from typing import Any

import msgpack

from objcache.entries import NsChange, to_wire
from objcache.txn.namespace import Namespace

MAX_REMEMBERED_TX = 100_000  # ids of applied transactions kept for retries

_NS_OPS = {"noop", "create", "commit", "setdir", "unlink", "rmdir", "rename", "clean",
           "holders", "claim", "release"}


class ClusterState:
    def __init__(self) -> None:
        self.members: dict[str, dict[str, Any]] = {}
        self.applied = 0
        self.ns = Namespace()
        self._tx: OrderedDict[str, Any] = OrderedDict()
        # Transactions fenced by their submitter (`fence`): refused if they come later.
        self._fenced: OrderedDict[str, None] = OrderedDict()
        self.last_changes: list[NsChange] = []
        # Raft applies on its own thread while trio reads: one lock around both.
        self.lock = threading.Lock()

    def member_ids(self) -> list[str]:
        """The members the log records (each commits its record once per start; one that
        leaves cleanly removes it)."""
        with self.lock:
            return sorted(self.members)

    def __getstate__(self) -> dict[str, Any]:
        """Raft's dumps (log compaction) and a learner's snapshots pickle the state: as
        one zlib stream at level 1. pysyncobj gzips its dump at level 9 on the Raft
        thread, which stops committing meanwhile: with the 100,000 remembered
        transactions and 5,000 files not yet written back that took 0.40 s (a leader's
        pause as long as the shortest election timeout), 0.14 s with the state already
        compressed (docs/architecture.md, "Raft")."""
        with self.lock:
            d = dict(self.__dict__)
        del d["lock"]
        # (pickled outside the lock, as before: both callers hold applies off meanwhile,
        # pysyncobj by dumping on the thread that applies, a learner by its feed's lock)
        return {"z": zlib.compress(pickle.dumps(d, protocol=pickle.HIGHEST_PROTOCOL), 1)}

    def __setstate__(self, d: dict[str, Any]) -> None:
        if set(d) == {"z"}:
            d = pickle.loads(zlib.decompress(d["z"]))
        # (otherwise a dump written before the state was compressed: the dict itself)
        self.__dict__.update(d)
        self.__dict__.setdefault("_fenced", OrderedDict())  # (a snapshot from before it)
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
                return {"error": "malformed command: tx must be a string"}
            if tx in self._tx:
                return self._recall(tx)
            if tx in self._fenced:
                return {"error": "fenced"}
        op = cmd.get("op")
        try:
            if op == "member":
                result: Any = self._member(cmd)
            elif op == "fence":
                result = self._fence(cmd)
            elif isinstance(op, str) and op.startswith("ns.") and op[3:] in _NS_OPS:
                result = self.ns.apply(op[3:], cmd, self.applied + 1)
            else:
                result = {"error": f"unknown op {op!r}"}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            result = {"error": f"malformed {op}: {e}"}
        self.applied += 1
        if tx is not None:
            # Packed: with the 100,000 remembered and 5,000 files not yet written back,
            # the state took 23.7 MB, against 37.9 with each result kept as its dict
            # (tracemalloc), on every member. A learner gets its results packed anyway.
            self._tx[tx] = msgpack.packb(result, use_bin_type=True)
            while len(self._tx) > MAX_REMEMBERED_TX:
                self._tx.popitem(last=False)
        return result

    def _fence(self, cmd: dict[str, Any]) -> Any:
        """Settle transactions whose submitter gave up on them: each one applied already
        reports its result; every other one is fenced, so that it is refused if it
        reaches the log later (a resent or delayed copy). After this entry, whether each
        took effect is decided for good."""
        txs = cmd["txs"]
        if not isinstance(txs, list) or not all(isinstance(t, str) for t in txs):
            return {"error": "malformed fence: txs must be a list of ids"}
        applied = {t: self._recall(t) for t in txs if t in self._tx}
        for t in txs:
            if t not in applied:
                self._fenced[t] = None
        while len(self._fenced) > MAX_REMEMBERED_TX:
            self._fenced.popitem(last=False)
        return {"applied": applied, "fenced": [t for t in txs if t not in applied]}

    def _recall(self, tx: str) -> Any:
        """The result `tx` had when it was applied (a state from before results were
        packed holds them as they were)."""
        kept = self._tx[tx]
        return msgpack.unpackb(kept, raw=False) if isinstance(kept, bytes) else kept

    def _member(self, cmd: dict[str, Any]) -> Any:
        node = str(cmd["node"])
        if cmd.get("remove"):
            self.members.pop(node, None)
        else:
            self.members[node] = {"addr": str(cmd["addr"]), "cap": int(cmd["cap"])}
        return {"ok": True}

    # -- reading -----------------------------------------------------------------------------

    def digest(self) -> str:
        """A fingerprint of the whole state, equal on nodes that applied the same log."""
        with self.lock:
            members = sorted(self.members.items())
            entries = sorted((k, sorted(to_wire(e).items()))
                             for k, e in self.ns.entries.items())
            applied = self.applied
        blob = msgpack.packb([members, entries, applied], use_bin_type=True)
        return hashlib.sha256(blob).hexdigest()
