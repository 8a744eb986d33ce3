"""Dynamic batch sizing without processes: apportionment, damping, count rules, the loader's slices."""
import numpy as np
from pipetrain.config import ParallelConfig, Recipe
from pipetrain.data import Loader, PackedData
from pipetrain.parallel.replicas.dbs import DBS_GAIN, DBS_WINDOWS, DynamicBatch, apportion
from pipetrain.parallel.mesh.rules import count_rules, dbs_problems, layout_problems, parallel_problems


def test_apportion_sums_to_the_total_and_keeps_the_minimum():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 9))
        minimum = int(rng.integers(1, 4))
        total = n * minimum + int(rng.integers(0, 40))
        weights = rng.exponential(size=n).tolist()
        counts = apportion(weights, total, minimum)
        assert sum(counts) == total and min(counts) >= minimum, (weights, total, minimum, counts)


def test_apportion_is_largest_remainder_with_ties_to_the_lower_index():
    assert apportion([1, 1, 1], 10) == [4, 3, 3]            # quotas 3.33 each: the one left goes to index 0
    assert apportion([2, 1, 1], 8) == [4, 2, 2]             # exact quotas
    assert apportion([5, 3, 2], 7) == [4, 2, 1]             # quotas 3.5, 2.1, 1.4: remainders .5 > .4 > .1
    assert apportion([1, 1], 7) == [4, 3]
    assert apportion([0, 0], 4) == [2, 2]                   # no measurement: even
    assert apportion([1, 1, 1, 0.25], 8) == [3, 2, 2, 1]    # the slow one is held at the minimum, the rest share 7
    assert apportion([100, 1], 6, minimum=2) == [4, 2]


def _windows(dbs, slots, count=DBS_WINDOWS):
    """Feed `count` full windows of the same per-replica times; the result of each update."""
    out = []
    for _ in range(count):
        for _ in range(dbs.every):
            dbs.observe(slots)
        out.append(dbs.update())
    return out


def test_the_split_follows_speed_after_two_windows_and_ignores_noise_below_the_gain():
    dbs = DynamicBatch(replicas=4, microbatches=2, every=3, pp=1, granule=1, minimum=1)
    assert (DBS_GAIN, DBS_WINDOWS) == (0.10, 2)
    assert _windows(dbs, [1.0, 1.0, 1.0, 2.0]) == [False, True]  # replica 3 takes twice as long: moved once sure
    assert dbs.counts == [3, 2, 2, 1]  # quotas 2.29, 2.29, 2.29, 1.14: the spare one to index 0
    before = list(dbs.counts)
    assert _windows(dbs, [1.0, 1.02, 0.99, 2.0], 4) == [False] * 4  # a few percent of noise: below the gain
    assert dbs.counts == before


def test_one_slow_step_in_a_window_moves_nothing_and_one_noisy_window_is_forgotten():
    dbs = DynamicBatch(replicas=2, microbatches=4, every=5, pp=1, granule=1, minimum=1)
    for slow in (False, True, False, False, False):  # a transient straggler: x4 once
        dbs.observe([1.0, 4.0 if slow else 1.0])
    assert not dbs.update() and dbs.counts == [4, 4] and dbs.streak == 0
    assert _windows(dbs, [1.0, 4.0], 1) == [False] and dbs.streak == 1  # one window says move ...
    assert _windows(dbs, [1.0, 1.0], 1) == [False] and dbs.streak == 0  # ... the next does not: forgotten
    assert _windows(dbs, [1.0, 4.0]) == [False, True]  # persistently x4: the slow replica gets a fifth
    assert dbs.counts == [6, 2]  # speeds 1 : 1/4 of 8 microbatches = 6.4 : 1.6


def test_update_waits_for_a_full_window_and_skips_unmeasured_steps():
    dbs = DynamicBatch(replicas=2, microbatches=2, every=2, pp=1, granule=1, minimum=1)
    dbs.observe([1.0, 3.0])
    dbs.observe([0.0, 3.0])  # a replica without a time this step: not a measurement
    assert not dbs.update() and dbs.counts == [2, 2] and dbs.streak == 0
    dbs.observe([1.0, 3.0])
    assert not dbs.update() and dbs.streak == 1
    assert _windows(dbs, [1.0, 3.0], 1) == [True] and dbs.counts == [3, 1]


def test_pipelines_count_their_bubble_and_interleaved_counts_stay_multiples_of_pp():
    dbs = DynamicBatch(replicas=2, microbatches=4, every=1, pp=2, granule=2, minimum=2)
    assert dbs.slots(4) == 5
    assert _windows(dbs, [1.0, 3.0]) == [False, True] and dbs.counts == [6, 2]
    assert all(k % 2 == 0 for k in dbs.counts)
    assert count_rules("interleaved-1f1b", 2, 2) == (2, 2)
    assert count_rules("1f1b", 4, 1) == (1, 1)
    assert count_rules("dualpipev", 2, 2) == (1, 4)


def test_dbs_problems_name_the_key_and_the_fix():
    assert "dp_replicate" in dbs_problems("1f1b", 1, 1, 4, 1)[0]
    assert "parallel.microbatches=1 leaves no microbatch to move" in dbs_problems("1f1b", 1, 1, 1, 2)[0]
    assert "raise parallel.microbatches to 5" in dbs_problems("dualpipev", 2, 2, 4, 2)[0]
    assert dbs_problems("1f1b", 2, 1, 2, 2) == []
    recipe = Recipe(parallel=ParallelConfig(dynamic_batch=True, zero=1))  # ZeRO over all of dp: one replica
    assert any("parallel.dynamic_batch: needs dp_replicate" in p for p in layout_problems(recipe, 2))
    problems = parallel_problems(Recipe(parallel=ParallelConfig(dynamic_batch=True, dynamic_batch_every=0)))
    assert any(p.startswith("parallel.dynamic_batch_every: must be >= 1") for p in problems), problems


def _data():
    num = 40 * 9 + 1
    return PackedData(np.arange(num, dtype=np.int32) % 50, np.ones(num, dtype=bool), 8, 0.0, 3)


def test_the_loader_slices_cover_the_global_batch_in_order_whatever_the_split():
    data = _data()
    dp_shard, micro = 2, 1
    reference = data.train_batch(16, 16).inputs  # step 1 of a global batch of 16
    for counts in ([2, 2, 2, 2], [3, 2, 2, 1], [1, 1, 1, 5]):
        pieces = []
        for rank in range(8):  # 4 replicas x dp_shard 2
            loader = Loader(data, 16, rank, 8)
            loader.use_counts(counts, dp_shard, micro)
            loader.samples = 16
            batch, total = loader.next()
            assert total == 16 * 8
            assert len(batch.inputs) == counts[rank // dp_shard] * micro
            pieces.append(batch.inputs)
        assert np.array_equal(np.concatenate(pieces), reference.numpy()), counts


def test_the_split_is_saved_with_the_data_position():
    data = _data()
    loader = Loader(data, 8, 0, 4)
    loader.use_counts([3, 2, 2, 1], 1, 1)
    loader.next()
    state = loader.state_dict()
    fresh = Loader(data, 8, 0, 4)
    fresh.load_state_dict(state)
    assert fresh.samples == 8
    assert fresh.saved_split == {"dp_replicate": 4, "dp_shard": 1, "microbatch": 1, "counts": [3, 2, 2, 1]}
