"""The engine's garbage-collector settings (rooflm/engine/host_gc.py)."""

import gc

from rooflm.engine.host_gc import GEN0_THRESHOLD, tune_gc_for_serving


def test_start_up_heap_frozen_and_young_objects_collected_less_often():
    tune_gc_for_serving()
    tune_gc_for_serving()  # once per process: a second engine changes nothing
    assert gc.get_threshold()[0] == GEN0_THRESHOLD
    assert gc.get_freeze_count() > 0
    assert gc.isenabled()  # cycles are still collected


def test_cycles_made_after_tuning_are_still_collected():
    import weakref

    tune_gc_for_serving()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    probe = weakref.ref(a)
    del a, b
    gc.collect()
    assert probe() is None
