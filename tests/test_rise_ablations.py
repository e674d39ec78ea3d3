"""RISE Fig. 3's layer-group ablations (issue 30): `groups` keeps the selected experts of some layer groups
only; the others' shares of the budget are dropped, not moved to the kept groups."""
import pytest

from moekit.errors import ConfigError
from moekit.selection import select

from test_select import chosen, random_trace  # tests/test_select.py's trace builders

GROUPS = ("shallow", "middle", "deep")


def by_region(sel):
    regions = sel.params["layer_regions"]
    return {r: {(layer, e) for (layer, e) in chosen(sel) if regions[layer] == r} for r in GROUPS}


@pytest.mark.parametrize("kept", [("middle", "deep"), ("shallow", "deep"), ("shallow", "middle"),
                                  ("shallow",), ("middle",), ("deep",)])
def test_groups_keep_exactly_the_full_selection_in_those_groups(kept):
    """w/o X = the full selection minus X's experts; only X = X's experts of the full selection."""
    trace = random_trace(L=8, E=16)
    full, part = select(trace, "rise", "sw", 40), select(trace, "rise", "sw", 40, groups=kept)
    want = by_region(full)
    assert chosen(part) == set().union(*(want[r] for r in kept))
    assert part.count == sum(len(want[r]) for r in kept) == sum(full.params["region_budgets"][r] for r in kept)
    assert part.params["region_budgets"] == full.params["region_budgets"]  # the split of K is unchanged
    assert part.params["groups"] == list(kept)


def test_default_groups_are_all_three():
    trace = random_trace(L=8, E=16)
    assert select(trace, "rise", "sw", 12) == select(trace, "rise", "sw", 12, groups=GROUPS)


@pytest.mark.parametrize("bad", [[], ["surface"]])
def test_bad_groups_are_one_config_error(bad):
    with pytest.raises(ConfigError):
        select(random_trace(), "rise", "sw", 8, groups=bad)
