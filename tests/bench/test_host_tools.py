"""The sweep's host-side views of a run: ``bench/host/device_gaps.py`` (the device's idle gaps between activities of
a profile) and ``bench/host/host_ops.py`` (the host's time per op, nested calls subtracted, the ops restored after)."""

import time
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from bench.host.device_gaps import device_gaps
from bench.host.host_ops import host_op_times, host_spans, issue_timeline
from deepinfer.backends.reference import ReferenceOps


class _Profile:
    def __init__(self, events):
        self._events = [
            SimpleNamespace(name=n, time_range=SimpleNamespace(start=a, end=b), device_type=d) for n, a, b, d in events
        ]

    def events(self):
        return self._events


def test_gaps_are_the_span_without_any_device_activity():
    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    prof = _Profile([
        ("k1", 0, 10, cuda), ("k2", 5, 20, cuda),  # overlapping streams: busy 0..20
        ("cpu op", 0, 200, cpu),  # host activity never counts
        ("k3", 30, 40, cuda), ("k4", 41, 50, cuda), ("k5", 45, 47, cuda),  # a 10 µs gap, then 1 µs
        ("k6", 150, 160, cuda),  # a 100 µs gap
    ])  # fmt: skip
    out = device_gaps(prof, top=5, min_us=5.0)
    assert out["activities"] == 6 and out["gaps"] == 3
    assert out["span_ms"] == 0.16 and out["busy_ms"] == 0.049 and out["idle_ms"] == 0.111
    assert out["idle_in_gaps_over_min_ms"] == 0.11  # the 1 µs gap is under min_us
    assert [g["us"] for g in out["top_gaps"]] == [100.0, 10.0]
    assert out["top_gaps"][0] == {"us": 100.0, "after": "k4", "before": "k6"}
    assert out["top_gaps"][1]["after"] == "k2" and out["top_gaps"][1]["before"] == "k3"
    assert device_gaps(_Profile([("cpu", 0, 5, cpu)])) == {"activities": 0}


def test_host_op_times_nest_and_restore():
    ops = ReferenceOps()
    x, w = torch.randn(8, 16), torch.randn(4, 16)

    def slow_linear(a, b):
        time.sleep(0.05)  # well above any op's own time on a loaded machine (the order by self time is asserted)
        return a @ b.t()

    ops.linear = slow_linear  # an instance attribute: it must come back after the run

    def run():
        ops.rms_norm(ops.linear(x, w), None, 1e-6)
        time.sleep(0.003)  # outside any op

    out = host_op_times(ops, run, lambda: None)
    assert out["ops"]["linear"]["calls"] == 1 and out["ops"]["linear"]["self_ms"] >= 2.0
    assert out["ops"]["rms_norm"]["calls"] == 1
    assert out["outside_ops_ms"] >= 3.0 and out["issue_ms"] >= 5.0
    assert list(out["ops"])[0] == "linear"  # by self time
    assert ops.linear is slow_linear and "rms_norm" not in ops.__dict__  # restored


def test_nested_ops_count_once_in_self_time():
    ops = ReferenceOps()
    inner = ops.act_quant_sim

    def outer(x, block):
        time.sleep(0.002)
        return ops.act_quant_sim(x, block)  # through the wrapper: a nested op call

    ops.fp4_quant_sim = outer
    out = host_op_times(ops, lambda: ops.fp4_quant_sim(torch.randn(4, 32), 32), lambda: None)
    fp4, act = out["ops"]["fp4_quant_sim"], out["ops"]["act_quant_sim"]
    assert act["calls"] == 1 and fp4["ms"] >= fp4["self_ms"] + act["ms"] * 0.99
    assert ops.act_quant_sim == inner


