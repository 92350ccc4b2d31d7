"""The pre-flight on CUDA, decided on this CPU: a CUDA-shaped config and an H100 handed in. Its plan
line, DEPTH=auto decided by prediction, and the guards (demo data, repeated data, disk), each
passed by ALLOW."""

import os
import subprocess

import pytest

from experiment import preflight
from experiment.config import ConfigError, parse_args
from experiment.files import volume
from experiment.guards import Gpu
from experiment.hardware import peak_flops

H100 = Gpu("NVIDIA H100 PCIe", peak_flops("H100 PCIe"), 80 * 2**30)


def run_preflight(ws, *flags, world_size=8, regime=False):
    """The pre-flight for 8 H100s (CUDA defaults but a 64-token context, which the tiny corpus can fill;
    the regime's recipe off unless `regime`: tests/test_regime.py). Returns (plan or the ConfigError,
    the lines it printed)."""
    lines = []
    pinned = [] if regime else ["--attn_dropout", "0", "--average", "none"]
    cfg = parse_args(["--workspace", str(ws), "--max_seq_len", "64", *pinned, *map(str, flags)])
    try:
        return preflight.preflight(cfg, world_size, 0, 1, lines.append, gpu=H100), lines
    except ConfigError as e:
        return e, lines


@pytest.mark.slow
def test_auto_is_predicted_and_stops_at_max_epochs_with_the_budget_left_said(tmp_path, corpus):
    plan, lines = run_preflight(tmp_path, "--data_dir", corpus)
    assert isinstance(plan, dict), plan
    text = "\n".join(lines)
    # 31 h of 8 H100s would pass over a 40k-character corpus many thousand times. 8 passes are under one
    # step of 524,288 tokens, so the cap is the most on small data (16 passes), whose 570,624 tokens give
    # d4 (3.1M params) 0.18 tokens/param, over the floor at 35,664 training tokens (0.14): d4, then stop.
    assert "model d4 (DEPTH=auto, from the predicted tok/s)" in text
    assert "the data supports up to d4 (0.14 token/param over at most 16 epochs)" in text
    line = next(x for x in lines if x.startswith("preflight | plan d4:"))
    assert "PREDICTED on 8 x NVIDIA H100 PCIe" in line and "stops after 16 passes at 0.00h" in line
    assert "of the 31h budget unspent" in line and "disk peak" in line


@pytest.mark.slow
def test_training_on_the_demo_data_is_refused_unless_allowed(tmp_path):
    error, lines = run_preflight(tmp_path)
    assert isinstance(error, ConfigError) and "built-in demo data" in str(error) and "ALLOW=demo" in str(error)
    assert any(x.startswith("preflight | plan d") for x in lines)  # the plan line comes before the error
    plan, _ = run_preflight(tmp_path, "--allow", "demo")
    assert isinstance(plan, dict), plan


def test_an_explicit_depth_that_repeats_the_data_is_refused_unless_capped_or_allowed(tmp_path, corpus):
    # An explicit depth has the default pass cap too: the plan's DEPTH=12 launches as it is. On this
    # 40k-character corpus 8 passes are under one step of 524,288 tokens: the cap is 16 passes.
    plan, lines = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12)
    assert isinstance(plan, dict) and any("stops after 16 passes" in x for x in lines), (plan, lines)
    error, lines = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12, "--max_epochs", 0)
    assert isinstance(error, ConfigError), error
    assert "d12 would see the training data" in str(error) and "past 16" in str(error)
    assert "ALLOW=repeat" in str(error) and "MAX_EPOCHS unset (it then stops at 16)" in str(error)
    assert any("trains the whole 31h budget" in x for x in lines)
    for way_out in (["--max_epochs", 8], ["--allow", "repeat"], ["--training_hours", 0.0000001]):
        plan, _ = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12, "--max_epochs", 0, *way_out)
        assert isinstance(plan, dict), (way_out, plan)


