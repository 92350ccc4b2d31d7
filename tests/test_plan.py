"""The plan: per-depth predictions and the recommendation, from TOKENS or a streamed count, no GPU needed."""

import json
import shlex
import subprocess

import pytest

from conftest import ENV, REPO
from test_guards import run_preflight

from experiment import autosize, servemem
from experiment.dataloader import DataError
from experiment.memory import count_params
from experiment.plan import LAPTOP_CHARS_PER_S, PlanConfig, count_tokens, model_config, parse_gpus, plan, regime_lines, table as table_of


def run_plan(*args, env=None, cwd=REPO):
    return subprocess.run(["bash", str(REPO / "run.sh"), "plan", *args], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_issue_example_with_the_regularizers_off_as_json_and_as_a_table():
    env = {"TOKENS": "350000000", "GPUS": "8xH100-PCIe", "TRAINING_HOURS": "31", "REGULARIZERS": "off"}
    proc = run_plan("--json", env=env)
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    chosen = next(r for r in p["rungs"] if r["depth"] == p["depth"])
    # never past MAX_EPOCHS passes: the hours worth paying for are those passes, the rest is unspent
    assert p["hours"] == chosen["useful_hours"] == autosize.MAX_EPOCHS * chosen["hours_per_pass"] < 31
    assert abs(p["unspent_usd"] - (31 - p["hours"]) * 32) < 1e-6 and p["budget_usd"] == 992
    assert autosize.MIN_TOKENS_PER_PARAM <= chosen["tokens_per_param"]
    # 31 h outlast every depth's 8 passes: the largest depth that 8 passes give 1 token/param, the
    # issue's own reckoning (d32 for about 2.6 h)
    assert all(r["budget_epochs"] > autosize.MAX_EPOCHS for r in p["rungs"])
    larger = [r for r in p["rungs"] if r["depth"] > p["depth"]]
    assert p["depth"] == 32 and all(r["tokens_per_param"] < autosize.MIN_TOKENS_PER_PARAM for r in larger)
    # By hand: a step of 524,288 tokens is d32's FLOPs at d24's measured MFU (52.8%, the nearest) on 8
    # x 756 TFLOP/s, plus 3 x 7/8 of its fp32 gradient bytes at 20 GB/s; 8 passes of 332.5M tokens.
    config = model_config(32, PlanConfig(), 256)
    compute = 524288 * autosize.flops_per_token(config) / (0.528 * 756e12 * 8)
    comm = 3 * 7 / 8 * count_params(config) * 4 / 20e9
    assert p["hours"] == pytest.approx(8 * 332_500_000 / (524288 / (compute + comm)) / 3600)
    assert 3.7 < p["hours"] < 3.9
    assert p["launch"] == "NPROC_PER_NODE=8 DEPTH=32 BUDGET_USD=992 ATTN_DROPOUT=0 AVERAGE=none bash experiment/run.sh"
    one, eight = p["gpu_table"][0], p["gpu_table"][-1]
    assert (one["gpus"], eight["gpus"]) == (1, 8) and eight["hours"] == pytest.approx(p["hours"])
    assert 20.8 < one["hours"] < 21.0 and one["comm_share"] == 0 and one["usd"] < eight["usd"]  # no all-reduce
    table = run_plan(env=env).stdout
    assert "PREDICTED" in table and "MFU measured on one H100 80GB HBM3 (reports/gpucheck-h100.md" in table
    assert f"recommendation | DEPTH={p['depth']} on 8 GPU(s) for {p['hours']:.2f} h (${p['usd']:,.0f}) of the launch " \
        "line's $992 (31.0 h on 8); $870 unspent" in table
    assert p["max_passes"] == pytest.approx(autosize.MAX_EPOCHS)  # the data limits: all its passes
    assert f"at most {p['max_passes']:.1f} passes; stops earlier when val stops improving" in table
    assert p["stops_at_val_minimum"] is True


@pytest.mark.slow
def test_the_issue_example_with_the_trainers_defaults_trains_a_chain_of_generations_all_31_hours():
    """The trainer's defaults regularize a data-limited run, and its launch line adds GENERATIONS=auto,
    so the plan sizes the chain's first generation (autosize.GENERATION_PASSES): the largest depth whose
    31 h make at least 16 passes, 250 steps and 0.5 tokens/param, with a token per parameter in 16 passes
    (autosize.CHAIN_FLOOR: d48 sees 0.98), for the whole budget; one model alone (d56, 15.2 passes) and
    the plain rule's d32 for 8 passes are said beside it."""
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31))
    rungs = {r["depth"]: r for r in p["rungs"]}
    chosen = rungs[p["depth"]]
    assert p["depth"] == 40 and p["hours"] == pytest.approx(31) and p["unspent_usd"] == pytest.approx(0)
    assert chosen["budget_epochs"] >= autosize.GENERATION_PASSES > rungs[56]["budget_epochs"] > 4
    assert chosen["tokens_per_param"] >= autosize.REG_FLOOR
    in_16 = lambda d: autosize.GENERATION_PASSES * p["train_tokens"] / rungs[d]["params"]
    assert rungs[48]["budget_epochs"] >= autosize.GENERATION_PASSES and in_16(48) < autosize.CHAIN_FLOOR <= in_16(40)
    assert p["one_model"] == {"depth": 56, "passes": pytest.approx(rungs[56]["budget_epochs"])}
    assert rungs[64]["budget_epochs"] > 4 and rungs[64]["tokens_per_param"] < autosize.REG_FLOOR  # 0.3: too few
    assert p["launch"] == "NPROC_PER_NODE=8 DEPTH=40 BUDGET_USD=992 GENERATIONS=auto bash experiment/run.sh"
    assert (p["plain"]["depth"], p["plain"]["passes"]) == (32, pytest.approx(8)) and 3.7 < p["plain"]["hours"] < 3.9
    assert p["regime"]["regularized"] and p["regime"]["settings"]["ATTN_DROPOUT"] == 0.2
    # 33.9 passes: 32 would leave under 0.4 of a generation's for another, so the first plans for them all
    assert p["regime"]["settings"]["MAX_EPOCHS"] == 0.0
    text = table_of(p)
    assert "GENERATIONS=auto, the largest depth the regime regularizes with at least 16 epochs" in text
    assert "$0 unspent" in text and "d40 and what its passes buy are EXTRAPOLATED" in text
    assert "GENERATIONS=auto: when the stop at the val minimum ends d40 with budget left" in text
    assert "the trainer's defaults are ATTN_DROPOUT=0.2, AVERAGE=ema, MAX_EPOCHS=0" in text
    assert "sized for it: d40, whose budget makes 33.9 passes (at least 16), where one model alone would be d56 " \
        "(15.2 passes)" in text
    # d40 decodes 1.4 characters a second on a 2-core CPU: a student a laptop serves, the largest fast enough
    assert p["student"]["depth"] == 12 and p["student"]["cpu_chars_per_s"] >= LAPTOP_CHARS_PER_S
    assert rungs[16]["cpu_chars_per_s"] < LAPTOP_CHARS_PER_S and p["teacher_fits"]
    assert "GENERATIONS=2 STUDENT_DEPTH=12 instead of GENERATIONS=auto trains two d40, then a d12 student" in text
    assert "launch | to stop paying when it ends, add ON_EXIT='[ \"$RUN_STATUS\" != stopped ] && runpodctl" in text
    assert f"the plain rule trains d32 for 8.0 passes, {p['plain']['hours']:.2f} h on these GPUs" in text
    assert p["sweep"] is None  # one GPU needs 168 h for d40's passes, past the box's 31: no sweep of single-GPU members
    assert "past 4 passes regularized and no pass cap" in p["rule"]
    # Sized for the hours the launch line buys: 24 h available pick d40 (d48 makes under 16 passes in them)
    short = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, hours_available=24))
    assert (short["depth"], short["recommended_gpus"], short["hours"]) == (40, 8, pytest.approx(24))
    assert short["launch"] == "NPROC_PER_NODE=8 DEPTH=40 BUDGET_USD=768 GENERATIONS=auto bash experiment/run.sh"
    assert short["one_model"]["depth"] == 48
    off = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, regularizers="off"))
    assert off["depth"] == 32 and "never more than 8 passes" in off["rule"] and "regularized" not in off["rule"]
    assert "one_model" not in off and "GENERATIONS" not in off["launch"]
    # twice the hours: more passes, the same d40 (d48 still sees under a token per parameter in 16)
    long = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=62))
    assert (long["depth"], long["one_model"]["depth"]) == (40, 64) and long["teacher_fits"]
    assert long["regime"]["budget_passes"] > 44.8 and long["regime"]["settings"]["MAX_EPOCHS"] == autosize.CHAIN_PASSES
    assert "when the stop at the val minimum (or its 32 passes, MAX_EPOCHS=32) ends d40" in table_of(long)
    # 900M tokens for 150 h: d64 would make 19 passes and see its token per parameter, but would not hold
    # a teacher of its size on 8 x 80 GB; d56 (29 passes) does
    big = plan(PlanConfig(tokens=900_000_000, gpus="8xH100-PCIe", training_hours=150))
    assert (big["depth"], big["one_model"]["depth"]) == (56, 64) and big["teacher_fits"]
    assert big["launch"] == "NPROC_PER_NODE=8 DEPTH=56 BUDGET_USD=4800 GENERATIONS=auto bash experiment/run.sh"


