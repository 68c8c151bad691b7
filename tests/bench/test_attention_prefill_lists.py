"""``bench/kernels/attention_prefill.py``'s key lists: the layer kinds' lists as the sweep's model builds them (the
window's rows oldest first, then the compressed rows a query may see), so the tiles it compares run the prefill's
work."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))  # bench.harness
    try:
        spec = importlib.util.spec_from_file_location(
            "attention_prefill_under_test", ROOT / "bench" / "kernels" / "attention_prefill.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_lists_hold_the_window_then_the_visible_compressed_rows(bench, kind):
    n = 600
    idx, count, pool = bench.lists(n, kind, torch.Generator().manual_seed(0), "cpu")
    ratio = {"swa": None, "hca": 128, "csa": 4}[kind]
    assert pool == n + (n // ratio if ratio else 0)
    for i in (0, 1, 127, 128, 300, n - 1):
        nwin = min(i + 1, bench.WINDOW)
        row = idx[i, : int(count[i])].tolist()
        assert row[:nwin] == list(range(i - nwin + 1, i + 1))
        comp = row[nwin:]
        if ratio is None:
            assert comp == []
            continue
        visible = (i + 1) // ratio
        assert len(comp) == min(visible, bench.TOPK) and len(set(comp)) == len(comp)
        assert all(n <= c < n + visible for c in comp)