def test_less_free_disk_than_the_checkpoints_need_is_refused_naming_both_numbers(tmp_path, corpus):
    ws = tmp_path / "ws"
    ws.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(ws)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        assert volume(ws / "checkpoints/d24") == (ws, volume(ws)[1]) and volume(ws)[1] <= 4 * 2**20  # measured on the nearest existing parent
        error, _ = run_preflight(ws, "--data_dir", corpus, "--depth", 24, "--max_epochs", 8)
        assert isinstance(error, ConfigError), error
        message = str(error)
        assert "GB free" in message and "below the planned peak" in message and "ALLOW=disk" in message
        assert "3 + 3 checkpoints of" in message
        plan, _ = run_preflight(ws, "--data_dir", corpus, "--depth", 24, "--max_epochs", 8, "--allow", "disk")
        assert isinstance(plan, dict), plan
    finally:
        subprocess.run(["umount", "-l", str(ws)], capture_output=True)


def test_every_failing_guard_is_named_in_one_error(tmp_path):
    error, _ = run_preflight(tmp_path, "--depth", 12, "--max_epochs", 0)
    assert "demo" in str(error) and "would see the training data" in str(error)


def test_an_unknown_guard_is_a_config_error(tmp_path, corpus):
    error, _ = run_preflight(tmp_path, "--data_dir", corpus, "--allow", "demo,disks")
    assert isinstance(error, ConfigError) and "--allow: unknown guard(s) disks" in str(error)


def test_guards_stay_off_on_cpu(tmp_path):
    cfg = parse_args(["--workspace", str(tmp_path), "--depth", "2", "--training_hours", "10", "--device", "cpu"])
    plan = preflight.preflight(cfg, 1, 0, 1, lambda line: None)  # the demo, repeated thousands of times
    assert plan["resume_step"] is None


def test_the_shutdown_timeout_covers_the_predicted_preemption_save(tmp_path, corpus):
    flags = ["--data_dir", corpus, "--depth", 24, "--max_epochs", 8]
    plan, lines = run_preflight(tmp_path, *flags, world_size=1)  # d24 on one GPU: 8.2 GB from one rank
    line = next(x for x in lines if x.startswith("preflight | plan d24"))
    save = float(line.split("a save about ")[1].split(" s at")[0])
    assert 20 < save < 40  # 8.2 GB at 0.3 GB/s
    assert plan["shutdown_timeout"] == 300  # twice that plus a minute is under the floor
    lines = []
    cfg = parse_args(["--workspace", str(tmp_path), "--max_seq_len", "64", *map(str, flags)])
    assert preflight.preflight(cfg, 1, 0, 1, lines.append, gpu=H100, shutdown_given=10)["shutdown_timeout"] == 10
    assert any(x.startswith("warning: a preemption save takes about") and "SHUTDOWN_TIMEOUT=10" in x
               for x in lines)
    big, _ = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 64, "--max_epochs", 8, "--allow", "disk",
                           world_size=1)  # d64 from one rank: far past 300 s
    assert big["shutdown_timeout"] > 300


@pytest.mark.slow
def test_a_gpu_launch_on_the_default_budget_is_warned_of_its_dollars(tmp_path, corpus):
    """CUDA's default budget is a day on the box (31 h): one GPU rented for an afternoon would spend
    it, so a launch without TRAINING_HOURS or BUDGET_USD says what the default costs."""
    plan, lines = run_preflight(tmp_path, "--data_dir", corpus)
    warned = [x for x in lines if x.startswith("warning: neither TRAINING_HOURS nor BUDGET_USD")]
    assert len(warned) == 1 and "the GPU default of 31 h ($992 on 8 GPU(s))" in warned[0], lines
    for given in (["--training_hours", "4"], ["--budget_usd", "16"]):
        _, lines = run_preflight(tmp_path, "--data_dir", corpus, *given)
        assert not any("neither TRAINING_HOURS" in x for x in lines)


