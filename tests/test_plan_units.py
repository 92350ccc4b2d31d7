"""plan.py's parts, one condition at a time, without a whole plan (tests/test_plan.py runs it whole)."""

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from experiment import autosize, plan, regime
from experiment.plan import PlanConfig


def test_gpu_kinds_by_name_most_specific_first():
    assert plan.gpu_kind("NVIDIA H200") == ("H200", 141) and plan.gpu_kind("nvidia h100 pcie") == ("H100", 80)
    assert plan.gpu_kind("A100-SXM4-80GB") == ("A100", 80) and plan.gpu_kind("RTX 4090") is None


def test_the_link_a_gpucheck_report_timed_is_taken_only_from_cuda():
    link = {"figures": {"device": "cuda", "link_gbps": 12.5, "world": 8}}
    assert plan.gpucheck_link({"link": link}) == (12.5, 8)
    assert plan.gpucheck_link({"link": {"figures": {**link["figures"], "device": "cpu"}}}) is None
    assert plan.gpucheck_link({"link": {"figures": {**link["figures"], "link_gbps": 0}}}) is None
    assert plan.gpucheck_link({}) is None and plan.gpucheck_link({"link": {"figures": None}}) is None


def test_gpus_parse_count_and_name_and_refuse_what_cannot_be_planned():
    g = plan.parse_gpus("8xH100-PCIe")
    assert (g.count, g.name, g.memory_bytes, g.link_gbps) == (8, "H100 PCIe", 80 * 2**30, 20.0)
    assert plan.parse_gpus("1xH200").count == 1 and plan.parse_gpus("16xH100-SXM").count == 16
    assert plan.parse_gpus("8xH100").peak == plan.parse_gpus("8xH100-SXM").peak  # a bare H100 is the SXM's peak
    for bad in ("0xH100", "H100", "8H100", "ax H100", "8xTPU", "-1xH100"):
        with pytest.raises(ValueError, match="expected COUNTxNAME"):
            plan.parse_gpus(bad)
    with pytest.raises(ValueError, match="plan a multiple of 8"):
        plan.parse_gpus("12xH100")
    assert plan.parse_gpus("8xH100").count == 8  # 8 is one node: no multiple needed


def test_the_launch_budget_buys_more_hours_on_fewer_gpus_up_to_the_hours_available():
    p = {"budget_usd": 992.0}
    assert plan.launch_budget(p, PlanConfig(), 8) == (31.0, 992.0)
    assert plan.launch_budget(p, PlanConfig(), 2) == (124.0, 992.0)
    assert plan.launch_budget(p, PlanConfig(hours_available=24), 2) == (24.0, 192.0)
    assert plan.launch_budget(p, PlanConfig(gpu_hourly_usd=2.0), 8) == (62.0, 992.0)


def test_a_launch_line_carries_nodes_the_depth_the_dollars_and_every_setting_not_the_default():
    p = {"budget_usd": 992.0, "depth": 24, "regime": {"regularized": False}}
    assert plan.launch_line(p, PlanConfig(), 8) == ("NPROC_PER_NODE=8 DEPTH=24 BUDGET_USD=992 bash experiment/run.sh",
                                                    "$WORKSPACE/checkpoints/d24")
    # data-limited and regularized: what one model leaves unspent buys more (GENERATIONS=auto)
    limited = {**p, "regime": {"regularized": True}}
    assert plan.launch_line(limited, PlanConfig(), 8)[0] == ("NPROC_PER_NODE=8 DEPTH=24 BUDGET_USD=992 GENERATIONS=auto "
                                                             "bash experiment/run.sh")
    # unless a generation and its teacher do not fit the GPUs' memory together
    assert "GENERATIONS" not in plan.launch_line({**limited, "teacher_fits": False}, PlanConfig(), 8)[0]
    line, _ = plan.launch_line(p, PlanConfig(), 16)
    assert line.startswith("NNODES=2 NPROC_PER_NODE=8 DEPTH=24 BUDGET_USD=992 ")
    line, _ = plan.launch_line(p, PlanConfig(), 1)
    assert line.startswith("NPROC_PER_NODE=1 DEPTH=24 BUDGET_USD=992 ")
    cfg = PlanConfig(tokenizer="gpt2", alphabet="ab c", val_fraction=0.1, gpu_hourly_usd=3.0, keep_last=2,
                     max_seq_len=1024, text_field="body")
    assert plan.planned_settings(cfg) == {"TOKENIZER": "gpt2", "ALPHABET": "ab c", "VAL_FRACTION": 0.1,
                                          "TEXT_FIELD": "body", "GPU_HOURLY_USD": 3.0, "KEEP_LAST": 2,
                                          "MAX_SEQ_LEN": 1024}
    assert plan.planned_settings(PlanConfig()) == {}
    assert "ALPHABET='ab c'" in plan.launch_line(p, cfg, 8)[0]  # quoted for the shell


