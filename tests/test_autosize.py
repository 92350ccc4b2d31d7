"""DEPTH=auto: the rule, the probe, and the trainer keeping the choice across a resume."""

import json
import math

import pytest
import torch

from conftest import TINY, run_meta, run_train
from experiment import autosize
from experiment.autosize import Candidate, candidate, choose, data_lines, supported_depth
from experiment.memory import count_params
from experiment.config import ConfigError, TrainConfig, parse_args, resolve
from experiment.model import GPTConfig


def make_config(depth: int) -> GPTConfig:
    return GPTConfig(vocab_size=128, depth=depth, aspect_ratio=32, head_dim=64, max_seq_len=256)


def ladder_at(rate_d2: float, budget_s: float, train_tokens: int) -> list[Candidate]:
    """Candidates whose tok/s falls with FLOPs per token, as measured ones do."""
    base = make_config(2)
    return [candidate(make_config(d), rate_d2 * 6 * count_params(base) / (6 * count_params(make_config(d))),
                      budget_s, train_tokens) for d in autosize.ladder(32, 64)]


def test_choice_grows_with_the_budget():
    depths = [choose(ladder_at(80_000, s, 10**9)).depth for s in (60, 600, 6000, 60_000)]
    assert depths == sorted(depths) and depths[0] < depths[-1]


def test_rule_picks_the_sweeps_winners_from_their_measured_speeds():
    # The README's sweep on Tiny Shakespeare: tok/s the runs measured, and the depth that won.
    train_tokens = 1_003_856
    speeds = {60: {2: 93_500, 4: 16_500, 6: 7_255}, 180: {2: 77_400, 4: 18_400, 6: 5_750},
              600: {2: 77_400, 4: 19_100, 6: 6_670}}
    winners = {60: 2, 180: 4, 600: 6}
    for budget, rates in speeds.items():
        cands = [candidate(make_config(d), r, budget, train_tokens) for d, r in rates.items()]
        assert choose(cands).depth == winners[budget], budget


def test_a_budget_that_outruns_the_data_takes_the_largest_trained_depth():
    cands = ladder_at(80_000, 60_000, 10**6)  # every depth would repeat the data more than 8 times
    cands = [c for c in cands if c.epochs > autosize.MAX_EPOCHS]
    trained = [c for c in cands if c.tokens_per_param >= autosize.MIN_TOKENS_PER_PARAM]
    assert choose(cands) is max(trained, key=lambda c: c.params)


def test_choice_is_the_candidate_nearest_the_target_ratio():
    cands = ladder_at(80_000, 180, 10**9)
    best = choose(cands)
    eligible = [c for c in cands if c.tokens_per_param >= autosize.MIN_TOKENS_PER_PARAM]
    ratios = [abs(math.log(c.tokens_per_param / autosize.TOKENS_PER_PARAM)) for c in eligible]
    assert best is eligible[ratios.index(min(ratios))]


def test_supported_depth_follows_the_corpus_size():
    sizes = [10**5, 10**6, 10**8, 10**10]
    depths = [supported_depth(make_config, n) for n in sizes]
    assert depths[0] is None or depths[0] <= depths[1]
    assert depths[1:] == sorted(depths[1:]) and depths[-1] > depths[1]
    d = depths[2]  # the largest depth the data trains to the target ratio, and the next one does not
    useful = autosize.MAX_EPOCHS * 10**8
    assert useful / count_params(make_config(d)) >= autosize.MIN_TOKENS_PER_PARAM
    nxt = autosize.ladder(32, 64)[autosize.ladder(32, 64).index(d) + 1]
    assert useful / count_params(make_config(nxt)) < autosize.MIN_TOKENS_PER_PARAM


def test_an_explicit_depth_that_repeats_the_data_gets_a_warning():
    # The original question: a d64 for 31 h on 8 GPUs over a small corpus.
    gpu = lambda d: GPTConfig(vocab_size=50304, depth=d, aspect_ratio=64, head_dim=128, max_seq_len=2048)
    lines = data_lines(64, gpu, total_tokens=8 * 31 * 3600 * 20_000, train_tokens=10**8)
    assert "supports up to d" in lines[0] and "d64 has" in lines[0]
    assert lines[1].startswith("warning: d64 will see the training data 178.6 times")
    assert len(data_lines(64, gpu, total_tokens=2 * 10**8, train_tokens=10**8)) == 1


def test_probe_measures_the_ladder_and_stops_below_half_the_target():
    cfg = lambda d: GPTConfig(vocab_size=64, depth=d, aspect_ratio=32, head_dim=32, max_seq_len=32)
    chosen, cands = autosize.probe_and_choose(cfg, 2, torch.device("cpu"), 1, budget_s=2.0, train_tokens=10**6)
    assert [c.depth for c in cands] == autosize.ladder(32, 32)[: len(cands)]
    assert all(c.tok_per_s > 0 for c in cands) and chosen in cands
    def stops(c):
        return c.tokens_per_param < autosize.MIN_TOKENS_PER_PARAM or (
            c.tokens_per_param < autosize.TOKENS_PER_PARAM / 2 and c.epochs <= autosize.MAX_EPOCHS)
    assert stops(cands[-1]) or len(cands) == len(autosize.ladder(32, 32))
    assert not any(stops(c) for c in cands[:-1])


def test_depth_flag_takes_auto_or_a_positive_number():
    assert parse_args(["--depth", "auto"]).depth == "auto"
    assert parse_args(["--depth", "6"]).depth == 6
    assert resolve(parse_args([]), cuda=False, world_size=1).depth == "auto"
    assert resolve(parse_args([]), cuda=True, world_size=1).depth == 64
    assert resolve(parse_args(["--depth", "auto"]), cuda=False, world_size=1).model_tag == "auto"
    with pytest.raises(ConfigError, match="--depth must be"):
        resolve(TrainConfig(depth=0), cuda=False, world_size=1)


def test_trainer_chooses_records_and_keeps_the_depth_on_resume(tmp_path, corpus):
    i = TINY.index("--depth")
    args = [*TINY[:i], *TINY[i + 2:], "--depth", "auto", "--data_dir", corpus, "--workspace", tmp_path, "--training_hours", "0.002"]
    first = run_train([*args, "--max_steps", "3"])
    assert "auto: d" in first.stdout and "counted in the budget" in first.stdout
    meta = run_meta(tmp_path, 3, tag="auto")
    depth = meta["model_config"]["depth"]
    assert meta["auto"]["depth"] == depth and meta["train_config"]["depth"] == depth
    assert meta["auto"]["reason"].startswith(f"auto: d{depth} ")
    assert meta["state"]["used_seconds"] > 0
    second = run_train([*args, "--max_steps", "5"])
    assert f"auto: d{depth} kept from the checkpoint" in second.stdout
    assert run_meta(tmp_path, 5, tag="auto")["model_config"]["depth"] == depth
    assert json.loads(json.dumps(meta["auto"]["candidates"]))[0]["depth"] == 2