def test_the_plan_says_whether_host_memory_holds_the_staged_checkpoint_shares(tmp_path, corpus):
    from experiment import guards
    from experiment.config import resolve

    plan, lines = run_preflight(tmp_path, "--data_dir", corpus)
    assert any(x.startswith("preflight | saves write in the background:") for x in lines), lines
    cfg = resolve(parse_args([]), True, 8)
    p = guards.GpuPlan(64, 1e6, 1.0, 1.0, 8.0, 1.0, checkpoint_bytes=129 * 10**9, staged_rank_bytes=16_125 * 10**6,
                       disk_peak_bytes=0, save_seconds=430.0)
    # one node of 8 ranks stages 8 shares; a node of 4 ranks half as many
    assert "saves write in the background: 129.0 GB" in guards.staging_line(cfg, p, 8, 8, 1000 * 10**9)
    assert "64.5 GB staged" in guards.staging_line(cfg, p, 16, 4, 200 * 10**9)
    short = guards.staging_line(cfg, p, 8, 8, 200 * 10**9)
    assert short.startswith("warning:") and "every save will block training for about 430 s" in short
    # d64's weight average on 8 x 80 GB lives in host memory: 8 ranks' averages are taken before any save
    import dataclasses

    from experiment.memory import host_average_bytes
    from experiment.model import GPTConfig
    big = GPTConfig(vocab_size=256, depth=64, aspect_ratio=64, head_dim=128, max_seq_len=2048)
    per_rank = host_average_bytes(big, 8, 80 * 2**30)
    assert 6.3e9 < per_rank < 6.6e9  # about an eighth of its 12.9B parameters in fp32
    assert host_average_bytes(dataclasses.replace(big, depth=12), 8, 80 * 2**30) == 0
    held = dataclasses.replace(p, host_average_bytes=per_rank)
    assert "beside the weight average's" in guards.staging_line(cfg, held, 8, 8, 1000 * 10**9)
    tight = guards.staging_line(cfg, held, 8, 8, 300 * 10**9)  # 129 GB fit in half of 300, not of 300 - 52
    assert tight.startswith("warning:") and "every save will block" in tight
    assert guards.staging_line(cfg, p, 8, 8, 300 * 10**9).startswith("preflight | saves write in the background")
    assert "does not fit in the 20.0 GB of host memory" in guards.staging_line(cfg, held, 8, 8, 20 * 10**9)
    cfg.async_save = 0
    assert "saves block training (ASYNC_SAVE=0)" in guards.staging_line(cfg, p, 8, 8, 1000 * 10**9)


@pytest.mark.slow
def test_generations_whose_teachers_fit_no_gpu_are_refused_before_the_first_trains(tmp_path, corpus):
    """GENERATIONS=N with an explicit DEPTH: a later generation holds its teachers beside it. Where the
    memory plan says none of its modes fits, the pre-flight refuses the launch, naming the generation,
    instead of the trainer finding it at that generation's start, its share of the budget after the
    first's. The depths come from the memory plan the trainer uses (memory.choose_mode)."""
    import dataclasses

    from experiment.config import resolve
    from experiment.dataloader import Prepared
    from experiment.launch import model_config
    from experiment.memory import choose_mode, count_params

    flags = ["--data_dir", corpus, "--allow", "disk", "--max_epochs", 8]
    plan, _ = run_preflight(tmp_path, *flags, "--depth", 8)
    prepared = Prepared.load(plan["prepared"])
    cfg = resolve(parse_args(["--max_seq_len", "64", "--attn_dropout", "0", "--average", "none"]), True, 8)

    def fits(depth: int, teachers: int) -> bool:
        c = model_config(dataclasses.replace(cfg, depth=depth), prepared)
        return choose_mode(c, 8, cfg.device_batch_size or 1, c.max_seq_len, H100.memory_bytes, cfg.precision,
                           cfg.activation_checkpointing, teachers * count_params(c)) is not None

    one = next(d for d in range(8, 512, 2) if fits(d, 0) and not fits(d, 1))  # fits alone, not beside a teacher
    two = next(d for d in range(8, 512, 2) if fits(d, 1) and not fits(d, 2))  # beside one teacher, not two
    assert not isinstance(run_preflight(tmp_path, *flags, "--depth", one)[0], ConfigError)  # one model
    for depth, more, named in ((one, ["--generations", 2], "generation 2 holds d%d" % one),
                               (two, ["--generations", 3, "--teacher", "ensemble"], "generation 3 holds d%d" % two)):
        error, _ = run_preflight(tmp_path, *flags, "--depth", depth, *more)
        assert isinstance(error, ConfigError) and named in str(error) and "GENERATIONS=" in str(error), error
    for depth, more in ((two, ["--generations", 2]), (two, ["--generations", 3])):  # one teacher at a time
        plan, _ = run_preflight(tmp_path, *flags, "--depth", depth, *more)
        assert not isinstance(plan, ConfigError), plan


