from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deepinfer.engine.pages import OutOfPages, PagePool


def test_basic_allocate_free_lowest_first():
    pool = PagePool(8)
    assert (pool.num_total, pool.num_free, pool.num_used) == (8, 8, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([1, 3])
    assert pool.allocate(3) == [1, 3, 5]
    assert (pool.num_free, pool.num_used) == (2, 6)
    assert pool.allocate(0) == []
    assert pool.can_allocate(2) and not pool.can_allocate(3)


def test_out_of_pages_is_all_or_nothing():
    pool = PagePool(4)
    pool.allocate(3)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert (pool.num_free, pool.num_used) == (1, 3)
    assert pool.allocate(1) == [3]
    with pytest.raises(OutOfPages):
        pool.allocate(1)


def test_double_free_and_unknown_ids():
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(ValueError):
        pool.free([0])
    with pytest.raises(ValueError):
        pool.free([4])
    with pytest.raises(ValueError):
        pool.free([-1])
    with pytest.raises(ValueError):
        pool.incref([2])  # free page
    with pytest.raises(ValueError):
        pool.refcount(99)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert (pool.num_free, pool.num_used) == (4, 0)


def test_failed_free_changes_nothing():
    pool = PagePool(4)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([0, 1, 1])  # page 1 holds one reference only
    assert pool.refcount(0) == 1 and pool.refcount(1) == 1
    with pytest.raises(ValueError):
        pool.free([0, 3])  # 3 is free
    assert pool.refcount(0) == 1 and pool.num_used == 2


def test_refcount_sharing():
    pool = PagePool(3)
    a = pool.allocate(2)
    pool.incref(a)
    pool.incref([a[0]])
    assert [pool.refcount(p) for p in a] == [3, 2]
    pool.free(a)
    assert pool.num_used == 2
    pool.free(a)
    assert pool.refcount(a[0]) == 1 and pool.refcount(a[1]) == 0 and pool.num_free == 2
    pool.free([a[0]])
    assert pool.num_free == 3


class PagePoolMachine(RuleBasedStateMachine):
    """Model: a Counter of references held per page; pool must agree after every step."""

    def __init__(self):
        super().__init__()
        self.total = 12
        self.pool = PagePool(self.total)
        self.refs: Counter[int] = Counter()

    def _used(self):
        return sorted(p for p, c in self.refs.items() if c > 0)

    @rule(n=st.integers(0, 15))
    def allocate(self, n):
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(OutOfPages):
                self.pool.allocate(n)
            assert self.pool.num_free == free_before  # all-or-nothing
            return
        pages = self.pool.allocate(n)
        assert len(pages) == n == len(set(pages))
        assert all(self.refs[p] == 0 for p in pages), "handed out a referenced page"
        expected = sorted(set(range(self.total)) - set(self._used()))[:n]
        assert pages == expected  # lowest free ids first
        for p in pages:
            self.refs[p] += 1

    @precondition(lambda self: self._used())
    @rule(data=st.data())
    def free_some(self, data):
        used = self._used()
        pages = data.draw(st.lists(st.sampled_from(used), min_size=1, max_size=4))
        need = Counter(pages)
        if all(self.refs[p] >= c for p, c in need.items()):
            self.pool.free(pages)
            self.refs.subtract(need)
        else:
            before = dict(self.refs)
            with pytest.raises(ValueError):
                self.pool.free(pages)
            assert dict(self.refs) == before

    @precondition(lambda self: self._used())
    @rule(data=st.data())
    def incref_some(self, data):
        pages = data.draw(st.lists(st.sampled_from(self._used()), min_size=1, max_size=3))
        self.pool.incref(pages)
        self.refs.update(pages)

    @rule(page=st.integers(-2, 14))
    def free_unreferenced_raises(self, page):
        if 0 <= page < self.total and self.refs[page] > 0:
            return
        with pytest.raises(ValueError):
            self.pool.free([page])

    @invariant()
    def consistent(self):
        assert self.pool.num_free + self.pool.num_used == self.pool.num_total == self.total
        assert self.pool.num_used == len(self._used())
        for p in range(self.total):
            assert self.pool.refcount(p) == self.refs[p]


PagePoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, database=None)
TestPagePoolMachine = PagePoolMachine.TestCase


@settings(max_examples=200, deadline=None, database=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 6)), max_size=60))
def test_random_ops_never_hand_out_referenced_page(ops):
    pool = PagePool(10)
    live: list[list[int]] = []
    for op, k in ops:
        if op == "alloc":
            try:
                got = pool.allocate(k)
            except OutOfPages:
                assert k > pool.num_free
                continue
            held = {p for blk in live for p in blk}
            assert not held & set(got)
            live.append(got)
        elif live:
            pool.free(live.pop(k % len(live)))
        assert pool.num_free + pool.num_used == pool.num_total
