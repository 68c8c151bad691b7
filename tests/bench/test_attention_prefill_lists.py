"""``bench/kernels/attention_prefill.py``'s key lists: the layer kinds' lists as the sweep's model builds them (the
window's rows oldest first, then the compressed rows a query may see), so the tiles it compares run the prefill's
work."""

import pytest
import torch

from bench.kernels import attention_prefill


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_lists_hold_the_window_then_the_visible_compressed_rows(kind):
    n = 600
    idx, count, pool = attention_prefill.lists(n, kind, torch.Generator().manual_seed(0), "cpu")
    ratio = {"swa": None, "hca": 128, "csa": 4}[kind]
    assert pool == n + (n // ratio if ratio else 0)
    for i in (0, 1, 127, 128, 300, n - 1):
        nwin = min(i + 1, attention_prefill.WINDOW)
        row = idx[i, : int(count[i])].tolist()
        assert row[:nwin] == list(range(i - nwin + 1, i + 1))
        comp = row[nwin:]
        if ratio is None:
            assert comp == []
            continue
        visible = (i + 1) // ratio
        assert len(comp) == min(visible, attention_prefill.TOPK) and len(set(comp)) == len(comp)
        assert all(n <= c < n + visible for c in comp)