@pytest.mark.slow
def test_a_teacher_that_pushes_the_weight_average_to_host_memory_is_counted_there(tmp_path, corpus):
    """A later generation's teachers sit on the GPU beside the model, so a weight average that fits
    beside one model alone can go to host memory (memory.place_average, with the trainer's plan): the
    pre-flight counts it there for a launch with generations, as the trainer will place it."""
    import dataclasses

    from experiment.config import resolve
    from experiment.dataloader import Prepared
    from experiment.launch import model_config
    from experiment.memory import count_params, host_average_bytes

    flags = ["--data_dir", corpus, "--allow", "disk", "--max_epochs", 8, "--average", "ema"]
    plan, _ = run_preflight(tmp_path, *flags, "--depth", 8)
    prepared = Prepared.load(plan["prepared"])
    cfg = resolve(parse_args(["--max_seq_len", "64"]), True, 8)

    def on_host(depth: int, teachers: int) -> int:
        c = model_config(dataclasses.replace(cfg, depth=depth), prepared)
        return host_average_bytes(c, 8, H100.memory_bytes, cfg.precision, cfg.device_batch_size or 1,
                                  cfg.activation_checkpointing, teachers * count_params(c))

    pushed = next(d for d in range(8, 512, 2) if on_host(d, 0) == 0 and on_host(d, 1) > 0)
    # the staging line names the average held on this node's host (8 ranks), or warns that it does not
    # fit this machine's host memory: either way, its size
    held = f"{8 * on_host(pushed, 1) / 1e9:.1f} GB"
    for more, counted in (([], False), (["--generations", 2], True), (["--generations", "auto"], True)):
        _, lines = run_preflight(tmp_path, *flags, "--depth", pushed, *more)
        named = [x for x in lines if "weight average" in x]
        assert len(named) == counted and all(held in x for x in named), "\n".join(map(str, [more, *lines]))


def test_the_host_average_is_the_largest_over_the_generations_still_to_train(tmp_path):
    """The weight average's host memory does not grow with the teachers: d54 (8 x 80 GB) keeps it on
    the GPU alone and beside seven teachers (which fit no mode: nothing planned), on the host beside
    one. GENERATIONS=auto TEACHER=ensemble counts each generation's own ensemble; a pending student
    its generations, of the run's depth."""
    import dataclasses
    import json

    from experiment import guards
    from experiment.config import resolve
    from experiment.memory import count_params
    from experiment.model import GPTConfig

    def config(depth):
        return GPTConfig(vocab_size=256, depth=depth, max_seq_len=2048, bigram_vocab=16384)

    gpu = Gpu("NVIDIA H100 80GB HBM3", peak_flops("H100 80GB HBM3"), 80 * 2**30)
    cfg = resolve(parse_args(["--average", "ema", "--max_epochs", "8", "--depth", "54", "--generations", "auto",
                              "--teacher", "ensemble"]), True, 8)
    p = count_params(config(54))
    ahead = guards.teachers_ahead(cfg, config(54), config, tmp_path)
    assert ahead == tuple(k * p for k in range(8))  # generations 1-8, each taught by all before it

    def host(teachers):
        return guards.gpu_plan(cfg, config(54), gpu, 8, 10**9, 8.0, teachers).host_average_bytes

    assert host((0,)) == 0 and host((7 * p,)) == 0 and 3.8e9 < host((p,)) < 4.0e9
    assert host(ahead) == host((p,))
    # no average, no host memory for it, whatever the teachers
    assert guards.gpu_plan(dataclasses.replace(cfg, average="none"), config(54), gpu, 8, 10**9, 8.0,
                           (p,)).host_average_bytes == 0
    # a pending student (two generations done) holds both, of the run's depth, whatever its own
    two = dataclasses.replace(cfg, generations=2, teacher="previous", student_depth=12)
    # with no generation done, the figure covers generations 1-2 (0, p), not the student's 2p: the
    # student is another model, trained after them
    assert guards.teachers_ahead(two, config(54), config, tmp_path) == (0, p)
    (tmp_path / "generations.json").write_text(json.dumps({"generations": [{"outcome": "finished"}] * 2}))
    assert guards.teachers_ahead(two, config(12), config, tmp_path) == (2 * p,)
    assert guards.teachers_ahead(dataclasses.replace(two, depth="auto"), config(12), config, tmp_path) == (0,)
    # the pre-flight's regime prices the next generation's teachers' forward, as the trainer does: the
    # pending student's two of the run's depth; nothing for a first generation, nor for a student after
    # DEPTH=auto's generations (their depth is not known here)
    from experiment import autosize
    forward = autosize.flops_per_token(config(54)) / 3
    assert guards.teacher_flops_ahead(two, config(12), config, tmp_path) == 2 * autosize.flops_per_token(config(54)) / 3
    assert guards.teacher_flops_ahead(dataclasses.replace(two, depth="auto"), config(12), config, tmp_path) == 0
    one_done = tmp_path / "one"  # a generation next, the student after it: DEPTH=auto prices the generation's
    one_done.mkdir()
    (one_done / "generations.json").write_text(json.dumps({"generations": [{"outcome": "finished"}]}))
    assert guards.teacher_flops_ahead(dataclasses.replace(two, depth="auto"), config(20), config, one_done) == \
        pytest.approx(autosize.flops_per_token(config(20)) / 3)
    assert guards.teacher_flops_ahead(cfg, config(54), config, tmp_path / "new") == 0
    (tmp_path / "generations.json").write_text(json.dumps({"generations": [{"outcome": "finished"}] * 3}))
    assert guards.teacher_flops_ahead(cfg, config(54), config, tmp_path) == pytest.approx(3 * forward)  # ensemble
    auto_depth = dataclasses.replace(cfg, depth="auto", teacher="previous")
    assert guards.teacher_flops_ahead(auto_depth, config(20), config, tmp_path) == \
        pytest.approx(autosize.flops_per_token(config(20)) / 3)  # its own depth's, the chain's


