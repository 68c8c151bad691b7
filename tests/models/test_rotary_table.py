"""``RotaryTable`` keeps its last cos/sin for the same positions tensor (every layer of a step passes the same one):
reused while the tensor is unchanged, recomputed after an in-place write, for another tensor, another op set, or a
tensor without a version counter (``torch.inference_mode``); always the values of a fresh table."""

import torch

from deepinfer.backends.reference import ReferenceOps
from deepinfer.models.deepseek_v4.config import YarnParams
from deepinfer.models.deepseek_v4.layers import RotaryTable


def _fresh(positions, ops):
    return RotaryTable(64, 10000.0, YarnParams(factor=16.0, original_max_position_embeddings=64))(positions, ops)


def test_reuse_and_invalidation():
    ops = ReferenceOps()
    table = RotaryTable(64, 10000.0, YarnParams(factor=16.0, original_max_position_embeddings=64))
    pos = torch.tensor([0, 5, 4096])
    cos, sin = table(pos, ops)
    again = table(pos, ops)
    assert again[0] is cos and again[1] is sin  # the same step's other layers: no recomputation
    pos.copy_(torch.tensor([7, 8, 9]))  # a static input refilled in place (a graphed step's positions)
    cos2, sin2 = table(pos, ops)
    assert cos2 is not cos
    for got, want in zip((cos2, sin2), _fresh(pos, ops)):
        assert torch.equal(got, want)
    other = pos.clone()  # equal values, another tensor
    assert table(other, ops)[0] is not cos2
    first = table(other, ops)[0]
    assert table(other, ReferenceOps())[0] is not first  # another op set: recomputed
    with torch.inference_mode():
        inf = torch.tensor([1, 2, 3])
        a, b = table(inf, ops), table(inf, ops)
    assert a[0] is not b[0]  # no version counter: never reused
    assert torch.equal(a[0], _fresh(inf, ops)[0])