class _Event:  # a CUDA event that completes when recorded (the host's clock)
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_issue_timeline_marks_each_layer_and_restores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    class Attn(torch.nn.Module):
        indexer = None

        def attend(self, x):
            return x + 1

        def _compress_batched(self, x):
            return x

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.ffn = Attn(), torch.nn.Identity()

        def attn_in(self, x):
            return x * 2

        def forward(self, x):
            return self.ffn(self.attn.attend(self.attn._compress_batched(self.attn_in(x))))

    model = SimpleNamespace(layers=[Layer(), Layer()])
    out = issue_timeline(model, lambda: [layer(torch.ones(2)) for layer in model.layers])
    at = [r["at"] for r in out]
    assert at == ["start"] + [f"layer {i}{s}" for i in range(2) for s in ("", " projections done",
              " a compressor done", " attention done", " moe done")] + ["issued"]  # fmt: skip
    assert all(r["host_ms"] >= 0 and abs(r["lag_ms"]) < 1.0 for r in out)
    for layer in model.layers:  # the methods are the classes' again
        assert "attn_in" not in vars(layer) and "attend" not in vars(layer.attn)


class _Owner:
    def outer(self):
        time.sleep(0.004)
        return self.inner() + 1

    def inner(self):
        time.sleep(0.002)
        return 1

    @classmethod
    def make(cls):
        return cls()

    @staticmethod
    def double(x):
        return 2 * x


def test_host_spans_time_nested_targets_per_run_and_restore():
    """``host_spans``: a class's method, a classmethod and an instance attribute timed over several runs (medians per
    run), the nested target's time out of the outer one's self time, every attribute as it was afterwards."""
    inst = _Owner()
    inst.extra = extra = lambda: time.sleep(0.001)
    raw_make, raw_outer, raw_double = _Owner.__dict__["make"], _Owner.__dict__["outer"], _Owner.__dict__["double"]

    def run():
        assert inst.double(2) == 4  # still a staticmethod while wrapped
        _Owner.make().outer()
        inst.outer()
        inst.extra()

    targets = [(_Owner, "outer", "outer"), (_Owner, "inner", "inner"), (_Owner, "make", "make"),
               (inst, "extra", "extra"), (_Owner, "double", "double"), (_Owner, "absent", "absent")]  # fmt: skip
    got = host_spans(targets, run, lambda: None, repeats=3)
    sp = got["spans"]
    assert sp["outer"]["calls"] == 2 and sp["inner"]["calls"] == 2 and sp["make"]["calls"] == 1
    assert sp["extra"]["calls"] == 1 and sp["double"]["calls"] == 1 and "absent" not in sp
    assert sp["outer"]["ms"] >= 12.0 and 8.0 <= sp["outer"]["self_ms"] < sp["outer"]["ms"] - 3.5
    assert sp["inner"]["self_ms"] == sp["inner"]["ms"] >= 4.0
    assert got["ms"] >= got["issue_ms"] >= 13.0
    assert _Owner.__dict__["make"] is raw_make and _Owner.__dict__["outer"] is raw_outer
    assert _Owner.__dict__["double"] is raw_double
    assert inst.__dict__["extra"] is extra and not hasattr(_Owner, "extra")
    assert isinstance(_Owner.make(), _Owner)


def test_chunk_issue_splits_the_timeline_at_each_batch_and_keeps_the_lag_range():
    from bench.host.host_ops import chunk_issue

    marks = [("start", 0.0, 0.0), ("batch built", 1.0, 0.5), ("layer 0", 3.0, 9.0), ("batch built", 10.0, 20.0),
             ("layer 0", 40.0, 200.0), ("issued", 41.0, 199.0)]  # fmt: skip
    timeline = [{"at": a, "host_ms": h, "lag_ms": lag} for a, h, lag in marks]
    assert chunk_issue(timeline) == [
        {"chunk": 0, "host_ms": 9.0, "lag_min_ms": 0.5, "lag_max_ms": 20.0},
        {"chunk": 1, "host_ms": 31.0, "lag_min_ms": 20.0, "lag_max_ms": 200.0},
    ]
    assert chunk_issue([{"at": "start", "host_ms": 0.0, "lag_ms": 0.0}]) == []
