"""HostOffload on CPU: every batch reaches the consumer in order, and the host's waits are counted."""

import time

import torch

from offline_extract.engine.offload import HostOffload


def test_a_slow_consumer_makes_the_caller_wait_for_staging_and_is_timed():
    got = []

    def consume(batch, staged):
        time.sleep(0.2)
        got.append((batch, staged["x"].sum().item()))

    def encode(aux, last):
        return {"x": aux + last}

    # One buffer: each submit after the first waits for the consumer to finish the batch before.
    with HostOffload(consume, "cpu", [None], encode) as offload:
        for i in range(3):
            offload.submit(i, torch.full((2,), float(i)), torch.ones(2))
    assert got == [(0, 2.0), (1, 4.0), (2, 6.0)]
    assert offload.times["consume_s"] >= 0.55
    assert 0.3 <= offload.times["writer_wait_s"] <= offload.times["consume_s"]
