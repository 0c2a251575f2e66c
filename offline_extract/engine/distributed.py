"""Distributed layout: which part of the work this process does, from torchrun's environment.

Plain `python` is the one-process case. Global rank r is (dp_rank, tp_rank) = divmod(r, tp): torchrun
numbers ranks node by node, so a TP group never straddles nodes. Each DP replica is its own SGLang
world with its own rendezvous port; replicas only meet through torchrun's agent store, never through a
global process group (SGLang refuses one whose size differs from its TP size).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, TypeVar

import numpy as np

from offline_extract.options import DEFAULT_PORT_BASE

# Every rank bumps a counter this often; a rank waited for whose counter stands still for PEER_TIMEOUT
# is gone. Counters, not timestamps, so that nodes need no synchronised clocks.
HEARTBEAT = timedelta(seconds=2)
PEER_TIMEOUT = timedelta(seconds=30)
# The longest a rank that waits for others sleeps between two looks at the store.
POLL = timedelta(milliseconds=50)
# Torchrun's agent on node 0 serves its store from before any rank starts until the run ends: a rank that
# cannot reach it for this long will not (torch's own client would retry for as long as the store timeout).
STORE_CONNECT = timedelta(seconds=60)
T = TypeVar("T")


class LeaderFailed(RuntimeError):
    """The leading rank failed a step every rank depends on; its own error says why."""


class ReportedByLeader(RuntimeError):
    """Every rank stops for the same reason, which the leading rank has printed; the others only exit."""


class PeerLost(RuntimeError):
    """A rank this one waits for stopped answering (killed, out of memory, or its node went down), or
    torchrun's store that the ranks meet through did."""