def test_a_student_larger_than_its_teachers_is_checked_with_all_of_them(tmp_path):
    """STUDENT_DEPTH may be deeper than DEPTH: the student holds every generation beside it."""
    import dataclasses

    from experiment.guards import generations_fit
    from experiment.memory import choose_mode, count_params
    from experiment.model import GPTConfig

    cfg = dataclasses.replace(parse_args([]), generations=2, precision="bf16", activation_checkpointing="on",
                              device_batch_size=1, depth=32)

    def config(depth):
        return GPTConfig(vocab_size=64, depth=depth, aspect_ratio=64, head_dim=128, max_seq_len=64)

    def fits(c, teachers):
        return choose_mode(c, 8, 1, 64, H100.memory_bytes, "bf16", "on", teachers) is not None

    gen = config(32)
    student = next(config(s) for s in range(34, 400, 2) if fits(config(s), 0)
                   and not fits(config(s), 2 * count_params(gen)))
    generations_fit(cfg, config, H100, 8, tmp_path)  # the generations alone fit
    with pytest.raises(ConfigError, match=f"the student \\(d{student.depth}\\) holds d{student.depth} and "
                                          f"{2 * count_params(gen):,} parameters of teachers") as refused:
        generations_fit(dataclasses.replace(cfg, student_depth=student.depth), config, H100, 8, tmp_path)
    # a student is taught by every generation whatever TEACHER says: no TEACHER=previous in the way out
    assert "a smaller STUDENT_DEPTH" in str(refused.value) and "TEACHER=previous" not in str(refused.value)


