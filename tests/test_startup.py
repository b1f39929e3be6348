"""speedrun.startup: a process's lifelong imports, made without the cyclic collector and then frozen."""
import gc

from speedrun.startup import kept_imports


def test_kept_imports_pause_the_collector_then_freeze_what_they_made():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with kept_imports():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # lists: objects the collector tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)


def test_kept_imports_leave_a_disabled_collector_disabled_even_when_the_block_fails():
    gc.disable()
    try:
        try:
            with kept_imports():
                raise ImportError("no such module")
        except ImportError:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
