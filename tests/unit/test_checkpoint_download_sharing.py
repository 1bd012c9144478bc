"""Which ranks share one download of a remote checkpoint (``checkpoint/download.sharing``),
from whose probe directories each rank saw. Every rank computes it from the same views,
so whatever the views, the groups must be the same from every member's side: two ranks
that split a download must both think so, or one of them waits for files nobody fetches."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from steadytrain.checkpoint.download import sharing


def test_ranks_that_see_each_other_share_and_others_go_alone():
    seen = [[0, 1], [0, 1], [2], [3]]
    assert [sharing(seen, r) for r in range(4)] == [[0, 1], [0, 1], [2], [3]]


def test_a_rank_seen_by_one_side_only_shares_with_nobody():
    seen = [[0, 1], [1], [2]]  # rank 1's filesystem showed rank 0's probe late
    assert [sharing(seen, r) for r in range(3)] == [[0], [1], [2]]


def test_a_view_that_is_not_transitive_leaves_every_member_alone():
    seen = [[0, 1, 2], [0, 1], [0, 2]]  # 0 shares with 1 and with 2, but 1 and 2 do not
    assert [sharing(seen, r) for r in range(3)] == [[0], [1], [2]]


@given(
    st.integers(1, 6).flatmap(
        lambda n: st.lists(st.sets(st.integers(0, n - 1)), min_size=n, max_size=n)
    )
)
def test_groups_agree_from_every_side(views):
    seen = [sorted(v) for v in views]
    groups = [sharing(seen, r) for r in range(len(seen))]
    for r, g in enumerate(groups):
        assert r in g
        for m in g:
            assert groups[m] == g  # a partition: every member names the same group
            assert m == r or (m in seen[r] and r in seen[m])  # and each saw the other
