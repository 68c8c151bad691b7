"""Expert-load reports for EPLB (``events/experts.py``) over a real ``nats-server``: two ranks of a replica report,
the view sums them over its window, hostile reports are dropped, and the rebalancer turns the sums into moves."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus, barrier
from deepinfer.events.experts import ExpertLoadReporter, ExpertLoadView
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.rebalancer import propose


@pytest.mark.timeout(60)
def test_ranks_report_and_the_view_sums_them(nats_server, wait_until):
    async def main():
        async with EventBus(name="ranks") as ranks, EventBus(name="view") as other:
            await ranks.connect(nats_server.url)
            await other.connect(nats_server.url)
            view = ExpertLoadView(other, window_s=30.0)
            await view.start()
            await barrier(other.nc)  # the server has the subscription before the other connection publishes
            counts = {0: {3: [5, 0, 1, 0], 4: [0, 0, 0, 9]}, 1: {3: [7, 2, 0, 0], 4: [1, 1, 1, 1]}}
            taken = []

            def supplier(rank):
                def take():
                    taken.append(rank)
                    got, counts[rank] = counts[rank], {3: [0] * 4, 4: [0] * 4}
                    return got

                return take

            reporters = [ExpertLoadReporter(ranks, "r0", r, supplier(r), period_s=0.05) for r in (0, 1)]
            for r in reporters:
                assert await r.report()
            await wait_until(lambda: view.received == 2, 10)
            loads = view.loads("r0")
            assert loads[3].tolist() == [12, 2, 1, 0] and loads[4].tolist() == [1, 1, 1, 10]
            assert view.loads("r1") == {} and taken == [0, 1]
            # hostile reports: not an object, negative counts, a layer of another width, no layers at all
            for bad in ({"layers": [1, 2]}, {"layers": {"3": [-1, 0, 0, 0]}}, {"layers": {"3": [1, 2]}}, {"x": 1}):
                assert await ranks.publish(subjects.experts_subject("r0"), bad)
            await ranks.nc.publish(subjects.experts_subject("r0"), b"\xff not json")
            await wait_until(lambda: view.rejected == 4, 10)
            assert view.loads("r0")[3].tolist() == [12, 2, 1, 0]
            for r in reporters:  # the loop reports on its own; the counts taken since are zeros here
                await r.start()
            await wait_until(lambda: view.received >= 4, 10)
            for r in reporters:
                await r.stop()
            assert view.loads("r0")[3].tolist() == [12, 2, 1, 0]
            await view.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_old_reports_leave_the_window(nats_server, wait_until):
    async def main():
        async with EventBus() as bus:
            await bus.connect(nats_server.url)
            view = ExpertLoadView(bus, window_s=0.3)
            await view.start()
            reporter = ExpertLoadReporter(bus, "r0", 0, lambda: {0: [1, 2]}, period_s=60)
            assert await reporter.report()
            await wait_until(lambda: view.received == 1, 10)
            await wait_until(lambda: view.loads("r0") == {}, 10)  # (a short window instead of a long wait)

    asyncio.run(main())


def test_the_view_feeds_the_rebalancer():
    """A replica whose reports show one hot expert per layer: the rebalancer moves those layers (and copies the hot
    expert), not a layer whose load is flat."""
    even = ExpertPlacement.even(8, 2)
    hot = np.array([900, 10, 10, 10, 10, 10, 10, 10])
    got = propose({0: hot, 1: np.full(8, 50)}, {0: even, 1: even}, slots=5)
    assert sorted(got) == [0] and sum(s.count(0) for s in got[0].slots) >= 2