@pytest.mark.slow
def test_the_plan_the_preflight_and_the_trainer_size_a_chain_alike():
    """The plan's GENERATIONS=auto depth is the one the pre-flight (guards.auto_depth) and the trainer's
    prediction (autosize.predict_and_choose) pick for the chain's first generation on these GPUs; a
    later generation's prediction (gen2, never re-sized for the chain) is one model's."""
    import dataclasses

    from experiment import guards
    from experiment.config import TrainConfig
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31))
    gpus, make = parse_gpus("8xH100-PCIe"), lambda d: model_config(d, PlanConfig(), 256)
    args = (make, gpus.peak, 8, gpus.memory_bytes, 31 * 3600, p["train_tokens"], gpus.link_gbps, gpus.name, 524288, True)
    assert autosize.predict_and_choose(*args, generations=True)[0].depth == p["depth"] == 40
    assert autosize.predict_and_choose(*args)[0].depth == p["one_model"]["depth"] == 56
    cfg = TrainConfig(generations="auto", depth="auto", training_hours=31, total_batch_size=524288, model_tag="t/gen1")
    gpu = guards.Gpu(gpus.name, gpus.peak, gpus.memory_bytes)
    assert guards.auto_depth(cfg, make, gpu, 8, p["train_tokens"], True) == 40
    assert guards.auto_depth(dataclasses.replace(cfg, model_tag="t/gen2"), make, gpu, 8, p["train_tokens"], True) == 56


