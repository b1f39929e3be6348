"""The tracker's clean-up: a run interrupted (Ctrl-C) while it writes TensorBoard events still ends."""
import threading

from speedrun.track import Tracker


def test_a_writer_that_missed_a_wakeup_still_closes_soon(tmp_path):
    """CI (and a loop of Ctrl-Cs at the first evaluation) caught a run that did not end for over
    60 s after SIGINT: the KeyboardInterrupt had landed inside TensorBoard's writer while it put an
    event in its queue, and its writer thread missed the wake-up (a stale waiter, left in the
    queue's condition, took the notify meant for it). Closing then waits until that thread wakes by
    itself, after the writer's flush interval: 120 s by torch's default. Here the stale waiter is
    made by hand, as the interrupted notify leaves it."""
    tracker = Tracker(tmp_path)
    tracker.log_step({"step": 1, "epoch": 0, "loss": 1.0, "lr": 0.1})
    tracker._tb.flush()  # the writer thread is now waiting for the next event, or its next flush
    queue = tracker._tb.file_writer.event_writer._async_writer._byte_queue
    with queue.mutex:
        stale = threading.Lock()
        stale.acquire()
        queue.not_empty._waiters.appendleft(stale)
    closer = threading.Thread(target=tracker.close, daemon=True)
    closer.start()
    closer.join(timeout=60)  # a bound for a hang, not a speed test: the flush interval is seconds
    assert not closer.is_alive(), "closing the TensorBoard writer hung"