def test_dollars_are_cents_never_above_and_at_least_one():
    assert [plan._cents(x) for x in (992.0, 991.999, 12.5, 12.345, 0.001, 0.0)] == ["992", "991.99", "12.5", "12.34",
                                                                                   "0.01", "0.01"]


def test_parameter_counts_read_in_millions_or_billions():
    assert [plan._count(n) for n in (999_999_999, 10**9, 1_610_000_000, 520_000)] == ["1000.0M", "1.00B", "1.61B",
                                                                                       "0.5M"]


def test_the_recommendation_is_priced_on_the_launch_lines_gpus_and_budget():
    rows = [{"gpus": 1, "hours": 20.0}, {"gpus": 8, "hours": 3.0}]
    p = {"recommended_gpus": 8, "gpu_count": 8, "hours": 3.5, "budget_usd": 992.0}
    plan.recommend_on(p, PlanConfig(), rows)  # the GPUs asked for: the table's own hours stay
    assert (p["hours"], p["usd"], p["launch_hours"], p["launch_usd"], p["unspent_usd"]) == (3.5, 112.0, 31.0, 992.0, 880.0)
    p = {"recommended_gpus": 1, "gpu_count": 8, "hours": 3.5, "budget_usd": 992.0}
    plan.recommend_on(p, PlanConfig(hours_available=24), rows)  # one GPU finishes in 24 h: its row's hours
    assert (p["hours"], p["usd"], p["launch_hours"], p["launch_usd"], p["unspent_usd"]) == (20.0, 80.0, 24.0, 96.0, 16.0)
    p = {"recommended_gpus": 1, "gpu_count": 8, "hours": 3.5, "budget_usd": 992.0}
    plan.recommend_on(p, PlanConfig(hours_available=10), rows)  # none finishes: the launch line's hours end it
    assert (p["hours"], p["usd"], p["unspent_usd"]) == (10.0, 40.0, 0.0)


def test_the_regime_is_the_launch_lines_passes_past_or_within_the_regimes():
    rows = [{"gpus": 8, "fits": True, "tok_per_s": 1000.0}, {"gpus": 1, "fits": False, "tok_per_s": None}]
    train = 3600 * 1000  # one hour at 1000 tok/s is one pass
    p = {"recommended_gpus": 8, "budget_usd": 32.0 * (regime.PASSES + 1), "train_tokens": train}
    r = plan.regime_plan(p, PlanConfig(), rows, 5.0)
    assert r["budget_passes"] == regime.PASSES + 1 and r["data_limited"] and r["gpus"] == 8
    assert r["settings"] == {k.upper(): v for k, v in regime.RECIPE.items()}
    assert (r["hours_at_most"], r["usd_at_most"]) == (regime.PASSES + 1, 32.0 * (regime.PASSES + 1))
    p["budget_usd"] = 32.0 * regime.PASSES  # exactly PASSES: not past them
    r = plan.regime_plan(p, PlanConfig(), rows, 5.0)
    assert r["budget_passes"] == regime.PASSES and not r["data_limited"]
    assert r["settings"] == {k.upper(): v for k, v in regime.OFF.items()} and r["hours_at_most"] is None
    p["recommended_gpus"] = 1  # the row does not fit: the rate given
    assert plan.regime_plan(p, PlanConfig(), rows, 5.0)["budget_passes"] == pytest.approx(5.0 * 32 * regime.PASSES
                                                                                        * 3600 / 4 / train)


