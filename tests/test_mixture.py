"""DATA_MIX: parsing, weighted windows per source, epochs per source."""

import numpy as np
import pytest

from experiment.mixture import MixError, MixedWindows, epochs_per_source, parse_mix


def test_parse_mix_normalizes_and_names_what_is_wrong():
    assert parse_mix("web=0.65, code=0.34,math=0.01", ["code", "math", "web"]) == pytest.approx([0.34, 0.01, 0.65])
    assert parse_mix("a=3,b=1", ["a", "b"]) == [0.75, 0.25]
    for text, message in (("a=1,c=1", "'c', which is no source"), ("a=1", "no weight to b"),
                          ("a=x,b=1", "'a=x'"), ("a=-1,b=1", "'a=-1'"), ("a=0,b=0", "sum to 0")):
        with pytest.raises(MixError, match=message):
            parse_mix(text, ["a", "b"])


def test_windows_follow_the_weights_and_stay_inside_their_source():
    lengths, seq = [100_000, 5_000, 40_000], 16
    mix = MixedWindows(lengths, [0.6, 0.3, 0.1], seq, seed=3)
    windows = mix.take(30_000)
    counts = np.bincount([s for s, _ in windows], minlength=3) / len(windows)
    assert counts == pytest.approx([0.6, 0.3, 0.1], abs=0.01)
    assert all(0 <= start and start + seq + 1 <= lengths[s] for s, start in windows)
    # The small source repeats (9,000 windows of its 312): each epoch visits every window once.
    small = [start for s, start in windows if s == 1][: (lengths[1] - 1) // seq]
    assert len(set(small)) == len(small)
    assert epochs_per_source(30_000 * seq, [0.6, 0.3, 0.1], lengths)[1] == pytest.approx(28.8)


def test_the_sequence_is_the_same_in_pieces_and_across_a_resume():
    args = ([50_000, 7_000], [0.5, 0.5], 32)
    whole = MixedWindows(*args, seed=1).take(5_000)
    first = MixedWindows(*args, seed=1)
    head = first.take(1_234)
    resumed = MixedWindows(*args, seed=1, state=first.state())  # as a checkpoint's meta holds it
    assert head + resumed.take(5_000 - 1_234) == whole
    assert MixedWindows(*args, seed=2).take(100) != whole[:100]


def test_a_zero_weight_source_is_never_drawn_even_when_it_is_too_short():
    windows = MixedWindows([10_000, 3], [1.0, 0.0], 16, seed=0).take(2_000)
    assert {s for s, _ in windows} == {0}
    with pytest.raises(MixError, match="no training window"):
        MixedWindows([10_000, 3], [0.5, 0.5], 16, seed=0)


def test_ranks_split_each_micro_step_and_two_ranks_read_what_one_reads():
    from experiment.mixture import MixedBatches

    tokens = np.arange(20_000, dtype=np.uint16)
    ranges, weights = [(0, 12_000), (12_000, 20_000)], [0.3, 0.7]
    one = MixedBatches(tokens, ranges, weights, seq_len=8, batch_size=4, seed=5)
    two = [MixedBatches(tokens, ranges, weights, seq_len=8, batch_size=2, rank=r, world_size=2, seed=5)
           for r in range(2)]
    for _ in range(50):
        x, y = next(one)
        halves = [next(b) for b in two]
        assert np.array_equal(x.numpy(), np.concatenate([h[0].numpy() for h in halves]))
        assert np.array_equal(y[:, :-1].numpy(), x[:, 1:].numpy())
        for row in x.numpy():  # never across a source boundary
            assert (row < 12_000).all() or (row >= 12_000).all()
    assert one.state() == two[0].state() == two[1].state()


def test_the_planner_warns_when_a_small_source_repeats_too_often():
    from experiment.runlog import source_epoch_lines

    splits = [{"name": "web", "train": [0, 1_000_000]}, {"name": "math", "train": [1_000_000, 1_010_000]}]
    lines = source_epoch_lines(2_000_000, [0.9, 0.1], splits)
    assert lines[0] == "planner | epochs by source | web 0.900 of the mix, 1.80 epochs | math 0.100 of the mix, 20.00 epochs"
    assert len(lines) == 2 and lines[1].startswith("warning: source math will be seen 20.0 times in the budget")
    assert len(source_epoch_lines(2_000_000, [0.995, 0.005], splits)) == 1  # 1 epoch of math: no warning


def test_a_source_named_twice_in_data_mix_is_an_error():
    with pytest.raises(MixError, match="gives 'a' two weights"):
        parse_mix("a=1,b=1,a=2", ["a", "b"])