def test_where_one_model_already_makes_the_chains_passes_the_plan_names_no_other_depth():
    """Where DEPTH=auto's one model already makes autosize.GENERATION_PASSES, the chain's first
    generation is that model: the plan sizes it once and says no one-model depth beside it."""
    p = plan(PlanConfig(tokens=1_000_000_000, gpus="8xH200", training_hours=150))
    assert p["regime"]["regularized"] and p["regime"]["budget_passes"] >= autosize.GENERATION_PASSES
    assert "one_model" not in p and p["depth"] == 64 and "GENERATIONS=auto" in p["launch"]


@pytest.mark.slow
def test_regularizers_as_the_environment_gives_it_and_a_budget_limited_pick_keeps_the_cap_in_its_rule():
    """REGULARIZERS read from the environment is a string built at run time, not the literal: it sizes
    the regularized pick all the same. The plain pick said beside it is the pick of REGULARIZERS=off,
    to the second. A pick that makes at most 4 passes keeps the pass cap in its rule with the
    regularizers on (the regime does not regularize it)."""
    auto = "".join(["au", "to"])  # what os.environ or argv hands over
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, regularizers=auto))
    assert p["depth"] == 40 and p["regime"]["regularized"] and "past 4 passes regularized" in p["rule"]
    short = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, hours_available=24,
                            regularizers=auto))
    assert (short["depth"], short["hours"]) == (40, pytest.approx(24))
    off = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, regularizers="off"))
    assert (p["plain"]["depth"], p["plain"]["hours"]) == (off["depth"], pytest.approx(off["hours"], rel=1e-9))
    big = plan(PlanConfig(tokens=20_000_000_000, gpus="8xH100-PCIe", training_hours=31))
    assert big["max_passes"] <= 4 and "never more than" in big["rule"] and "regularized" not in big["rule"]
    big_off = plan(PlanConfig(tokens=20_000_000_000, gpus="8xH100-PCIe", training_hours=31, regularizers="off"))
    assert big["plain"]["hours"] == pytest.approx(big_off["hours"], rel=1e-9) == 31  # the budget binds the plain pick


@pytest.mark.slow
def test_the_hours_are_the_budget_or_the_passes_whichever_ends_first_and_dollars_set_the_budget():
    for hours in (0.1, 0.5, 3.0):
        p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=hours))
        chosen = next(r for r in p["rungs"] if r["depth"] == p["depth"])
        assert p["hours"] == min(hours, autosize.MAX_EPOCHS * chosen["hours_per_pass"])
        assert abs(p["unspent_usd"] - (hours - p["hours"]) * 32) < 1e-6
    assert plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=0.1))["unspent_usd"] == 0
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-SXM", budget_usd=500))
    assert p["budget_hours"] == 500 / 32 and p["peak_flops"] == 989e12