def test_the_gpu_rows_price_each_count_and_mark_budget_and_time(monkeypatch):
    rates = {1: (100.0, 0.0), 2: (190.0, 0.05), 4: None, 8: (700.0, 0.2), 16: (1200.0, 0.4)}
    monkeypatch.setattr(plan, "tok_per_s", lambda config, gpus, count: rates[count])
    gpus = SimpleNamespace(count=16)
    rows = plan.gpu_rows(PlanConfig(hours_available=1.1), gpus, None, 720_000, budget_usd=8.0)  # one GPU's $8 exactly
    assert [r["gpus"] for r in rows] == [1, 2, 4, 8, 16]
    one, two, four, eight, sixteen = rows
    assert (one["hours"], one["usd"], one["in_budget"], one["in_time"]) == (2.0, 8.0, True, False)
    assert two["hours"] == pytest.approx(720_000 / 190 / 3600) and two["in_time"]  # 1.05 h
    assert two["comm_share"] == pytest.approx(0.05 * 190 / 524288)
    assert not four["fits"] and four["hours"] is four["usd"] is four["comm_share"] is None
    assert not four["in_budget"] and not four["in_time"]
    assert not eight["in_budget"] and eight["in_time"]
    assert plan.gpu_rows(PlanConfig(), gpus, None, 720_000, 8.0)[0]["in_time"]  # no HOURS_AVAILABLE: all in time
    assert two["usd"] == pytest.approx(720_000 / 190 / 3600 * 2 * 4.0)  # 1.05 h on 2 GPUs at $4: $8.42
    assert plan.gpu_rows(PlanConfig(), gpus, None, 720_000, 8.5)[1]["in_budget"]
    assert plan.gpu_rows(PlanConfig(hours_available=2.0), gpus, None, 720_000, 8.0)[0]["in_time"]  # 2 h: just in time
    # $8 against a budget a rounding error below it is in the budget; against $7.60 it is not
    assert plan.gpu_rows(PlanConfig(), gpus, None, 720_000, 8.0 / (1 + 5e-10))[0]["in_budget"]
    assert not plan.gpu_rows(PlanConfig(), gpus, None, 720_000, 7.6)[0]["in_budget"]


def test_env_overrides_come_before_the_command_lines_own_flags(monkeypatch):
    monkeypatch.setenv("TOKENS", "1000")
    monkeypatch.setenv("GPUS", "")
    assert plan.env_overrides(["--json", "--gpus=1xH200"]) == ["--tokens=1000", "--json=1", "--gpus=1xH200"]
    monkeypatch.delenv("TOKENS")
    assert plan.env_overrides([]) == []


def test_the_table_marks_depths_outside_the_measured_mfu_and_those_that_do_not_fit():
    p = plan.plan(PlanConfig(tokens=350_000_000, gpus="1xH100-PCIe", training_hours=31))
    text = plan.table(p)
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[0][:1] == "d" and
            line.split()[0][1:].isdigit()}
    assert "*" not in rows["d12"].split()[2] and "*" not in rows["d24"].split()[2]  # measured: d12-d24
    assert rows["d10"].split()[2].endswith("*") and rows["d32"].split()[2].endswith("*")
    fits = {r["depth"]: r["fits"] for r in p["rungs"]}
    assert not all(fits.values())  # one 80 GB GPU: the largest do not fit
    for depth, ok in fits.items():
        assert rows[f"d{depth}"].endswith("does not fit in memory") != ok
    assert math.isfinite(p["hours"])
    assert autosize.MEASURED_MFU["H100"][0] == p["mfu_by_depth"]


def _p(rows, hours_available=None, recommended=8):
    return {"depth": 12, "max_passes": 8.0, "gpu_table": rows, "hours_available": hours_available,
            "recommended_gpus": recommended, "launch": "L", "run_dir": "R"}


def _row(gpus, usd, fits=True, in_budget=True, in_time=True):
    return {"gpus": gpus, "fits": fits, "tok_per_s": 1000.0 * gpus if fits else None, "hours": usd / gpus / 4,
            "usd": usd if fits else None, "comm_share": 0.1, "in_budget": fits and in_budget, "in_time": fits and in_time}