def test_only_the_generations_left_are_checked_and_auto_checks_its_second(tmp_path):
    """A relaunch checks the generations not done yet (one done may have trained on larger GPUs);
    GENERATIONS=auto checks its second generation, the first with a teacher."""
    import dataclasses
    import json

    from experiment import generations
    from experiment.guards import generations_fit
    from experiment.memory import choose_mode, count_params
    from experiment.model import GPTConfig

    def config(depth):
        return GPTConfig(vocab_size=64, depth=depth, aspect_ratio=64, head_dim=128, max_seq_len=64)

    def fits(c, teachers):
        return choose_mode(c, 8, 1, 64, H100.memory_bytes, "bf16", "on", teachers) is not None

    big = next(d for d in range(8, 400, 2) if fits(config(d), 0) and not fits(config(d), count_params(config(d))))
    assert fits(config(2), 2 * count_params(config(big)))  # a small student fits beside both
    cfg = dataclasses.replace(parse_args([]), generations=2, student_depth=2, precision="bf16",
                              activation_checkpointing="on", device_batch_size=1, depth=big)

    def record(*outcomes):
        gens = [{"index": k, "outcome": o} for k, o in enumerate(outcomes, 1)]
        (tmp_path / "generations.json").write_text(json.dumps({"generations": gens}))

    with pytest.raises(ConfigError, match=f"GENERATIONS=2: generation 2 holds d{big} "):
        generations_fit(cfg, config, H100, 8, tmp_path)  # nothing done
    # the first generation has no teacher: a depth too large even alone is named at the second, the
    # first with teachers to drop (the trainer's own memory plan refuses the first)
    huge = next(d for d in range(big, 800, 2) if not fits(config(d), 0))
    with pytest.raises(ConfigError, match=f"GENERATIONS=2: generation 2 holds d{huge} "):
        generations_fit(dataclasses.replace(cfg, depth=huge), config, H100, 8, tmp_path)
    record("finished", None)  # generation 2 begun, not done: still checked
    assert [k for k, _, _ in generations.ahead(cfg, tmp_path)] == [2, 3]  # and the student after it
    with pytest.raises(ConfigError, match="generation 2 holds"):
        generations_fit(cfg, config, H100, 8, tmp_path)
    record("finished", "finished")  # only the student is left, and it fits
    generations_fit(cfg, config, H100, 8, tmp_path)
    (tmp_path / "generations.json").unlink()
    auto = dataclasses.replace(cfg, generations="auto", student_depth=None)
    with pytest.raises(ConfigError, match=f"GENERATIONS=auto: generation 2 holds d{big} .*: set a smaller DEPTH "
                                          r"\(or DEPTH=auto\), GENERATIONS=1, or more GPUs"):
        generations_fit(auto, config, H100, 8, tmp_path)
    generations_fit(dataclasses.replace(auto, depth=big - 2 if fits(config(big - 2), count_params(config(big - 2)))
                                        else 2), config, H100, 8, tmp_path)
    # auto's later generations are checked at their start: a depth whose second generation fits beside
    # one teacher and whose third would not beside two (TEACHER=ensemble) passes now
    two = next(d for d in range(8, 400, 2) if fits(config(d), count_params(config(d)))
               and not fits(config(d), 2 * count_params(config(d))))
    generations_fit(dataclasses.replace(auto, depth=two, teacher="ensemble"), config, H100, 8, tmp_path)
    with pytest.raises(ConfigError, match=f"GENERATIONS=3: generation 3 holds d{two} "):
        generations_fit(dataclasses.replace(auto, depth=two, teacher="ensemble", generations=3), config, H100, 8,
                        tmp_path)
    # an auto chain's student is checked once it is next, beside every generation of the chain: a
    # student of `two`'s depth fits beside one, not two; not yet known to be next, it is not checked
    chain = dataclasses.replace(auto, depth=two, student_depth=two, training_hours=1000 / 3600)
    generations_fit(chain, config, H100, 8, tmp_path)
    gens = [{"index": k, "outcome": "finished", "used_seconds": 375.0} for k in (1, 2)]  # all 750 s the chain has
    (tmp_path / "generations.json").write_text(json.dumps({"generations": gens}))
    assert generations.ahead(chain, tmp_path) == [(3, True, 2)]
    with pytest.raises(ConfigError, match=f"GENERATIONS=auto: the student \\(d{two}\\) holds d{two} and "
                                          f"{2 * count_params(config(two)):,} parameters of teachers"):
        generations_fit(chain, config, H100, 8, tmp_path)
    (tmp_path / "generations.json").unlink()
    # DEPTH=auto picks a depth that fits beside its teacher itself: nothing to check, whatever GENERATIONS
    for n in (2, "auto"):
        generations_fit(dataclasses.replace(auto, depth="auto", generations=n), config, H100, 8, tmp_path)
