"""Which ranks share one download of a remote checkpoint (``checkpoint/download.sharing``),
from whose probe directories each rank saw. Every rank computes it from the same views,
so whatever the views, the groups must be the same from every member's side: two ranks
that split a download must both think so, or one of them waits for files nobody fetches."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from steadytrain.checkpoint.download import runs, sharing


def _groups(views: list[list[int]]) -> list[list[int]]:
    seen = [runs(v) for v in views]
    return [sharing(seen, r) for r in range(len(seen))]


def test_runs_keep_a_node_or_a_whole_job_to_a_few_numbers():
    assert runs([3, 0, 1, 2, 6, 7]) == ((0, 4), (6, 8))
    assert runs(list(range(4096))) == ((0, 4096),)
    assert runs([]) == ()


def test_ranks_that_see_each_other_share_and_others_go_alone():
    views = [[0, 1], [0, 1], [2], [3]]
    assert _groups(views) == [[0, 1], [0, 1], [2], [3]]


def test_thousands_of_ranks_on_one_filesystem_share_one_download():
    seen = [runs(range(4096))] * 4096  # what each rank sends: one run
    assert sharing(seen, 4095) == list(range(4096))


def test_a_rank_seen_by_one_side_only_shares_with_nobody():
    views = [[0, 1], [1], [2]]  # rank 1's filesystem showed rank 0's probe late
    assert _groups(views) == [[0], [1], [2]]


def test_a_view_that_is_not_transitive_leaves_every_member_alone():
    views = [[0, 1, 2], [0, 1], [0, 2]]  # 0 sees both, 1 and 2 do not see each other
    assert _groups(views) == [[0], [1], [2]]


def test_a_rank_that_could_not_make_its_probe_goes_alone_and_the_others_still_share():
    views = [[0, 1], [0, 1], [0, 1]]  # rank 2 sees the others' probes; nobody sees its own
    assert _groups(views) == [[0, 1], [0, 1], [2]]


@given(
    st.integers(1, 6).flatmap(
        lambda n: st.lists(st.sets(st.integers(0, n - 1)), min_size=n, max_size=n)
    )
)
def test_groups_agree_from_every_side(views):
    seen = [sorted(v) for v in views]
    groups = _groups(seen)
    for r, g in enumerate(groups):
        assert r in g
        for m in g:
            assert groups[m] == g  # a partition: every member names the same group
            assert m == r or (m in seen[r] and r in seen[m])  # and each saw the other
