"""``engine.heap.freeze_heap``, in a fresh interpreter (freezing the test process's heap would keep every later
test's reference cycles alive): after it, a full collection walks a few objects instead of the start-up's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc, json, torch
from deepinfer.engine.heap import freeze_heap
before = len(gc.get_objects())  # what a full collection walks (the permanent generation is not listed)
info = freeze_heap()
junk = [[i] for i in range(1000)]  # made after the freeze: collected as usual
after = len(gc.get_objects())
print(json.dumps({"before": before, "after": after, "info": info, "count": gc.get_freeze_count()}))
"""


def test_freeze_heap_takes_the_start_up_objects_out_of_collections() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "libs"))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["before"] > 20_000  # torch alone
    assert r["info"]["frozen"] == r["count"] >= r["before"] // 2
    assert 1000 <= r["after"] < r["before"] // 10  # the 1000 lists made after the freeze, little else
    assert r["info"]["collect_ms"] >= 0


CYCLE = """
import gc, json, weakref
from deepinfer.engine.heap import freeze_heap, thaw_heap
class Model:  # holds what holds it, as a model and its CUDA graphs do
    pass
m = Model()
m.graphs = [m]
ref = weakref.ref(m)
freeze_heap()
del m
freeze_heap()
kept_frozen = ref() is not None  # a cycle in the permanent generation outlives its last name
thaw_heap()
freeze_heap()  # collects first
print(json.dumps({"kept_frozen": kept_frozen, "freed_after_thaw": ref() is None}))
"""


def test_thaw_heap_lets_a_replaced_models_cycles_go() -> None:
    """What ``WorkerService.LoadModel`` relies on: a frozen cycle (a model and its graphs) survives its last
    reference until the heap is thawed; the next ``freeze_heap`` then collects it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "libs"))
    out = subprocess.run([sys.executable, "-c", CYCLE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"kept_frozen": True, "freed_after_thaw": True}
