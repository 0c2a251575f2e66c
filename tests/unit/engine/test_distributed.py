"""engine.distributed's Coordinator against a real TCPStore in this process, as torchrun's agent serves it."""

import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from offline_extract.engine.distributed import Coordinator, Layout, PeerLost, free_port


@pytest.fixture
def store_env(monkeypatch):
    """MASTER_ADDR/MASTER_PORT naming a free port; returns the port."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    return port


def test_a_store_nobody_serves_is_named_after_the_connect_timeout(store_env):
    start = time.monotonic()
    with pytest.raises(
        PeerLost,
        match=rf"torchrun's store at 127.0.0.1:{store_env} \(MASTER_ADDR:MASTER_PORT, "
        r"served by node 0's torchrun\) did not answer within 2 s: node 0 has stopped",
    ):
        Coordinator(Layout(rank=1, world_size=2), "test", connect_timeout=timedelta(seconds=2))
    assert time.monotonic() - start < 30  # torch's client alone would have retried for its 5-minute default


def test_a_rank_that_never_beat_is_named_as_never_started(store_env):
    server = dist.TCPStore("127.0.0.1", store_env, is_master=True, wait_for_workers=False)
    coord = Coordinator(Layout(rank=0, world_size=2), "test", peer_timeout=timedelta(seconds=1))
    with pytest.raises(
        PeerLost,
        match="rank 1 never answered .no heartbeat in 1 s.: it did not start, or died starting; its own log says why",
    ):
        coord.barrier()
    del server


def test_a_rank_waiting_for_a_slower_one_leaves_no_store_warnings(store_env, monkeypatch, capfd):
    # It waited in store.wait slices of 2 x HEARTBEAT, and c10d printed "waitForInput ... timed out" (two
    # lines) for each slice that ran out: every 4 s of a resumed DP=2 run's leader waiting at the end.
    import threading

    from offline_extract.engine import distributed

    monkeypatch.setattr(distributed, "HEARTBEAT", timedelta(milliseconds=50))
    server = dist.TCPStore("127.0.0.1", store_env, is_master=True, wait_for_workers=False)
    gathered = {}

    def rank(r: int, late: float) -> None:
        coord = Coordinator(Layout(rank=r, world_size=2), "test")
        time.sleep(late)
        gathered[r] = coord.all_gather(r)

    slow = threading.Thread(target=rank, args=(1, 0.5))  # ten times the slice a wait ran in
    slow.start()
    rank(0, 0.0)
    slow.join()
    assert gathered == {0: [0, 1], 1: [0, 1]}
    assert "waitForInput" not in capfd.readouterr().err
    del server


# A rank whose heartbeat waits inside a store call (C++, the GIL released) until the test releases it, and
# whose interpreter takes seconds to finalize.
HELD_AT_EXIT = """
import time
from offline_extract.engine import distributed

connect = distributed.Coordinator._connect
made = []


class Held:
    def __init__(self, store):
        self.store = store

    def add(self, key, amount):
        self.store.wait(["released"])
        return self.store.add(key, amount)


class SlowToFinalize:
    def __del__(self, sleep=time.sleep):  # module globals are gone by then
        sleep(3)


def held_heartbeat(namespace, timeout):
    made.append(connect(namespace, timeout))
    return made[0] if len(made) == 1 else Held(made[-1])


distributed.Coordinator._connect = staticmethod(held_heartbeat)
distributed.Coordinator(distributed.Layout(rank=1, world_size=2), "test")
slow = SlowToFinalize()
print("exiting", flush=True)
"""


def test_a_rank_exits_cleanly_while_its_heartbeat_is_in_a_store_call(store_env):
    # A daemon thread whose store call returns once the interpreter finalizes is ended by pthread_exit
    # inside pybind11's noexcept GIL guard: std::terminate, SIGABRT, and torchrun reports the run as failed.
    server = dist.TCPStore("127.0.0.1", store_env, is_master=True, wait_for_workers=False)
    rank = subprocess.Popen(
        [sys.executable, "-c", HELD_AT_EXIT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert rank.stdout.readline() == "exiting\n"
    time.sleep(1)  # the rank is finalizing by now
    dist.PrefixStore("offline_extract/test/", server).set("released", "1")
    _, err = rank.communicate(timeout=120)
    assert (rank.returncode, err) == (0, "")
    del server


def test_each_record_is_one_replicas_and_what_is_left_is_dealt_out_in_turn():
    import numpy as np

    from offline_extract.engine.distributed import Share

    rng = np.random.default_rng(0)
    for dp in (1, 2, 3):
        for done in (np.zeros(0, dtype=bool), rng.random(1) < 0.5, rng.random(30) < 0.5):
            shares = [Share(Layout(rank=r, world_size=dp), done) for r in range(dp)]
            total = len(done) + 11  # records past the mask too: the corpus has grown, or they failed before
            owners = [[r for r in range(dp) if shares[r](i)] for i in range(total)]
            assert all(len(o) == 1 for o in owners), owners
            left = [o[0] for i, o in enumerate(owners) if i >= len(done) or not done[i]]
            assert left == [k % dp for k in range(len(left))]
            for r in range(dp):
                for records in (total, len(done) // 2):
                    assert shares[r].count(records) == sum(o == [r] for o in owners[:records]), (dp, r, records)


def test_a_resume_gives_each_replica_an_equal_part_of_what_is_left():
    # By index, a DP=2 resume whose earlier attempt had done replica 0's records gave replica 1 all that was
    # left: replica 0 finished at once and waited at the end (the resumed run's 5 s "rejects and index").
    import numpy as np

    from offline_extract.engine.distributed import Share

    done = np.arange(40) % 2 == 0
    done[30:] = False
    left = [[i for i in range(40) if not done[i] and Share(Layout(rank=r, world_size=2), done)(i)] for r in (0, 1)]
    assert [len(part) for part in left] == [13, 12]  # by index: [5, 20]
    fresh = Share(Layout(rank=1, world_size=2), np.zeros(0, dtype=bool))
    assert [i for i in range(10) if fresh(i)] == [1, 3, 5, 7, 9]