@pytest.mark.slow
def test_the_plan_says_the_regime_of_the_launch_lines_run():
    """The launch line's budget on its GPUs, at the recommended depth: past 4 passes the trainer's
    defaults are the data-limited recipe (experiment/regime.py), and the plan says it may spend past
    the pass cap's hours; a budget of fewer passes keeps every regularizer off."""
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31))
    chosen = next(r for r in p["rungs"] if r["depth"] == p["depth"])
    r = p["regime"]
    assert r["gpus"] == 8 and r["budget_passes"] == pytest.approx(chosen["budget_epochs"])
    # the launch line's GENERATIONS=auto: no cap either, as 33.9 passes leave no room for CHAIN_PASSES and
    # another generation (regime.pass_cap)
    assert r["data_limited"] and r["settings"] == {"ATTN_DROPOUT": 0.2, "AVERAGE": "ema", "MAX_EPOCHS": 0.0}
    assert r["usd_at_most"] == pytest.approx(992) and r["hours_at_most"] == pytest.approx(31)
    assert "passes at d40 on 8 GPU(s), more than 4: data-limited" in "\n".join(regime_lines(p))
    # With the regularizers off (the plain rule's d32): the launch line's 1 GPU for 24 h, not 8 for 31
    off = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, hours_available=24,
                          regularizers="off"))
    one, row = off["regime"], next(x for x in off["gpu_table"] if x["gpus"] == 1)
    assert one["gpus"] == 1 and one["budget_passes"] == pytest.approx(row["tok_per_s"] * 24 * 3600 / p["train_tokens"])
    assert one["data_limited"] and not one["regularized"] and one["usd_at_most"] is None
    assert one["settings"] == {"ATTN_DROPOUT": 0.0, "AVERAGE": "none"}
    assert "but REGULARIZERS=off: the launch line pins ATTN_DROPOUT=0, AVERAGE=none" in regime_lines(off)[0]
    half = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=30.5))["regime"]
    assert half["hours_at_most"] == pytest.approx(30.5) and half["usd_at_most"] == pytest.approx(976)
    few = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=0.1))  # d12, 2.9 passes
    assert not few["regime"]["data_limited"] and few["regime"]["usd_at_most"] is None
    assert few["regime"]["settings"] == {"ATTN_DROPOUT": 0.0, "AVERAGE": "none"}
    assert "at most 4: the trainer's defaults are ATTN_DROPOUT=0, AVERAGE=none" in regime_lines(few)[0]


def test_a_sweeps_members_are_the_pick_and_the_depths_beside_it_wherever_the_pick_stands(monkeypatch):
    """sweep_plan alone, on a ladder of 5 depths with made-up speeds: for a pick at each place on the
    ladder, the members' depths are the pick, the one below and the one above, where they exist."""
    from types import SimpleNamespace

    from experiment import plan as planmod

    monkeypatch.setattr(planmod, "model_config", lambda d, cfg, vocab: d)
    monkeypatch.setattr(planmod, "tok_per_s", lambda d, gpus, n: (1e6 / d, 0.5))
    ladder = [4, 8, 12, 16, 20]
    table = [{"gpus": n, "fits": True, "hours": 10.0 / n, "usd": 40.0} for n in range(1, 5)]
    for i, pick in enumerate(ladder):
        p = {"budget_hours": 20.0, "gpu_table": table, "depth": pick, "train_tokens": 10**9}
        sw = planmod.sweep_plan(p, PlanConfig(), SimpleNamespace(count=4), ladder, 128)
        want = [pick] + ladder[max(i - 1, 0):i] + ladder[i + 1:i + 2]
        assert list(sw["passes"]) == want, (pick, sw["passes"])
        assert sw["members"][:len(want)] == [f"DEPTH={d}" for d in want] and len(sw["members"]) == 4
        assert sw["passes"][pick] == pytest.approx(1e6 / pick * 20 * 0.99 * 3600 / 10**9)
    # one GPU trains the pick in exactly the members' hours (the box's, less 1% kept for scoring them):
    # still a sweep; a little longer: none
    p = {"budget_hours": 10.0 / 0.99, "gpu_table": table, "depth": 12, "train_tokens": 10**9}
    assert planmod.sweep_plan(p, PlanConfig(), SimpleNamespace(count=4), ladder, 128)["member_hours"] == pytest.approx(10.0)
    p["budget_hours"] = 9.99 / 0.99
    assert planmod.sweep_plan(p, PlanConfig(), SimpleNamespace(count=4), ladder, 128) is None


def test_a_sweep_members_settings_by_variant_and_passes():
    from experiment.plan import _sweep_member, planned_settings

    assert _sweep_member(32, 9.0, 0) == "DEPTH=32"
    assert _sweep_member(32, 9.0, 1) == "DEPTH=32+ATTN_DROPOUT=0.1"
    assert _sweep_member(32, 9.0, 2) == "DEPTH=32+ATTN_DROPOUT=0.3"
    assert _sweep_member(32, 9.0, 3) == "DEPTH=32+ATTN_DROPOUT=0.2+SEED=3"  # the dropouts again, with a seed
    assert _sweep_member(32, 9.0, 4) == "DEPTH=32+ATTN_DROPOUT=0.1+SEED=4"
    assert _sweep_member(32, 4.0, 1) == "DEPTH=32+SEED=1"  # exactly regime.PASSES: not data-limited
    assert _sweep_member(32, 4.01, 1) == "DEPTH=32+ATTN_DROPOUT=0.1"
    # a setting given equal to its default (another float object) is not carried
    assert planned_settings(PlanConfig(gpu_hourly_usd=float("4.0"), val_fraction=float("0.05"))) == {}
    assert planned_settings(PlanConfig(gpu_hourly_usd=3.5)) == {"GPU_HOURLY_USD": 3.5}