def test_the_gpu_lines_mark_each_row_and_name_the_cheapest_or_the_fewest_in_time():
    rows = [_row(1, 84.0, in_time=False), _row(2, 80.0, in_budget=False), _row(4, 0, fits=False), _row(8, 122.0)]
    lines = plan.gpu_lines(_p(rows))
    assert lines[2].endswith("  past HOURS_AVAILABLE") and "over the budget" not in lines[2]
    assert lines[3].endswith("  over the budget") and "HOURS_AVAILABLE" not in lines[3]
    assert lines[4].endswith("does not fit in memory") and lines[5].endswith("10%")  # in budget and in time: no mark
    assert lines[6].startswith("gpus | the cheapest: 2 GPU(s), $80 in 10.00 h;")
    assert lines[-3:-1] == ["launch | on the rented box, with the data in $WORKSPACE/data: L",
                            "launch | it writes R (WORKSPACE: /workspace/<repo> where /workspace is writable, else the "
                            "repository)"]
    assert lines[-1].startswith("launch | to stop paying when it ends, add ON_EXIT=")  # a run ending at night
    assert not any(x.startswith("gpus | the cheapest") for x in plan.gpu_lines(_p([_row(1, 1.0, fits=False)])))
    timed = plan.gpu_lines(_p(rows, hours_available=24, recommended=8))
    assert timed[6] == "gpus | rent 8: the fewest that finish within HOURS_AVAILABLE=24 and the budget"
    late = plan.gpu_lines(_p(rows[:3], hours_available=24, recommended=1))
    assert late[5].startswith("gpus | none finishes within HOURS_AVAILABLE=24 and the budget: the launch line is for 1")


def test_the_regime_lines_say_whether_the_run_is_data_limited():
    p = {"depth": 12, "regime": {"budget_passes": 9.0, "gpus": 8, "data_limited": True,
                                 "settings": {"ATTN_DROPOUT": 0.2, "AVERAGE": "ema", "MAX_EPOCHS": 0.0},
                                 "hours_at_most": 31.0, "usd_at_most": 992.0}}
    p |= {"hours": 10.0, "plain": {"depth": 8, "hours": 2.5, "passes": 8.0}}
    limited = plan.regime_lines(p)
    assert len(limited) == 3 and f"more than {regime.PASSES}: data-limited" in limited[0]
    assert limited[0].endswith("at most the whole 31.00 h ($992): it may spend more than the hours above")
    assert limited[1].startswith("recommendation | GENERATIONS=auto: when the stop at the val minimum ends d12")
    capped = {**p, "regime": {**p["regime"], "settings": {**p["regime"]["settings"], "MAX_EPOCHS": 32.0}}}
    assert plan.regime_lines(capped)[1].startswith("recommendation | GENERATIONS=auto: when the stop at the val minimum "
                                                   "(or its 32 passes, MAX_EPOCHS=32) ends d12")
    assert limited[2].startswith("recommendation | d12 and what its passes buy are EXTRAPOLATED")
    assert limited[2].endswith("the plain rule trains d8 for 8.0 passes, 2.50 h on these GPUs, and leaves the rest unspent")
    no_room = plan.regime_lines({**p, "teacher_fits": False})
    assert len(no_room) == 3 and no_room[1].startswith("recommendation | no GENERATIONS: a generation after the first "
                                                       "holds d12 and its teacher")
    p["hours"] = 31.0  # the regularized rule's pick: the whole budget
    assert plan.regime_lines(p)[0].endswith("it trains the whole 31.00 h ($992) unless the stop at the val minimum "
                                            "ends it first")
    p["hours"] = 31.0 * (1 - 1e-12)  # the same hours after a float's rounding: still the whole budget
    assert "it trains the whole 31.00 h" in plan.regime_lines(p)[0]
    for hours_at_most in (30.5, 31.0):  # a pick 0.3 h short of the launch line's hours does not train them all
        p |= {"hours": hours_at_most - 0.3, "regime": {**p["regime"], "hours_at_most": hours_at_most}}
        assert plan.regime_lines(p)[0].endswith(f"at most the whole {hours_at_most:.2f} h ($992): it may spend "
                                                "more than the hours above")
    p |= {"hours": 31.0, "regime": {**p["regime"], "hours_at_most": 31.0}}
    off = {**p, "regime": {**p["regime"], "regularized": False, "settings": {"ATTN_DROPOUT": 0.0, "AVERAGE": "none"}}}
    assert plan.regime_lines(off) == [
        "recommendation | regime: the launch line's budget makes 9.0 passes at d12 on 8 GPU(s), more than 4: "
        "data-limited, but REGULARIZERS=off: the launch line pins ATTN_DROPOUT=0, AVERAGE=none, so the run stops at "
        "the pass cap or its val minimum"]
    p["regime"] = {**p["regime"], "data_limited": False, "settings": {"ATTN_DROPOUT": 0.0, "AVERAGE": "none"}}
    (plain,) = plan.regime_lines(p)
    assert plain.endswith(f"at most {regime.PASSES}: the trainer's defaults are ATTN_DROPOUT=0, AVERAGE=none "
                          "(no regularizer)")


