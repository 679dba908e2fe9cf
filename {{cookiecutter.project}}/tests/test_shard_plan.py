"""The epoch plan of a shard stream: a pure function of (seed, epoch, sizes, readers)."""

import numpy as np

from {{ cookiecutter.package }}.engine import shard_plan

SIZES = [37, 5, 60, 18, 41, 9, 26, 14]


def test_each_shard_goes_to_one_reader_in_an_order_drawn_from_seed_and_epoch():
    keys = [(seed, epoch) for seed in (0, 1) for epoch in (0, 1)]
    plans = {key: shard_plan.reader_shards(*key, SIZES, len(SIZES), 3) for key in keys}
    for plan in plans.values():
        assert sorted(s for shards in plan for s in shards) == list(range(len(SIZES)))
    assert plans[0, 0] == shard_plan.reader_shards(0, 0, SIZES, len(SIZES), 3)  # pure
    assert plans[0, 0] != plans[0, 1] and plans[0, 0] != plans[1, 0]  # control: the key changes the order


def test_shards_balance_records_over_readers_with_sizes():
    plan = shard_plan.reader_shards(0, 0, SIZES, len(SIZES), 3)
    loads = [sum(SIZES[s] for s in shards) for shards in plan]
    assert max(loads) - min(loads) <= max(SIZES)
    round_robin = shard_plan.reader_shards(0, 0, None, len(SIZES), 3)
    assert [len(shards) for shards in round_robin] == [3, 3, 2]


def test_round_robin_leaves_out_an_ended_reader():
    assert shard_plan.round_robin([2, 1, 3], 0) == [0, 1, 2, 0, 2, 2]
    assert shard_plan.round_robin([2, 1, 3], 2) == [2, 0, 1, 2, 0, 2]


def test_lockstep_steps_and_dropped_records_add_up():
    workers, batch = 2, 4
    plan = shard_plan.reader_shards(3, 0, SIZES, len(SIZES), 2 * workers)  # 2 ranks x 2 workers
    counts = shard_plan.batch_counts(plan, SIZES, np.zeros(len(SIZES)), batch)
    steps = shard_plan.steps_left(plan, SIZES, np.zeros(len(SIZES)), batch, workers)
    assert steps == min(counts[0][0] + counts[1][0], counts[2][0] + counts[3][0])
    dropped = shard_plan.dropped(plan, SIZES, batch, workers)
    assert 0 < dropped < sum(SIZES)
    one_rank = shard_plan.reader_shards(3, 0, SIZES, len(SIZES), workers)
    assert shard_plan.dropped(one_rank, SIZES, batch, workers) == 0  # one process: nothing to keep in step with


def test_consumed_records_shorten_what_is_left():
    plan = shard_plan.reader_shards(0, 0, SIZES, len(SIZES), 2)
    before = shard_plan.steps_left(plan, SIZES, [0] * len(SIZES), 4, 2)
    consumed = [0] * len(SIZES)
    consumed[plan[0][0]] = 8
    assert shard_plan.steps_left(plan, SIZES, consumed, 4, 2) == before - 2
