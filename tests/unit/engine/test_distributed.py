"""engine.distributed's Coordinator against a real TCPStore in this process, as torchrun's agent serves it."""
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
    with pytest.raises(PeerLost, match=rf"torchrun's store at 127.0.0.1:{store_env} \(MASTER_ADDR:MASTER_PORT, "
                                       r"served by node 0's torchrun\) did not answer within 2 s: node 0 has stopped"):
        Coordinator(Layout(rank=1, world_size=2), "test", connect_timeout=timedelta(seconds=2))
    assert time.monotonic() - start < 30  # torch's client alone would have retried for its 5-minute default


def test_a_rank_that_never_beat_is_named_as_never_started(store_env):
    server = dist.TCPStore("127.0.0.1", store_env, is_master=True, wait_for_workers=False)
    coord = Coordinator(Layout(rank=0, world_size=2), "test", peer_timeout=timedelta(seconds=1))
    with pytest.raises(PeerLost, match="rank 1 never answered .no heartbeat in 1 s.: it did not start, or died "
                                       "starting; its own log says why"):
        coord.barrier()
    del server