@pytest.mark.slow
def test_main_prints_the_table_or_json_and_exits_2_on_bad_settings(capsys):
    assert plan.main(["--tokens", "350000000", "--json"]) == 0
    # the regularized rule (the trainer's defaults), sized for GENERATIONS=auto's chain: one model would be d56
    assert json.loads(capsys.readouterr().out)["depth"] == 40
    assert plan.main(["--tokens", "350000000", "--json", "--regularizers", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["depth"] == 32
    assert plan.main(["--tokens", "350000000", "--regularizers", "some"]) == 2
    assert "REGULARIZERS must be auto or off, got 'some'" in capsys.readouterr().err
    assert plan.main(["--tokens", "350000000", "--gpus", "8xTPU"]) == 2
    assert capsys.readouterr().err.startswith("error: GPUS '8xTPU'")
    assert plan.main(["--tokens", "1000000", "--hours_available", "0"]) == 2
    assert "HOURS_AVAILABLE must be > 0, got 0" in capsys.readouterr().err


def test_a_rungs_row_is_each_figure_by_its_definition():
    from experiment.guards import EXTRA_CHECKPOINTS
    from experiment.memory import checkpoint_bytes

    cfg = PlanConfig(tokens=100_000_000, disk_write_gbps=0.4)  # KEEP_LAST 3
    gpus = plan.parse_gpus("8xH100-PCIe")
    train = 90_000_000
    row, c = plan.rung(12, cfg, gpus, train, 3600.0, plan.VOCAB_CHAR)
    config = plan.model_config(12, cfg, plan.VOCAB_CHAR)
    ckpt = checkpoint_bytes(config, 8, gpus.memory_bytes, average=True)  # AVERAGE=auto: as the disk guard counts it
    assert row["fits"] and row["tok_per_s"] == c.tok_per_s == plan.tok_per_s(config, gpus, 8)[0]
    assert row["hours_per_pass"] == pytest.approx(train / c.tok_per_s / 3600, rel=1e-12)
    assert 0 < c.seconds <= 3600 and row["useful_hours"] == pytest.approx(c.seconds / 3600, rel=1e-12)
    assert row["checkpoint_gb"] == pytest.approx(ckpt / 1e9, rel=1e-12)
    assert row["disk_peak_gb"] == pytest.approx((3 + EXTRA_CHECKPOINTS) * ckpt / 1e9, rel=1e-12)
    assert row["save_minutes"] == pytest.approx(ckpt / 0.4e9 / 60, rel=1e-12)
    assert (row["params"], row["tokens"], row["epochs"]) == (c.params, c.tokens, c.epochs)
    off, _ = plan.rung(12, dataclasses.replace(cfg, regularizers="off"), gpus, train, 3600.0, plan.VOCAB_CHAR)
    assert off["checkpoint_gb"] == pytest.approx(checkpoint_bytes(config, 8, gpus.memory_bytes) / 1e9, rel=1e-12)


def test_a_depth_is_priced_in_the_precision_it_fits_at_device_batch_1():
    """d54 on 8 H100s fits in fp32 only with no activations (device batch 0): at batch 1 it is bf16,
    whose weights the all-reduce moves at half the bytes; d52 is fp32 at batch 1, bf16 at batch 2."""
    from experiment.memory import choose_mode

    config, gpus = plan.model_config(54, PlanConfig(), plan.VOCAB_CHAR), plan.parse_gpus("8xH100-PCIe")
    assert choose_mode(config, 8, 1, config.max_seq_len, gpus.memory_bytes).precision == "bf16"
    rate, comm = plan.tok_per_s(config, gpus, 8)
    assert comm == autosize.comm_seconds(config, 8, gpus.link_gbps, autosize.WEIGHT_BYTES["bf16"])
    assert rate == autosize.predicted_tok_per_s(config, gpus.peak, 8, gpus.link_gbps, autosize.WEIGHT_BYTES["bf16"],
                                                gpu_name=gpus.name)
    assert plan.tok_per_s(plan.model_config(64, PlanConfig(), plan.VOCAB_CHAR), plan.parse_gpus("1xH100"), 1) is None
    # d52 fits in fp32 at device batch 1 (in bf16 alone at batch 2)
    config = plan.model_config(52, PlanConfig(), plan.VOCAB_CHAR)
    assert choose_mode(config, 8, 1, config.max_seq_len, gpus.memory_bytes).precision == "fp32"
    assert plan.tok_per_s(config, gpus, 8)[1] == autosize.comm_seconds(config, 8, gpus.link_gbps,
                                                                       autosize.WEIGHT_BYTES["fp32"])


def test_the_bigram_table_is_for_characters_alone_however_the_name_was_made():
    char = "".join(["ch", "ar"])  # as parsed from a command line: equal to the literal, not the same object
    assert plan.model_config(12, PlanConfig(tokenizer=char), 256).bigram_vocab == 256
    assert plan.model_config(12, PlanConfig(tokenizer="gpt2"), 256).bigram_vocab == 0
    assert plan.model_config(12, PlanConfig(tokenizer="cl100k_base"), 256).bigram_vocab == 0


def test_tokens_are_tokens_else_counted_in_data_dir_else_in_the_workspaces_data(tmp_path, monkeypatch):
    assert plan.count_tokens(PlanConfig(tokens=1234)) == (1234, "TOKENS")
    data = tmp_path / "ws" / "data"
    data.mkdir(parents=True)
    (data / "a.txt").write_text("abcd\n" * 10_000)  # 5% of val holds one 2049-token window
    monkeypatch.setattr(plan, "default_workspace", lambda: tmp_path / "ws")
    tokens, counted = plan.count_tokens(PlanConfig())
    assert tokens == 1 + 50_000
    assert counted == f"characters in 1 source(s) of {data}, checked as the pre-flight checks them"
    tokens, counted = plan.count_tokens(PlanConfig(data_dir=str(data), tokenizer="gpt2", max_seq_len=256))
    assert counted.startswith(f"estimated as bytes / 4 in 1 source(s) of {data},")
    assert counted.endswith("(set TOKENS to be exact)")
    with pytest.raises(plan.DataError):
        plan.count_tokens(PlanConfig(data_dir=str(tmp_path / "none")))


def test_the_plans_defaults_are_the_trainers_and_a_setting_equal_to_one_is_not_carried(capsys):
    from experiment.config import TrainConfig

    assert PlanConfig().keep_last == TrainConfig().keep_last  # else a launch line would leave KEEP_LAST out wrongly
    assert plan.planned_settings(PlanConfig(max_seq_len=int("2048"), keep_last=int("3"))) == {}  # read from flags
    assert plan.planned_settings(PlanConfig(max_seq_len=4096)) == {"MAX_SEQ_LEN": 4096}
    assert plan.main(["--tokens", "350000000"]) == 0  # no --json: the table
    assert capsys.readouterr().out.startswith("plan | data: ")


def test_gpus_past_one_node_come_in_nodes_of_8():
    assert plan.parse_gpus("24xH100").count == 24 and plan.parse_gpus("16xH200").count == 16
    for bad in ("12xH100", "20xH100"):
        with pytest.raises(ValueError, match="plan a multiple of 8"):
            plan.parse_gpus(bad)


def _gpucheck_report(tmp_path, gpu):
    """A gpucheck report.json measured on `gpu`: its env item and d12's MFU, 0.3."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"items": [{"name": "env", "figures": {"gpu": gpu}},
                                            {"name": "speed", "figures": {"d12": {"mfu": 0.3}}}]}))
    return report


def test_a_gpucheck_report_of_the_same_kind_at_another_peak_is_refused(tmp_path):
    """An H100 SXM (989 TFLOP/s) measured for H100 PCIe (756): the kind matches, the speed does not."""
    for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"):
        report = _gpucheck_report(tmp_path, gpu)
        for spec in ("8xH100-PCIe", "8xH100-SXM"):
            gpus = plan.parse_gpus(spec)
            if gpu.endswith("PCIe") == spec.endswith("PCIe"):
                assert plan.gpucheck_mfu(str(report), gpus)[0][0] == {12: 0.3}
            else:
                with pytest.raises(ValueError, match=f"measured on {gpu}, but GPUS is 8x"):
                    plan.gpucheck_mfu(str(report), gpus)


def test_the_recommendation_says_the_run_stops_at_the_val_minimum_only_where_it_does():
    p = plan.plan(PlanConfig(tokens=350_000_000))
    assert p["stops_at_val_minimum"]
    line = next(x for x in plan.table(p).splitlines() if x.startswith("recommendation | at most "))
    assert line.endswith("; stops earlier when val stops improving (the warmdown starts at the val minimum: "
                         "docs/training.md)")
    p["stops_at_val_minimum"] = False
    line = next(x for x in plan.table(p).splitlines() if x.startswith("recommendation | at most "))
    assert line == f"recommendation | at most {p['max_passes']:.1f} passes"


@pytest.mark.slow
def test_the_vocabulary_is_the_characters_however_the_tokenizers_name_was_made():
    char = "".join(["ch", "ar"])  # as parsed from a command line
    literal, made, gpt2 = (plan.plan(PlanConfig(tokens=350_000_000, tokenizer=name))["rungs"]
                           for name in ("char", char, "gpt2"))
    assert made == literal  # the parameters, and serving's characters per token too
    assert all(a["params"] < b["params"] for a, b in zip(literal, gpt2))


def test_more_gpus_than_a_run_is_priced_for_are_over_its_budget():
    """One GPU for 10 h ($40): the same tokens on 4 and 8 cost more (their traffic between GPUs); the
    plain rule's pick (REGULARIZERS=off), which fits every count."""
    p = plan.plan(PlanConfig(tokens=350_000_000, gpus="1xH100-PCIe", training_hours=10, regularizers="off"))
    assert p["budget_usd"] == 40.0
    assert [(r["gpus"], r["in_budget"]) for r in p["gpu_table"]] == [(1, True), (2, True), (4, False), (8, False)]


def test_main_reads_the_command_line_and_its_help_opens_with_the_modules_first_line(monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys, "argv", ["plan", "--tokens", "1000000", "--json"])
    assert plan.main() == 0 and json.loads(capsys.readouterr().out)["tokens"] == 1_000_000
    with pytest.raises(SystemExit) as e:
        plan.main(["--help"])
    assert e.value.code == 0
    assert " ".join(capsys.readouterr().out.split()).count(" ".join(plan.__doc__.split("\n")[0].split())) == 1


def test_a_gpucheck_report_of_another_kind_at_the_same_peak_is_refused_either_way(tmp_path):
    """H100 SXM and H200 share a peak (989 TFLOP/s) but not their memory: neither's report plans the other."""
    for gpu, spec in (("NVIDIA H200", "8xH100-SXM"), ("NVIDIA H100 80GB HBM3", "8xH200")):
        report = _gpucheck_report(tmp_path, gpu)
        with pytest.raises(ValueError, match=f"measured on {gpu}, but GPUS is 8x"):
            plan.gpucheck_mfu(str(report), plan.parse_gpus(spec))


def test_a_gpu_whose_memory_is_known_but_not_its_peak_is_refused():
    with pytest.raises(ValueError, match="expected COUNTxNAME with a GPU whose peak is known"):
        plan.parse_gpus("8xH100-NVL")  # an H100 (80 GB) of no listed peak


@pytest.mark.slow
def test_hours_available_recommends_the_fewest_gpus_in_time_and_in_budget():
    p = plan.plan(PlanConfig(tokens=350_000_000, gpus="8xH100-PCIe", training_hours=31, hours_available=10,
                             regularizers="off"))  # the plain rule's d32, which fits every count
    rows = {r["gpus"]: r for r in p["gpu_table"]}
    assert rows[1]["in_budget"] and not rows[1]["in_time"] and rows[4]["in_time"] and not rows[2]["in_time"]
    assert p["recommended_gpus"] == 4 and p["hours"] == rows[4]["hours"]  # priced on the 4 it recommends
    # More GPUs than asked for (2) when only 4 finish in time: priced on those 4 too
    p = plan.plan(PlanConfig(tokens=350_000_000, gpus="2xH100-PCIe", training_hours=31, hours_available=10,
                             regularizers="off"))
    rows = {r["gpus"]: r for r in p["gpu_table"]}
    assert p["recommended_gpus"] == 4 and p["hours"] == rows[4]["hours"] < 10


def test_hours_available_must_be_positive_and_may_be_under_an_hour():
    assert plan.plan(PlanConfig(tokens=350_000_000, hours_available=0.5))["hours"] <= 0.5
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"HOURS_AVAILABLE must be > 0, got {bad}"):
            plan.plan(PlanConfig(tokens=350_000_000, hours_available=bad))
