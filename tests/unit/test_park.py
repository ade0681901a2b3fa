"""``Park`` (worker/allreduce/park.py): the round's thread stops the training thread between
two steps, only while it holds it, and gives up with a clear error when no step comes."""

from __future__ import annotations

import threading

import pytest

from diloco.worker.allreduce.park import Park


@pytest.mark.timeout(10)
def test_the_training_thread_parks_only_while_held() -> None:
    park = Park()
    park.serve()  # nothing asked: returns at once
    parked = threading.Event()
    steps: list[str] = []

    def training() -> None:
        while not parked.is_set():
            steps.append("step")
            park.serve()

    def round_thread() -> None:
        park.hold(timeout=5)
        steps.append("held")  # the training thread is between two steps now
        parked.set()
        park.release()

    t = threading.Thread(target=training)
    r = threading.Thread(target=round_thread)
    t.start()
    r.start()
    r.join(5)
    t.join(5)
    assert not t.is_alive() and not r.is_alive()
    assert "held" in steps and not park.held


@pytest.mark.timeout(10)
def test_waiting_for_a_round_parks_when_asked_and_ends_when_the_round_is_done() -> None:
    park = Park()
    done = threading.Event()
    order: list[str] = []

    def round_thread() -> None:
        park.hold(timeout=5)
        order.append("rebased")
        park.release()
        park.notify(done)

    r = threading.Thread(target=round_thread)
    r.start()
    park.wait(done)  # the training thread waits for its round and is parked meanwhile
    order.append("merged")
    r.join(5)
    assert order == ["rebased", "merged"]


def test_a_hold_gives_up_when_the_training_thread_takes_no_step() -> None:
    park = Park()
    with pytest.raises(TimeoutError, match="did not pause"):
        park.hold(timeout=0.05)
    assert not park.held  # a later step does not park
    park.serve()