@pytest.mark.slow
def test_the_plan_proposes_a_sweep_where_one_gpu_trains_the_pick_within_the_boxs_hours(monkeypatch):
    """The seed user's box with the plain rule's pick (forced here: with the trainer's defaults the plan
    picks d40, whose passes take one GPU 168 h, so it proposes no sweep): one GPU trains d32's 8 passes in
    20.9 h of the 31.25 h $1000 buys on 8, so the plan proposes 8 members, one per GPU for the box's
    whole hours: d32 and the depths beside it, each with the recipe, then with the other attention
    dropouts; the single DDP run's price beside. REGULARIZERS=off: other seeds instead of dropouts."""
    from experiment import autosize, sweep

    plain = autosize.candidate
    monkeypatch.setattr(autosize, "candidate", lambda *a, regularized=False, **k: plain(*a, **k))
    # REGULARIZERS as the environment hands it over: strings built at run time, not the literals
    off = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=1000,
                          regularizers="".join(["of", "f"])))["sweep"]
    assert off["members"][:4] == ["DEPTH=32", "DEPTH=24", "DEPTH=40", "DEPTH=32+SEED=1"]
    assert off["launch"].endswith("BUDGET_USD=1000 ATTN_DROPOUT=0 AVERAGE=none bash experiment/run.sh")
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=1000, regularizers="".join(["au", "to"])))
    sw, one = p["sweep"], next(r for r in p["gpu_table"] if r["gpus"] == 1)
    assert sw["single_gpu_hours"] == one["hours"] < sw["member_hours"] == pytest.approx(31.25 * 0.99)
    assert sw["box_hours"] == pytest.approx(31.25)
    assert sw["usd"] == pytest.approx(1000) and (sw["ddp_hours"], sw["ddp_usd"]) == (p["gpu_table"][-1]["hours"],
                                                                                  p["gpu_table"][-1]["usd"])
    assert sw["members"][:4] == ["DEPTH=32", "DEPTH=24", "DEPTH=40", "DEPTH=32+ATTN_DROPOUT=0.1"]
    assert len(set(sw["members"])) == 8 and list(sw["passes"]) == [32, 24, 40]
    assert sw["passes"][32] == pytest.approx(one["tok_per_s"] * 31.25 * 0.99 * 3600 / p["train_tokens"])  # d32, one GPU
    members = sweep.parse_members(sw["launch"].split("'")[1])  # the launch line's SWEEP parses as the sweep reads it
    assert len(members) == 8 and sw["launch"].endswith("BUDGET_USD=1000 bash experiment/run.sh")
    text = table_of(p)
    assert "sweep | one GPU trains d32's 8.0 passes in 20.88 h, within the box's 31.25 h" in text and sw["launch"] in text
    # None where it does not fit: one GPU, a budget whose hours one GPU cannot train the pick in, HOURS_AVAILABLE
    assert plan(PlanConfig(tokens=350_000_000, gpus="1xH100-PCIe", budget_usd=1000))["sweep"] is None
    assert plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=100))["sweep"] is None
    assert plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=1000, hours_available=20))["sweep"] is None
    assert "sweep |" not in table_of(plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=100)))
    two = plan(PlanConfig(tokens=350_000_000, gpus="2xH100-PCIe", budget_usd=300))["sweep"]
    assert two["members"] == ["DEPTH=32", "DEPTH=24"] and list(two["passes"]) == [32, 24]
    # The sweep's launch line carries the planned settings, so its members get the hours planned.
    cheap = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=1000, gpu_hourly_usd=2.0,
                            max_seq_len=1024))["sweep"]
    env = dict(w.split("=", 1) for w in shlex.split(cheap["launch"]) if "=" in w)
    assert env["GPU_HOURLY_USD"] == "2.0" and env["MAX_SEQ_LEN"] == "1024" and env["SWEEP"] == " ".join(cheap["members"])
    assert sweep.box_hours(env, 8, True) == pytest.approx(cheap["box_hours"], rel=1e-4)
    assert plan(PlanConfig(tokens=350_000_000, gpus="16xH100-PCIe", budget_usd=2000))["sweep"] is None  # two boxes
    # Members that see their data at most regime.PASSES times get no regularizer: other seeds instead.
    monkeypatch.setattr("experiment.regime.PASSES", 1000)
    seeds = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=1000))["sweep"]["members"]
    assert seeds[:4] == ["DEPTH=32", "DEPTH=24", "DEPTH=40", "DEPTH=32+SEED=1"] and "ATTN" not in " ".join(seeds)