def _store_lost(what: str) -> PeerLost:
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return PeerLost(
        f"torchrun's store at {address} (MASTER_ADDR:MASTER_PORT, served by node 0's torchrun) {what}: node 0 has "
        f"stopped (its log says why) or this node cannot reach it. This rank stops; complete shards are kept and "
        f"re-running the same command resumes."
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Layout:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    tp_size: int = 1

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def writes(self) -> bool:
        """Under TP every rank holds the same all-reduced states; one copy is enough."""
        return self.tp_rank == 0

    @property
    def leads(self) -> bool:
        """The one process that writes the directory-wide files (index, rejects) at the end."""
        return self.rank == 0

    def host_threads(self) -> int | None:
        """Intra-op threads for a writing rank's host copies (None: leave torch's count alone). Under
        torchrun every rank starts with one (it sets OMP_NUM_THREADS=1 for more than one process a node),
        so a writing rank copied 0.5 GB a batch into its shard buffers on one core; it gets its share of
        the node's cores instead."""
        if not self.writes or self.local_world_size == 1:
            return None
        return max(1, len(os.sched_getaffinity(0)) // self.local_world_size)

    def nccl_port(self, base: int | None) -> int:
        """SGLang's rendezvous port for this replica. Alone, any free port will do; under torchrun every
        rank of a replica must agree without talking, so it is derived from the base."""
        if base is None:
            return free_port() if self.world_size == 1 else DEFAULT_PORT_BASE + self.dp_rank
        return base + self.dp_rank


class Share:
    """The records one replica reads, every record being exactly one replica's: those not done yet dealt out
    in turn, each done one going with the next one left. A fresh run's share is every dp_size-th record; a
    resume's is an equal part of what is left. By index alone, the replica whose records an interrupted
    attempt had got further with would be done first, and wait for the others at the end."""

    def __init__(self, layout: Layout, done: np.ndarray):
        """`done[i]`: record i is in a complete shard already (resume.done_mask)."""
        left = ~done
        # Each record's place among those left (a done one: the next one's).
        self._mine = (np.cumsum(left) - left) % layout.dp_size == layout.dp_rank
        self._left, self._rank, self._size = int(left.sum()), layout.dp_rank, layout.dp_size

    def __call__(self, record_index: int) -> bool:
        if record_index < len(self._mine):
            return bool(self._mine[record_index])
        return (self._left + record_index - len(self._mine)) % self._size == self._rank

    def count(self, records: int) -> int:
        """How many of a corpus of `records` records are this replica's."""
        known = min(records, len(self._mine))
        past = len(range((self._rank - self._left) % self._size, records - known, self._size))
        return int(self._mine[:known].sum()) + past


def layout_from_env(tp_size: int = 1, env: Mapping[str, str] | None = None) -> Layout:
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", 1))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if tp_size < 1:
        raise ValueError(f"--tp must be at least 1, got {tp_size}")
    if local_world % tp_size:
        raise ValueError(
            f"--tp {tp_size} must divide the processes per node ({local_world}): a TP group has to stay inside one node"
        )
    return Layout(
        rank=int(env.get("RANK", 0)),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=local_world,
        tp_size=tp_size,
    )


class Coordinator:
    """Barriers and small exchanges between all ranks, over torchrun's agent TCPStore.

    With one process there is nobody to wait for, and every call returns at once. A wait has no deadline
    (a replica may legitimately take hours longer than another), but it ends with PeerLost naming the
    rank once a rank it waits for stops beating: torchrun stops the ranks of a failed worker's own node,
    not those of other nodes, which would otherwise wait forever. It also ends, saying so, once the store
    stops answering (node 0's torchrun is gone), and connecting to it gives up after `connect_timeout`.
    """

    def __init__(
        self,
        layout: Layout,
        namespace: str,
        peer_timeout: timedelta = PEER_TIMEOUT,
        connect_timeout: timedelta = STORE_CONNECT,
    ):
        self.layout = layout
        self.store = None
        self._peer_timeout = peer_timeout.total_seconds()
        self._stopped = threading.Event()
        if layout.world_size > 1:
            self.store = self._connect(namespace, connect_timeout)
            # Its own connection: the waits of the main thread hold theirs for seconds at a time.
            beat = threading.Thread(
                target=self._beat,
                args=(self._connect(namespace, connect_timeout),),
                daemon=True,
                name="offline_extract-heartbeat",
            )
            beat.start()
            atexit.register(self._stop_beating, beat)
        self._rounds = 0

    @staticmethod
    def _connect(namespace: str, timeout: timedelta):
        import torch.distributed as dist

        # Torchrun's agent already serves a store on MASTER_ADDR:MASTER_PORT; a prefix keeps our keys
        # apart from torch's own.
        try:
            base = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
            )
        except dist.DistNetworkError:
            raise _store_lost(f"did not answer within {timeout.total_seconds():.0f} s") from None
        return dist.PrefixStore(f"offline_extract/{namespace}/", base)

    def _beat(self, store) -> None:
        try:
            while not self._stopped.is_set():
                store.add(f"alive/{self.layout.rank}", 1)
                self._stopped.wait(HEARTBEAT.total_seconds())
        except Exception:
            return  # the store is gone with torchrun's agent: the main thread's next wait says so

    def _stop_beating(self, beat: threading.Thread) -> None:
        """At exit, before the interpreter finalizes: a daemon thread still in a store call then is ended by
        pthread_exit when the call takes the GIL back, inside pybind11's noexcept GIL guard, and the process
        aborts (std::terminate, SIGABRT), so torchrun reports a run that finished as failed. The beat in
        flight ends within the store's timeout."""
        self._stopped.set()
        beat.join()

    def _wait(self, store, keys: list[str]) -> None:
        """Until every key is set, checking every 2 x HEARTBEAT that the ranks still missing are alive."""
        from torch.distributed import DistNetworkError

        try:
            self._wait_alive(store, keys)
        except DistNetworkError:
            raise _store_lost("stopped answering") from None

    def _wait_alive(self, store, keys: list[str]) -> None:
        # Polled, not store.wait(keys, timeout): each wait that times out makes c10d print two warnings
        # ("waitForInput ... timed out"), every 4 s of a rank waiting for a slower one. The poll starts at a
        # millisecond, so that a barrier the ranks reach together costs nothing, and settles at POLL.
        last_beat: dict[int, tuple[int, float]] = {}
        pause, next_look = 0.001, time.monotonic() + 2 * HEARTBEAT.total_seconds()
        while not store.check(keys):
            time.sleep(pause)
            pause = min(2 * pause, POLL.total_seconds())
            now = time.monotonic()
            if now < next_look:
                continue
            next_look = now + 2 * HEARTBEAT.total_seconds()
            for key in keys:
                if store.check([key]):
                    continue
                rank = int(key.rsplit("/", 1)[1])
                beats = store.add(f"alive/{rank}", 0)
                seen = last_beat.get(rank)
                if seen is None or seen[0] != beats:
                    last_beat[rank] = (beats, now)
                elif now - seen[1] > self._peer_timeout:
                    # Every rank beats from its start (extraction.Job), so one that never did did not start.
                    what = (
                        f"stopped answering (no heartbeat for {self._peer_timeout:.0f} s): it was killed or its "
                        f"node went down"
                        if beats
                        else f"never answered (no heartbeat in {self._peer_timeout:.0f} s): it did not start, or "
                        f"died starting"
                    )
                    raise PeerLost(
                        f"rank {rank} {what}; its own log says why. This rank stops; complete shards are "
                        f"kept and re-running the same command resumes."
                    )

    def all_gather(self, value) -> list:
        """Every rank's JSON-serializable `value`, in rank order; also a barrier."""
        store = self.store
        if store is None:
            return [value]
        self._rounds += 1
        key = f"{self._rounds}/"
        store.set(key + str(self.layout.rank), json.dumps(value))
        keys = [key + str(r) for r in range(self.layout.world_size)]
        self._wait(store, keys)
        return [json.loads(store.get(k)) for k in keys]

    def barrier(self) -> None:
        self.all_gather(None)

    def from_leader(self, decide: Callable[[], T]) -> T:
        """Runs `decide` on the leading rank only and returns its JSON-serializable result on every rank.

        If it raises, the leader re-raises and every other rank raises LeaderFailed with its message, so
        no rank goes on, or waits forever, after the leader gave up.
        """
        outcome: dict | None = None
        error: Exception | None = None
        if self.layout.leads:
            try:
                outcome = {"result": decide()}
            except Exception as e:
                error = e
                outcome = {"error": f"{type(e).__name__}: {e}"}
        decided = self.all_gather(outcome)[0]
        if error is not None:
            raise error
        if "error" in decided:
            raise LeaderFailed(f"rank 0 stopped the run: {decided['error']}")
        return decided["result"]
