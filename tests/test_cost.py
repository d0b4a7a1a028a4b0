"""The cost model by hand: forward 1, backward 2."""

import pytest

from jagg_core.cost import ideal_speedup, update_cost


@pytest.mark.parametrize("w", [2, 4, 8, 16])
def test_jagg_group_is_three_w_over_w_plus_four(w):
    # exact: W graphs; JAGG: 2 anchor graphs + (W − 2) no-grad middle forwards
    assert update_cost(grad_forwards=w, nograd_forwards=0) == 3 * w
    assert update_cost(grad_forwards=2, nograd_forwards=w - 2) == w + 4
    assert ideal_speedup(steps=w, grad_forwards=2, nograd_forwards=w - 2) == pytest.approx(3 * w / (w + 4))


def test_reuse_and_k_anchors():
    assert ideal_speedup(steps=8, grad_forwards=2, nograd_forwards=0) == pytest.approx(4.0)  # W/2 with reuse
    assert ideal_speedup(steps=8, grad_forwards=3, nograd_forwards=5) == pytest.approx(24 / (8 + 6))  # 3W/(W + 2K)
    # one JAGG group of 4 beside one exact group of 4: 24 / (8 + 12)
    assert ideal_speedup(steps=8, grad_forwards=2 + 4, nograd_forwards=2) == pytest.approx(1.2)
    # measured primitive costs: a no-grad forward cheaper than a with-grad one
    assert update_cost(grad_forwards=2, nograd_forwards=2, f0=0.5, f=1.0, b=3.0) == 2 * 4 + 2 * 0.5


def test_a_random_anchor_costs_one_graph_more_and_one_no_grad_forward_less():
    from jagg_core.cost import group_forwards

    assert group_forwards(8, "jagg", anchors=2, reuse=False, random_anchor=True) == (3, 5)  # what K = 3 costs
    assert group_forwards(8, "jagg", anchors=2, reuse=True, random_anchor=True) == (3, 0)
    assert group_forwards(8, "jagg", anchors=3, reuse=False, random_anchor=False) == (3, 5)
    assert group_forwards(8, "ablate", anchors=2, reuse=False, random_anchor=True) == (2, 6)  # jagg's option only
    assert group_forwards(2, "jagg", anchors=2, reuse=False, random_anchor=True) == (2, 0)  # no step left to draw
    assert group_forwards(8, "exact", anchors=2, reuse=False, random_anchor=True) == (8, 0)
    k, n = group_forwards(8, "jagg", anchors=2, reuse=False, random_anchor=True)
    assert ideal_speedup(steps=8, grad_forwards=k, nograd_forwards=n) == pytest.approx(24 / 14)