@pytest.mark.slow
def test_the_data_is_counted_in_characters_streamed(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("héllo wörld\n" * 4000)  # each source's 5% of val holds one 2049-token window
    (data / "sub" / "b.txt").write_text("日本語\n" * 11000)
    assert count_tokens(PlanConfig(data_dir=str(data)))[0] == 1 + 12 * 4000 + 1 + 4 * 11000  # a BOS before each file
    # through run.sh, a relative DATA_DIR is relative to where the user stands
    proc = run_plan("--json", env={"DATA_DIR": "data", "GPUS": "8xH100-PCIe"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == 92002


@pytest.mark.slow
def test_the_plan_refuses_data_the_preflight_would_refuse(tmp_path):
    """Each source must give val one context window (2048 + 1 tokens at 5%: about 41k characters); empty,
    binary and invalid UTF-8 files are named, as the rented box's pre-flight would name them."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "small").mkdir()
    (data / "big.txt").write_text("x" * 60_000)
    (data / "small" / "s.txt").write_text("y" * 30_000)
    proc = run_plan(env={"DATA_DIR": str(data), "GPUS": "8xH100-PCIe"})
    assert proc.returncode == 2 and "source small gives 1,500 tokens to val" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    small = data / "small" / "s.txt"
    small.write_bytes(b"ok\n\xff\xfe")
    proc = run_plan(env={"DATA_DIR": str(data), "GPUS": "8xH100-PCIe"})
    assert proc.returncode == 2 and f"{small}: invalid UTF-8 at byte offset 3" in proc.stderr
    small.write_text("")
    assert f"{small}: file is empty" in run_plan(env={"DATA_DIR": str(data)}).stderr


def test_the_plan_refuses_a_character_outside_alphabet_as_the_preflight_would(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("ab\n" * 30_000 + "abz\n")
    assert count_tokens(PlanConfig(data_dir=str(data), alphabet="abz\n"))[0] == 1 + 90_004
    with pytest.raises(DataError, match=r"a\.txt:30001:3: character 'z' \(U\+007A\) is not in --alphabet"):
        count_tokens(PlanConfig(data_dir=str(data), alphabet="ab\n"))


@pytest.mark.slow
def test_hours_available_picks_the_fewest_gpus_and_the_launch_line_is_one_the_preflight_accepts(tmp_path, corpus):
    env = {"TOKENS": "350000000", "GPUS": "8xH100-PCIe", "TRAINING_HOURS": "31"}
    # The plain rule's d32 (REGULARIZERS=off), which fits on any count; the launch line pins the regularizers off
    off = "ATTN_DROPOUT=0 AVERAGE=none"
    for hours, gpus in ((24, 1), (15, 2), (8, 4), (4, 8)):
        p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, hours_available=hours,
                            regularizers="off"))
        rows = {r["gpus"]: r for r in p["gpu_table"]}
        assert p["recommended_gpus"] == gpus and rows[gpus]["hours"] <= hours, (hours, rows)
        assert all(rows[n]["hours"] > hours for n in rows if n < gpus)
        # One GPU count from the recommendation to the launch line: the line names the count (a box
        # with more GPUs must not run on all of them) and a budget in dollars, which means the same
        # money on any count; the same $992 on fewer GPUs buys more hours, capped at the hours available.
        budget = min(hours, 992 / (4 * gpus)) * 4 * gpus
        assert p["launch"] == f"NPROC_PER_NODE={gpus} DEPTH=32 BUDGET_USD={budget:g} {off} bash experiment/run.sh"
        assert (p["hours"], p["usd"]) == pytest.approx((rows[gpus]["hours"], rows[gpus]["usd"]))
        assert p["launch_usd"] == pytest.approx(budget) and p["unspent_usd"] == pytest.approx(budget - p["usd"])
        assert f"recommendation | DEPTH=32 on {gpus} GPU(s) for {p['hours']:.2f} h" in table_of(p)
    # none finishes within the hour available: the GPUs asked for, for that hour, never more than the line spends
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, hours_available=1, regularizers="off"))
    assert p["recommended_gpus"] == 8 and p["launch"] == f"NPROC_PER_NODE=8 DEPTH=32 BUDGET_USD=32 {off} bash experiment/run.sh"
    assert p["hours"] == 1 and p["usd"] == p["launch_usd"] == 32 and p["unspent_usd"] == 0
    # more than one box: nodes of 8, the count of each, and cents, never rounded up
    p = plan(PlanConfig(tokens=350_000_000, gpus="16xH100-PCIe", budget_usd=1234.567))
    assert p["launch"].startswith("NNODES=2 NPROC_PER_NODE=8 DEPTH=") and "BUDGET_USD=1234.56 " in p["launch"]
    with pytest.raises(ValueError, match="more than 8 GPUs come as nodes of 8"):
        plan(PlanConfig(tokens=350_000_000, gpus="12xH100-PCIe"))
    quoted = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", alphabet="ab c$'", max_seq_len=1024))
    assert "ALPHABET='ab c$'\"'\"'' MAX_SEQ_LEN=1024 bash experiment/run.sh" in quoted["launch"]  # pasteable
    table = run_plan(env={**env, "HOURS_AVAILABLE": "24", "REGULARIZERS": "off"}).stdout
    assert "gpus | rent 1: the fewest that finish within HOURS_AVAILABLE=24 and the budget" in table
    assert ("launch | on the rented box, with the data in $WORKSPACE/data: NPROC_PER_NODE=1 DEPTH=32 BUDGET_USD=96 "
            f"{off} bash") in table
    assert "launch | it writes $WORKSPACE/checkpoints/d32" in table
    # On a small corpus (64-token context), the plan's launch line passes the pre-flight's guards on
    # the GPUs it recommends, and DEPTH=auto there picks the plan's depth (both with the regularizers
    # off: run_preflight pins them so, as the launch line does)
    p = plan(PlanConfig(data_dir=str(corpus), gpus="8xH100-PCIe", max_seq_len=64, hours_available=1,
                        regularizers="off"))
    settings = dict(kv.split("=") for kv in p["launch"].split(" bash")[0].split())
    assert settings["NPROC_PER_NODE"] == str(p["recommended_gpus"])
    accepted, lines = run_preflight(tmp_path, "--data_dir", corpus, "--depth", settings["DEPTH"],
                                    "--budget_usd", settings["BUDGET_USD"], world_size=p["recommended_gpus"])
    assert isinstance(accepted, dict) and p["recommended_gpus"] == 1, (accepted, p["gpu_table"])
    auto, lines = run_preflight(tmp_path, "--data_dir", corpus, "--budget_usd", settings["BUDGET_USD"],
                                world_size=p["recommended_gpus"])
    assert f"model d{p['depth']} (DEPTH=auto" in "\n".join(lines)


@pytest.mark.slow
def test_bad_gpus_exit_2_naming_the_setting():
    proc = run_plan(env={"TOKENS": "1000", "GPUS": "8xTPU"})
    assert proc.returncode == 2 and "GPUS '8xTPU'" in proc.stderr
    assert parse_gpus("4xH200").memory_bytes == 141 * 2**30


@pytest.mark.slow
def test_a_gpucheck_report_from_the_box_replaces_the_mfu_table(tmp_path):
    """The speed gpucheck measured on the box itself (its report.json) is what the plan predicts from,
    and the plan says so; a report of another GPU kind, or without MFU (no CUDA), is refused naming it."""
    report = tmp_path / "report.json"
    speed = {"d12": {"mfu": 0.30, "tok_per_s": 1.0}, "d24": {"mfu": 0.40, "tok_per_s": 1.0}}
    report.write_text(json.dumps({"header": "#", "items": [
        {"name": "env", "figures": {"gpu": "NVIDIA H100 PCIe", "gpus": 8}},
        {"name": "link", "figures": {"device": "cuda", "world": 8, "link_mb": 256, "link_gbps": 12.5}},
        {"name": "speed", "figures": speed}]}))
    base = dict(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31)
    table, measured = plan(PlanConfig(**base)), plan(PlanConfig(**base, gpucheck=str(report)))
    by_table, by_box = ({r["depth"]: r for r in p["rungs"]} for p in (table, measured))
    config = model_config(24, PlanConfig(), 256)
    assert by_box[24]["tok_per_s"] == pytest.approx(autosize.predicted_tok_per_s(  # the all-reduce measured too
        config, 756e12, 8, 12.5, 4, gpu_name="H100 PCIe", mfu_by_depth={12: 0.30, 24: 0.40}))
    assert measured["link_gbps"] == 12.5 and "at 12.5 GB/s between GPUs (MEASURED by gpucheck over 8 GPUs)" in \
        table_of(measured)
    assert plan(PlanConfig(**base, gpucheck=str(report), link_gbps=30))["link_source"] == "LINK_GBPS"  # set wins
    assert by_box[24]["tok_per_s"] < by_table[24]["tok_per_s"]  # 40% measured against the table's 52.8%
    assert measured["mfu_by_depth"] == {12: 0.30, 24: 0.40} and measured["mfu_measured_on"] == "NVIDIA H100 PCIe"
    assert "MFU measured on NVIDIA H100 PCIe (gpucheck " in table_of(measured)
    assert "the MFU MEASURED on this box" in table_of(measured) and "MEASURED on this box" not in table_of(table)
    with pytest.raises(ValueError, match="measured on NVIDIA H100 PCIe, but GPUS is 8xH200"):
        plan(PlanConfig(**{**base, "gpus": "8xH200"}, gpucheck=str(report)))
    sxm = tmp_path / "sxm.json"  # an H100 SXM's peak is an H200's: the kind tells them apart
    sxm.write_text(report.read_text().replace("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"))
    assert plan(PlanConfig(**{**base, "gpus": "8xH100-SXM"}, gpucheck=str(sxm)))["mfu_from_box"]
    with pytest.raises(ValueError, match="measured on NVIDIA H100 80GB HBM3, but GPUS is 8xH200"):
        plan(PlanConfig(**{**base, "gpus": "8xH200"}, gpucheck=str(sxm)))
    # gpucheck on a CPU: no GPU in env (its speed item has a CPU MFU), or a GPU of unknown peak: no MFU
    report.write_text(json.dumps({"items": [{"name": "env", "figures": {"torch": "2.13"}},
                                            {"name": "speed", "figures": speed}]}))
    proc = run_plan(env={"TOKENS": "350000000", "GPUS": "8xH100-PCIe", "GPUCHECK": str(report)})
    assert proc.returncode == 2 and f"GPUCHECK {report}: it ran without CUDA" in proc.stderr
    for item in speed.values():
        item["mfu"] = None
    report.write_text(json.dumps({"items": [{"name": "env", "figures": {"gpu": "x"}}, {"name": "speed", "figures": speed}]}))
    proc = run_plan(env={"TOKENS": "350000000", "GPUS": "8xH100-PCIe", "GPUCHECK": str(report)})
    assert proc.returncode == 2 and f"GPUCHECK {report}: its speed item has no MFU" in proc.stderr
    (tmp_path / "bad.json").write_text("{}")
    assert "not a gpucheck report.json" in run_plan(env={"TOKENS": "1000", "GPUCHECK": str(tmp_path / "bad.json")}).stderr


@pytest.mark.slow
def test_each_depth_says_what_serving_it_needs():
    """bf16 weights plus one request's KV cache (d32: 2 x 32 layers x 16 heads x 2048 x 128 x 2 bytes
    = 0.537 GB a request), and one request's decode speed on CPU: measured at d12 and d20, elsewhere
    scaled from the nearest by the weights a step multiplies."""
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe"))
    rungs = {r["depth"]: r for r in p["rungs"]}
    d32, d12, d20 = rungs[32], rungs[12], rungs[20]
    assert d32["kv_slot_gb"] == 2 * 32 * 16 * 2048 * 128 * 2 / 1e9
    assert d32["serve_gb"] == pytest.approx(2 * d32["params"] / 1e9 + d32["kv_slot_gb"])
    assert d12["cpu_measured"] and d20["cpu_measured"] and not d32["cpu_measured"]
    assert servemem.decode_weights(model_config(12, PlanConfig(), 128), 128) == 12 * 12 * 768**2 + 128 * 768
    assert d12["serve_gb"] == (2 * d12["params"] + 2 * 12 * 6 * 2048 * 128 * 2) / 1e9
    assert d12["cpu_chars_per_s"] == pytest.approx(servemem.CPU_DECODE_TOK_S[12] * servemem.decode_weights(
        model_config(12, PlanConfig(), 128), 128) / servemem.decode_weights(model_config(12, PlanConfig(), 256), 256))
    ratio = servemem.decode_weights(model_config(20, PlanConfig(), 128), 128) / servemem.decode_weights(
        model_config(32, PlanConfig(), 256), 256)
    assert d32["cpu_chars_per_s"] == pytest.approx(servemem.CPU_DECODE_TOK_S[20] * ratio)  # from d20, the nearest
    assert d32["cpu_chars_per_s"] < d20["cpu_chars_per_s"] < d12["cpu_chars_per_s"]
    tiktoken = {r["depth"]: r for r in plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe",
                                                       tokenizer="gpt2"))["rungs"]}
    assert tiktoken[20]["cpu_chars_per_s"] == pytest.approx(4 * servemem.CPU_DECODE_TOK_S[20] * servemem.decode_weights(
        model_config(20, PlanConfig(), 128), 128) / servemem.decode_weights(model_config(20, PlanConfig(), 100352), 100352))
    table = table_of(p)
    assert "serve GB  CPU ch/s" in table and "MEASURED at d12 and d20" in table
    assert "      3.8      2.8*" in next(line for line in table.splitlines() if line.strip().startswith("d32 "))
    assert "      0.2     34.4 " in next(line for line in table.splitlines() if line.strip().startswith("d12 "))


@pytest.mark.slow
def test_the_plan_counts_what_finished_generations_keep_on_disk():
    """GENERATIONS=auto on the launch line: each finished generation keeps its best weights (in the
    precision the memory plan picks: fp32 for d40 on 8 x 80 GB) and best.pt in bf16; at most 8 run."""
    p = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=950))
    row = next(r for r in p["rungs"] if r["depth"] == p["depth"])
    assert "GENERATIONS=auto" in p["launch"] and row["generation_gb"] == pytest.approx(row["params"] * 6 / 1e9)
    text = table_of(p)
    assert (f"each finished generation keeps its best weights and best.pt, {row['generation_gb']:,.1f} GB in all, beside the "
            f"disk GB column: up to {7 * row['generation_gb']:,.0f} GB more if all 8 run") in text
    off = plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", budget_usd=950, regularizers="off"))  # no recipe
    assert "GENERATIONS=auto" not in off["launch"] and "GENERATIONS=auto on disk" not in table_of(off)
