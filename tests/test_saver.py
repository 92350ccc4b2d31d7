"""The background saver: a snapshot of the moment a save began, completed only after its writer, one at a time."""

import math
import time
from pathlib import Path

import pytest
import torch

from experiment import checkpoint as ckpt
from experiment.saver import Saver


def _saver(run_dir, write_bps=0, device="cpu"):
    return Saver(run_dir, 0, 1, torch.device(device), background=True, all_ok=bool, gather=lambda files: [files],
                 write_bps=write_bps)


def _meta(step, best_step=-1):
    return {"step": step, "val_loss": 1.0, "state": {"best_step": best_step}, "world_size": 1, "model_parts": 1}


def _trainer(run_dir, st, log):
    """What saving.finish_save reads of a trainer, with a real Saver into `run_dir`, and a fresh Loop."""
    from types import SimpleNamespace

    from experiment import trainer
    from experiment.distributed import Dist

    t = SimpleNamespace(st=st, saver=_saver(run_dir), d=Dist(0, 0, 1, torch.device("cpu")), run_dir=run_dir,
                        report=SimpleNamespace(add=lambda record: None), log=log,
                        cfg=SimpleNamespace(keep_last=3, keep_best_optimizer=0))
    loop = trainer.Loop(x=None, y=None, data_state={}, started=0.0, used_at_start=0.0, last_eval_time=0.0,
                        last_save_time=0.0, last_saved_step=0, last_complete_step=0)
    return t, loop


def test_a_background_save_holds_the_moment_it_began_and_counts_only_once_completed(tmp_path):
    weights = {"w": torch.arange(200_000, dtype=torch.float32)}  # 0.8 MB
    state = {"state": {"w": {"momentum": torch.ones(100_000)}}, "step": 7}
    saver = _saver(tmp_path, write_bps=2e6)  # ~0.6 s for both files: training goes on meanwhile
    saver.begin(3, weights, state, _meta(3, best_step=3), background=True)
    assert saver.writing()
    weights["w"].add_(1.0)  # the next optimizer steps change the live tensors in place
    state["state"]["w"]["momentum"].zero_()
    assert ckpt.complete_steps(tmp_path) == []  # nothing counts while the write is in flight
    time.sleep(0.05)
    assert ckpt.complete_steps(tmp_path) == []
    assert saver.wait() > 0 and not saver.writing()
    assert ckpt.complete_steps(tmp_path) == []  # written, but not complete until every rank is done
    pending, error = saver.complete()
    assert error is None and pending.step == 3 and pending.write_seconds > 0.3
    assert ckpt.complete_steps(tmp_path) == [3] and ckpt.read_best(tmp_path)["step"] == 3
    saved = ckpt.load_tensors(ckpt.model_path(tmp_path, 3))
    assert torch.equal(saved["w"], torch.arange(200_000, dtype=torch.float32))  # the snapshot, not the live values
    shard = ckpt.load_tensors(ckpt.optim_path(tmp_path, 3, 0))
    assert torch.equal(shard["state"]["w"]["momentum"], torch.ones(100_000)) and shard["step"] == 7
    assert ckpt.damaged_files(tmp_path, 3) == []  # sizes and CRCs recorded as written


def test_the_host_buffers_are_reused_and_one_save_is_in_flight_at_a_time(tmp_path):
    weights = {"w": torch.randn(1000)}
    saver = _saver(tmp_path)
    saver.begin(1, weights, {}, _meta(1), background=True)
    first = saver.buffers.buffers[("model", "w")].data_ptr()
    with pytest.raises(AssertionError, match="one save in flight"):
        saver.begin(2, weights, {}, _meta(2), background=True)
    saver.wait()
    saver.complete()
    saver.begin(2, weights, {}, _meta(2), background=True)
    assert saver.buffers.buffers[("model", "w")].data_ptr() == first  # no second allocation (pinned on CUDA)
    saver.wait()
    assert saver.complete()[1] is None and ckpt.complete_steps(tmp_path) == [1, 2]
    saver.begin(3, weights, {}, _meta(3), background=False)  # written in this thread: nothing left to wait for
    assert saver.pending.thread is None and not saver.writing() and saver.complete()[1] is None


def test_a_failed_background_write_fails_its_step_only(tmp_path):
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=True)
    saver.wait()
    saver.complete()
    ckpt.optim_path(tmp_path, 2, 0).mkdir()  # the shard cannot be written (like a full disk)
    saver.begin(2, {"w": torch.ones(10)}, {}, _meta(2), background=True)
    saver.wait()
    _, error = saver.complete()
    assert error and "optim_000002_rank0.pt" in error
    assert ckpt.complete_steps(tmp_path) == [1] and not ckpt.model_path(tmp_path, 2).exists()


def test_the_trainer_saves_blocking_when_host_memory_cannot_hold_the_staged_share(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from conftest import tiny_config
    from experiment import saving
    from experiment.distributed import Dist
    from experiment.model import build_model

    model, lines = build_model(tiny_config()), []
    cfg = SimpleNamespace(async_save=1, save_write_mbps=0.0, average="none")
    d = Dist(0, 0, 1, torch.device("cpu"))
    assert saving.make_saver(cfg, d, model, tmp_path, lines.append).background
    monkeypatch.setattr(saving, "host_available_bytes", lambda: 1000)
    assert not saving.make_saver(cfg, d, model, tmp_path, lines.append).background
    assert lines[-1].startswith("warning: this node's ranks would stage") and "every save blocks training" in lines[-1]
    cfg.async_save = 0
    assert not saving.make_saver(cfg, d, model, tmp_path, lines.append).background


def test_a_failed_best_save_falls_back_to_the_best_of_a_completed_save(tmp_path):
    """Step 3's and step 4's evals were both new bests, and both saves failed (step 4's eval came
    while step 3's write was in flight): the best goes back to step 2, whose save completed, not to
    step 3, the best before step 4's eval."""

    from experiment import saving
    from experiment.checkpoint import RunState

    st, lines = RunState(), []
    t, loop = _trainer(tmp_path, st, lines.append)

    def save(step, val, fails):
        st.best_val, st.best_step = val, step  # this step's eval was a new best
        if fails:
            ckpt.optim_path(tmp_path, step, 0).mkdir()  # its shard cannot be written
        meta = {"step": step, "val_loss": val, "state": {"best_val": val, "best_step": step}, "world_size": 1,
                "model_parts": 1}
        t.saver.begin(step, {"w": torch.ones(10)}, {}, meta, background=True, context={"final": False})

    save(2, 2.0, fails=False)
    saving.finish_save(t, loop, wait=True)
    save(3, 1.5, fails=True)
    st.best_val, st.best_step = 1.4, 4  # step 4's eval, while step 3's write is in flight
    saving.finish_save(t, loop, wait=True)  # step 4's save first completes step 3's: failed
    save(4, 1.4, fails=True)
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step) == (2.0, 2)
    assert ckpt.complete_steps(tmp_path) == [2] and ckpt.read_best(tmp_path)["step"] == 2
    assert sum("not saved" in line for line in lines) == 2


def test_a_staging_failure_fails_the_save_through_complete_and_training_goes_on(tmp_path, monkeypatch):
    # Host memory that runs out while copying the share: begin() returns (no rank is left alone in
    # the collective of complete(), which reports the failure on every rank) and the next save works.
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=True)
    saver.wait()
    saver.complete()

    def no_memory(obj, key=()):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(saver.buffers, "stage", no_memory)
    saver.begin(2, {"w": torch.ones(10)}, {}, _meta(2), background=True)
    assert not saver.writing() and saver.wait() < 0.1
    _, error = saver.complete()
    assert "staging in host memory" in error and "not enough memory" in error
    assert ckpt.complete_steps(tmp_path) == [1] and not ckpt.model_path(tmp_path, 2).exists()
    monkeypatch.undo()
    saver.begin(3, {"w": torch.ones(10)}, {}, _meta(3), background=True)
    saver.wait()
    assert saver.complete()[1] is None and ckpt.complete_steps(tmp_path) == [1, 3]


def test_a_best_json_that_cannot_be_written_leaves_the_step_incomplete_as_reported(tmp_path):
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1, best_step=1), background=True)
    saver.wait()
    assert saver.complete()[1] is None and ckpt.read_best(tmp_path)["step"] == 1
    best = tmp_path / "best.json"
    best.unlink()
    best.mkdir()  # best.json cannot be replaced (like a full disk after meta went in)
    saver.begin(2, {"w": torch.ones(10)}, {}, _meta(2, best_step=2), background=True)
    saver.wait()
    _, error = saver.complete()
    assert error and error.startswith("meta:")
    assert ckpt.complete_steps(tmp_path) == [1] and not ckpt.model_path(tmp_path, 2).exists()


def test_a_best_eval_made_while_a_failed_best_save_was_in_flight_becomes_the_best(tmp_path):
    """Step 3's eval was a new best (1.5) and its save fails; step 4's eval (1.8, not a new best then)
    came while step 3's write was in flight. Once step 3 fails, step 4 beats the best that stands
    (step 2, 2.0) and its save makes it the best. Broken before: the best went back to step 2 and
    stayed there although step 4's own save completed."""

    from experiment import saving
    from experiment.checkpoint import RunState

    st, lines = RunState(), []
    t, loop = _trainer(tmp_path, st, lines.append)

    def save(step, fails):
        if fails:
            ckpt.optim_path(tmp_path, step, 0).mkdir()  # its shard cannot be written
        meta = {"step": step, "val_loss": loop.val_loss, "state": {"best_val": st.best_val, "best_step": st.best_step},
                "world_size": 1, "model_parts": 1}
        t.saver.begin(step, {"w": torch.ones(10)}, {}, meta, background=True, context={"final": False})

    st.step, st.last_eval_step, loop.val_loss = 2, 2, 2.0
    st.best_val, st.best_step, st.best_score, loop.score = 2.0, 2, 2.0, 2.0
    save(2, fails=False)
    saving.finish_save(t, loop, wait=True)
    st.step, st.last_eval_step, loop.val_loss = 3, 3, 1.5
    st.best_val, st.best_step, st.best_score, loop.score = 1.5, 3, 1.5, 1.5
    save(3, fails=True)
    st.step, st.last_eval_step, loop.val_loss, loop.score = 4, 4, 1.8, 1.8  # step 4's eval: no new best while step 3 stands
    saving.finish_save(t, loop, wait=True)  # step 4's save first completes step 3's: failed
    assert (st.best_val, st.best_step) == (1.8, 4)
    save(4, fails=False)
    saving.finish_save(t, loop, wait=True)
    assert ckpt.complete_steps(tmp_path) == [2, 4] and ckpt.read_best(tmp_path) == {"step": 4, "val_loss": 1.8, "weights": "raw"}
    # Step 7's eval ties the best that stands (step 4's 1.8) while step 6's best save fails: no new best
    st.step, st.last_eval_step, loop.val_loss = 6, 6, 1.7
    st.best_val, st.best_step, st.best_score, loop.score = 1.7, 6, 1.7, 1.7
    save(6, fails=True)
    st.step, st.last_eval_step, loop.val_loss, loop.score = 7, 7, 1.8, 1.8
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step) == (1.8, 4)
    # Step 9's best save fails at step 10, which made no eval: step 9's own score (still the latest) is no
    # eval of step 10's weights, so the best that stands stays
    st.step, st.last_eval_step, loop.val_loss = 9, 9, 1.6
    st.best_val, st.best_step, st.best_score, loop.score = 1.6, 9, 1.6, 1.6
    save(9, fails=True)
    st.step = 10
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step) == (1.8, 4)


def test_a_best_steps_own_failed_blocking_save_leaves_the_best_that_stands(tmp_path):
    """Saves block (ASYNC_SAVE=0, or after a failure); step 4's eval is a new best and its own save
    fails: the best goes back to step 2 and stays there (step 4 has no checkpoint)."""

    from experiment import saving
    from experiment.checkpoint import RunState

    st = RunState()
    t, loop = _trainer(tmp_path, st, lambda line: None)
    t.saver.background = False
    for step, val, fails in ((2, 2.0, False), (4, 1.5, True)):
        st.step, st.last_eval_step, loop.val_loss = step, step, val
        st.best_val, st.best_step = val, step  # a new best
        if fails:
            ckpt.optim_path(tmp_path, step, 0).mkdir()
        meta = {"step": step, "val_loss": val, "state": {"best_val": val, "best_step": step}, "world_size": 1,
                "model_parts": 1}
        t.saver.begin(step, {"w": torch.ones(10)}, {}, meta, background=True, context={"final": False})
        assert not t.saver.pending.background
        saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step) == (2.0, 2) and ckpt.read_best(tmp_path)["step"] == 2


def test_a_resumed_steps_own_eval_that_beats_the_best_names_its_checkpoint_best(tmp_path):
    """A preemption saved step 4 before the eval it skipped; the resume runs that eval at step 4 and it
    beats step 2's best. Step 4's checkpoint is complete and holds those weights: best.json names it,
    and the step is not written a second time. An eval that does not beat the best leaves it."""
    from experiment import saving
    from experiment.checkpoint import RunState

    for step, best in ((2, 2.0), (4, None)):  # step 2: an eval's best; step 4: a preemption's save
        meta = {"step": step, "val_loss": best, "state": {"best_val": 2.0, "best_step": 2}, "world_size": 1,
                "model_parts": 1}
        assert ckpt.save_checkpoint(tmp_path, step, {"w": torch.ones(10)}, {}, meta) is None
    assert ckpt.read_best(tmp_path) == {"step": 2, "val_loss": 2.0, "weights": "raw"}
    written = ckpt.meta_path(tmp_path, 4).stat().st_mtime_ns
    for val, named in ((2.5, 2), (1.5, 4)):
        st, lines = RunState(step=4, best_val=2.0, best_step=2, best_score=2.0, last_eval_step=4), []
        t, loop = _trainer(tmp_path, st, lines.append)
        loop.last_saved_step = loop.last_complete_step = 4  # the resumed step (train.start_loop)
        loop.saved_best, loop.val_loss, loop.score = (2.0, 2, "raw", 2.0), val, val
        if val < st.best_score:  # maybe_eval's best tracking
            st.best_val, st.best_step, st.best_score = val, 4, val
        saving.maybe_save(t, loop, save_due=False, preempted=False)
        assert ckpt.read_best(tmp_path)["step"] == named and t.saver.pending is None
        assert ckpt.meta_path(tmp_path, 4).stat().st_mtime_ns == written  # step 4 not written again
    assert ckpt.read_best(tmp_path) == {"step": 4, "val_loss": 1.5, "weights": "raw"} and loop.saved_best == (1.5, 4, "raw", 1.5)
    assert any("best.json names step 000004" in line for line in lines)


def test_a_save_begun_before_the_warmdown_and_completed_in_it_is_the_one_to_go_back_to(tmp_path):
    """The warmdown began at step 7 while step 6's background save was still writing: the newest
    complete checkpoint then was step 3. Once step 6's save completes, it is the newest from before
    the warmdown, and retention keeps it (KEEP_LAST 1). A save begun in the warmdown moves nothing."""
    from experiment import saving
    from experiment.checkpoint import RunState

    st = RunState()
    t, loop = _trainer(tmp_path, st, lambda line: None)
    t.cfg.keep_last = 1

    def save(step, begun):
        meta = {"step": step, "val_loss": None, "state": {"best_val": math.inf, "best_step": -1,
                                                          "warmdown_begun": begun}, "world_size": 1, "model_parts": 1}
        t.saver.begin(step, {"w": torch.ones(10)}, {}, meta, background=True, context={"final": False})

    save(3, begun=False)
    saving.finish_save(t, loop, wait=True)
    save(6, begun=False)
    st.warmdown_begun, st.warmdown_step = True, loop.last_complete_step  # the loop at step 7
    assert st.warmdown_step == 3
    saving.finish_save(t, loop, wait=True)
    assert st.warmdown_step == 6 and ckpt.complete_steps(tmp_path) == [6]
    save(9, begun=True)
    saving.finish_save(t, loop, wait=True)
    assert st.warmdown_step == 6 and ckpt.complete_steps(tmp_path) == [6, 9]  # 6 kept past KEEP_LAST


def test_after_a_failed_save_every_later_save_blocks_and_the_host_buffers_are_freed(tmp_path):
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=True)
    assert saver.pending.background and saver.buffers.nbytes() > 0
    saver.wait()
    saver.complete()
    assert saver.block_from_now_on() and not saver.block_from_now_on()  # said once
    assert saver.buffers.nbytes() == 0
    saver.begin(2, {"w": torch.ones(10)}, {}, _meta(2), background=True)
    assert not saver.pending.background and saver.pending.thread is None and saver.complete()[1] is None


def test_staging_is_counted_as_the_pinned_allocator_takes_it(tmp_path, monkeypatch):
    """On CUDA the host buffers are pinned, and torch's pinned allocator rounds each one up to a power
    of two (a 768 x 768 fp32 matrix takes 1.78x its bytes). The memory check counts that; on CPU the
    buffers take exactly their bytes, measured here from a real staged share."""
    from types import SimpleNamespace

    from experiment import saving
    from experiment.distributed import Dist
    from experiment.memory import pinned_block_bytes, staged_bytes_per_rank
    from experiment.model import GPTConfig, build_model
    from experiment.optim import LRS, ShardedOptimizer

    assert [pinned_block_bytes(n) for n in (1, 4096, 4097, 768 * 768 * 4)] == [1, 4096, 8192, 4 * 2**20]
    model = build_model(GPTConfig(vocab_size=65, depth=2, aspect_ratio=48, head_dim=32, max_seq_len=32))  # 96 wide
    opt = ShardedOptimizer(model, 0, 1, **LRS)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    opt.step()  # the optimizer state exists from the first step on
    d = Dist(0, 0, 1, torch.device("cpu"))
    saver = _saver(tmp_path)
    saver.begin(1, ckpt.strip_compile_prefix(model.state_dict()), opt.shard_state(), _meta(1), background=True)
    saver.wait()
    saver.complete()
    sizes = [b.numel() * b.element_size() for key, b in saver.buffers.buffers.items() if "step" not in key]
    assert staged_bytes_per_rank(model.config, 1, "fp32", pinned=False) == [sum(sizes)]
    assert staged_bytes_per_rank(model.config, 1, "fp32", pinned=True) == [sum(map(pinned_block_bytes, sizes))]

    # host memory that holds the exact share within HOST_STAGING_FRACTION, not the pinned one
    exact = staged_bytes_per_rank(model.config, 1, "fp32", pinned=False)[0]
    pinned = staged_bytes_per_rank(model.config, 1, "fp32", pinned=True)[0]
    assert pinned > 1.5 * exact  # 96 x 96 fp32 matrices take 1.78x
    monkeypatch.setattr(saving, "host_available_bytes", lambda: exact + pinned)  # half of it: >= exact, < pinned
    cfg, lines = SimpleNamespace(async_save=1, save_write_mbps=0.0, average="none"), []
    assert saving.make_saver(cfg, d, model, tmp_path, lines.append).background
    cuda = Dist(0, 0, 1, torch.device("cuda", 0))  # only the saver's accounting: nothing is allocated here
    assert not saving.make_saver(cfg, cuda, model, tmp_path, lines.append).background
    assert "every save blocks training" in lines[-1]


def test_the_staged_share_is_the_moment_begin_returned_though_the_next_step_changes_every_tensor(tmp_path):
    """The contract the CUDA path keeps with its stream synchronize, held on CPU: begin() returns only
    once the share is copied, so the optimizer step right after it (parameters, Muon momentum and
    AdamW moments, all changed in place) is not in the checkpoint. Caught: staging that keeps
    references to the live tensors instead of copies (a write from live memory)."""
    from experiment.model import GPTConfig, build_model
    from experiment.optim import LRS, ShardedOptimizer

    model = build_model(GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=16))
    opt = ShardedOptimizer(model, 0, 1, **LRS)
    x = torch.randint(0, 64, (2, 16))

    def train_step():
        model(x, x).backward()
        opt.step()
        model.zero_grad()

    train_step()
    weights, shard = ckpt.strip_compile_prefix(model.state_dict()), opt.shard_state()
    expected = {"model": {n: v.clone() for n, v in weights.items()},
                "optimizer": {n: {k: v.clone() for k, v in s.items()} for n, s in shard["state"].items()}}
    saver = _saver(tmp_path, write_bps=2e6)  # the write takes a while: the next step runs beside it
    saver.begin(1, weights, shard, _meta(1), background=True)
    train_step()  # changes, in place, every tensor begin() was handed
    assert not torch.equal(weights["wte.weight"], expected["model"]["wte.weight"])
    saver.wait()
    assert saver.complete()[1] is None
    saved, saved_shard = ckpt.load_tensors(ckpt.model_path(tmp_path, 1)), ckpt.load_tensors(ckpt.optim_path(tmp_path, 1, 0))
    assert all(torch.equal(saved[n], v) for n, v in expected["model"].items())
    assert all(torch.equal(saved_shard["state"][n][k], v) for n, s in expected["optimizer"].items() for k, v in s.items())


# ---------------------------------------------------------------- the saver's parts, one at a time


def test_host_buffers_are_reused_for_the_same_shape_and_dtype_and_replaced_for_another():
    from experiment.saver import HostBuffers

    buffers = HostBuffers(pinned=False)
    first = buffers.stage({"a": torch.ones(3), "b": [torch.zeros(5, dtype=torch.bfloat16)]})
    assert buffers.nbytes() == 3 * 4 + 5 * 2
    again = buffers.stage({"a": torch.full((3,), 2.0), "b": [torch.ones(5, dtype=torch.bfloat16)]})
    assert again["a"].data_ptr() == first["a"].data_ptr() and torch.equal(again["a"], torch.full((3,), 2.0))
    for shape in ((4,), (2,)):  # larger and smaller: a new buffer of the new shape
        staged = buffers.stage({"a": torch.ones(shape)})["a"]
        assert staged.shape == shape and torch.equal(staged, torch.ones(shape))
    cast = buffers.stage({"a": torch.ones(2, dtype=torch.bfloat16)})["a"]  # same shape, another dtype
    assert cast.dtype == torch.bfloat16 and buffers.nbytes() == 2 * 2 + 5 * 2


def test_a_save_knows_how_long_staging_blocked_and_how_long_its_write_took(tmp_path):
    from experiment.saver import Pending

    p = Pending(3, {}, started=2.0, staged_seconds=0.1, background=True, thread=None, outcome={"done_at": 5.5})
    assert p.write_seconds == 3.5
    assert Saver(tmp_path, 0, 1, torch.device("cpu"), True, bool, lambda f: [f]).write_bps == 0  # no cap unless asked
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=True)
    assert 0 <= saver.pending.staged_seconds < 0.5  # ten numbers copied: microseconds
    assert 0 <= saver.wait() < 5 and 0 <= saver.pending.write_seconds < 5
    saver.complete()


def test_host_buffers_are_pinned_for_cuda_alone():
    for device, pinned in (("cpu", False), ("cuda", True), ("mps", False)):
        saver = _saver("x", device=device)
        assert saver.buffers.pinned is pinned, device


def test_the_background_writer_alone_is_niced(tmp_path, monkeypatch):
    import threading

    from experiment import saver as saver_module

    niced = []
    monkeypatch.setattr(saver_module, "lower_priority", lambda nice: niced.append(threading.current_thread().name))
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=False)  # written here: this thread stays as is
    saver.complete()
    assert niced == []
    saver.begin(2, {"w": torch.ones(10)}, {}, _meta(2), background=True)
    saver.wait()
    saver.complete()
    assert niced == ["save-2"]


def test_any_exception_in_the_writer_fails_the_save_not_the_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a writer's bug")

    monkeypatch.setattr(ckpt, "write_rank_files", broken)
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=True)
    saver.wait()
    _, error = saver.complete()
    assert error and "ValueError: a writer's bug" in error and ckpt.complete_steps(tmp_path) == []


def test_blocking_from_now_on_gives_the_pinned_host_cache_back(tmp_path, monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: emptied.append(1), raising=False)
    pinned = _saver(tmp_path, device="cuda")
    assert pinned.block_from_now_on() and emptied == [1] and pinned.buffers.pinned
    _saver(tmp_path).block_from_now_on()  # unpinned: nothing to give back
    assert emptied == [1]


def test_the_time_a_pending_write_still_needs_is_its_expected_length_less_its_age(tmp_path):
    from experiment.saver import Pending

    saver = _saver(tmp_path)
    assert saver.seconds_left(5.0) == 0.0  # nothing pending
    saver.pending = Pending(1, {}, started=time.time() - 2.0, staged_seconds=0.0, background=True, thread=None)
    assert 2.5 <= saver.seconds_left(5.0) <= 3.0
    assert saver.seconds_left(1.0) == 0.0  # overdue: nothing more is kept for it


def test_on_cuda_staging_waits_for_its_copies_and_the_writer_never_holds_the_process(tmp_path, monkeypatch):
    """The copies to pinned memory are non-blocking: the stream is synchronized before the writer reads
    them. The writer is a daemon thread: a run that exits (an error, a signal's end) is not held by it."""
    from types import SimpleNamespace

    from experiment.saver import HostBuffers

    synced = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(synchronize=lambda: synced.append(1)))
    saver = _saver(tmp_path, device="cuda")
    saver.buffers = HostBuffers(pinned=False)  # no pinned memory on this CPU; the copies are the same
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=True)
    assert synced == [1] and saver.pending.thread.daemon
    saver.wait()
    assert saver.complete()[1] is None
    for step, device in ((2, "cpu"), (3, "mps")):
        other = _saver(tmp_path, device=device)
        other.begin(step, {"w": torch.ones(10)}, {}, _meta(step), background=True)
        other.wait()
        other.complete()
    assert synced == [1]


# ---------------------------------------------------------------- maybe_save's decision, one condition at a time


def _saving_trainer(tmp_path, monkeypatch, step=5, **loop_fields):
    """_trainer at `step`, whose checkpoint share is a small stand-in that records what it was asked for."""
    import dataclasses

    from experiment import saving
    from experiment.checkpoint import RunState

    st, lines, asked = RunState(step=step), [], []

    def share(model, opt, st, val_loss, run_meta, d, weights="raw"):
        asked.append((st.step, val_loss, weights))
        return {"w": torch.full((3,), float(st.step))}, {}, {**_meta(st.step, st.best_step),
                                                              "state": dataclasses.asdict(st)}

    monkeypatch.setattr(saving, "checkpoint_share", share)
    t, loop = _trainer(tmp_path, st, lines.append)
    t.model = t.opt = t.run_meta = None
    loop.last_saved_step = loop.last_complete_step = -1
    for k, v in loop_fields.items():
        setattr(loop, k, v)
    return t, loop, lines, asked


def test_a_save_is_made_when_due_at_the_end_or_at_a_new_best_and_never_twice_for_a_step(tmp_path, monkeypatch):
    from experiment import saving

    t, loop, _, asked = _saving_trainer(tmp_path, monkeypatch)
    saving.maybe_save(t, loop, save_due=False, preempted=False)
    assert asked == [] and t.saver.pending is None  # nothing due
    before = time.time()
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    assert asked == [(5, loop.val_loss, "raw")] and t.saver.pending.background  # due: in the background
    assert loop.last_saved_step == 5 and loop.last_save_time >= before and loop.last_complete_step == -1
    assert loop.last_eval_time < before  # no eval at step 5: the eval clock stays
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    assert len(asked) == 1  # this step's save is begun already
    t.st.step, t.st.best_step = 6, 6
    t.st.last_eval_step, loop.last_eval_time = 6, before - 50.0  # an eval at this step
    saving.maybe_save(t, loop, save_due=False, preempted=False)  # a new best: saved, step 5's completed first
    assert [a[0] for a in asked] == [5, 6] and loop.last_complete_step == 5 and t.saver.pending.step == 6
    assert loop.last_eval_time == loop.last_save_time >= before  # both clocks from the save, after the wait
    t.st.step = 7
    loop.stop(0, "finished")
    saving.maybe_save(t, loop, save_due=False, preempted=False)  # the final save: written and completed here
    assert [a[0] for a in asked] == [5, 6, 7] and t.saver.pending is None and loop.last_complete_step == 7
    assert ckpt.complete_steps(tmp_path) == [5, 6, 7]
    assert t.st.save_waits == 0  # no write was in flight at any of these steps' start (writing=False, the default)


def test_during_skipped_updates_only_the_final_and_a_best_save_are_made(tmp_path, monkeypatch):
    from experiment import saving

    t, loop, _, asked = _saving_trainer(tmp_path, monkeypatch, bad_in_a_row=1)
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    assert asked == []
    t.st.best_step = 5
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    assert [a[0] for a in asked] == [5]
    t.saver.wait()
    t.saver.complete()
    t, loop, _, asked = _saving_trainer(tmp_path / "final", monkeypatch, bad_in_a_row=3)
    loop.stop(0, "finished")
    saving.maybe_save(t, loop, save_due=False, preempted=False)
    assert [a[0] for a in asked] == [5]


def test_a_preemptions_save_holds_the_raw_weights_and_no_eval(tmp_path, monkeypatch):
    from experiment import saving

    t, loop, _, asked = _saving_trainer(tmp_path, monkeypatch, val_loss=1.25, weights="average")
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    assert asked == [(5, 1.25, "average")]
    t.saver.wait()
    saving.finish_save(t, loop)
    t.st.step = 6
    loop.stop(0, "stopped: SIGTERM at step 6; the same command resumes it")
    saving.maybe_save(t, loop, save_due=False, preempted=True)
    assert asked[1] == (6, None, "raw") and loop.last_complete_step == 6


def test_a_save_in_flight_is_completed_first_and_a_stop_signal_stops_on_it(tmp_path, monkeypatch):
    from experiment import saving

    t, loop, lines, asked = _saving_trainer(tmp_path, monkeypatch)
    saving.maybe_save(t, loop, save_due=True, preempted=False)  # step 5, in the background
    t.st.step = 9
    loop.stop(0, "stopped: SIGTERM at step 9; the same command resumes it")
    saving.maybe_save(t, loop, save_due=False, preempted=True, writing=True)
    assert [a[0] for a in asked] == [5] and loop.last_complete_step == 5 and t.saver.pending is None
    assert loop.outcome == "stopped: SIGTERM at step 9, on step 5's checkpoint; the same command resumes it"
    assert any(line.startswith("save | stopping on step 000005's checkpoint, whose write was in flight at the "
                               "signal") and line.endswith("a resume trains the 4 steps since it again")
               for line in lines), lines
    assert t.st.save_waits == 0


def test_a_stop_signal_after_a_failed_write_saves_its_own_step(tmp_path, monkeypatch):
    from experiment import saving

    t, loop, lines, asked = _saving_trainer(tmp_path, monkeypatch)
    ckpt.optim_path(tmp_path, 5, 0).mkdir()  # step 5's shard cannot be written
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    t.st.step = 9
    loop.stop(0, "stopped: SIGTERM at step 9; the same command resumes it")
    saving.maybe_save(t, loop, save_due=False, preempted=True, writing=True)
    assert [a[0] for a in asked] == [5, 9] and loop.last_complete_step == 9
    assert any(line.startswith("save | step 000005's write failed (waited ") and
               line.endswith("s): saving step 000009 instead") for line in lines) and t.st.save_waits == 0


@pytest.mark.slow
def test_a_due_save_that_waits_for_the_one_in_flight_is_counted_and_said(tmp_path, monkeypatch):
    from experiment import saving

    t, loop, lines, asked = _saving_trainer(tmp_path, monkeypatch)
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    t.st.step = 6
    saving.maybe_save(t, loop, save_due=True, preempted=False, writing=False)  # done already: no wait counted
    assert t.st.save_waits == 0 and t.saver.pending.step == 6
    t.saver.write_bps = 4000  # a share's files are a few kB: about half a second a write
    t.saver.wait()
    t.st.step = 7
    saving.maybe_save(t, loop, save_due=True, preempted=False, writing=True)
    t.st.step = 8
    saving.maybe_save(t, loop, save_due=True, preempted=False, writing=True)
    t.saver.write_bps = 0
    assert t.st.save_waits == 2 and 0.2 < t.st.save_wait_seconds < 1.5  # step 8 waited for step 7's whole write
    waits = [line for line in lines if " waited " in line]
    assert len(waits) == 2 and waits[1].startswith("save | step 000008 waited ") and "(2 waits, " in waits[1]
    t.st.step = 9
    loop.stop(0, "finished")
    saving.maybe_save(t, loop, save_due=False, preempted=False, writing=True)
    assert t.st.save_waits == 2  # the final save's wait is said, not counted
    assert any(line.startswith("save | the final save waited ") and "for step 000008's write" in line for line in lines)
    assert [a[0] for a in asked] == [5, 6, 7, 8, 9]


def test_lowering_priority_nices_the_calling_thread_alone_and_a_refusal_is_not_an_error(monkeypatch):
    import os
    import threading

    from experiment.saver import lower_priority

    seen = {}

    def in_a_thread(nice):
        lower_priority(nice)
        seen[nice] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (0, 5):
        thread = threading.Thread(target=in_a_thread, args=(nice,))
        thread.start()
        thread.join()
    assert seen[0] == base and os.getpriority(os.PRIO_PROCESS, 0) == base  # this thread, as it was
    assert seen[5] == 5 or base > 5  # (a process niced past 5 already may not lower it)

    def refused(*args):
        raise PermissionError("not allowed")

    monkeypatch.setattr(os, "setpriority", refused)
    lower_priority(5)  # the writer competes as it is


def test_the_background_writer_runs_at_the_lowest_priority_linux_has(tmp_path, monkeypatch):
    """WRITER_NICE: measured (bench save), the writer then runs on what training leaves idle."""
    import os
    import threading

    write, nice = ckpt.write_rank_files, []

    def recording(*args, **kwargs):
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_rank_files", recording)
    saver = _saver(tmp_path)
    saver.begin(1, {"w": torch.ones(10)}, {}, _meta(1), background=True)
    saver.wait()
    assert saver.complete()[1] is None and nice == [19]


# ---------------------------------------------------------------- saving.py's other parts


def test_staging_must_fit_every_local_ranks_share_within_the_fraction_at_its_boundary(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from conftest import tiny_config
    from experiment import saving
    from experiment.distributed import Dist
    from experiment.memory import staged_bytes_per_rank
    from experiment.model import build_model
    from experiment.saver import HOST_STAGING_FRACTION

    model = build_model(tiny_config())
    share = staged_bytes_per_rank(tiny_config(), 1, "fp32", pinned=False)[0]
    cfg = SimpleNamespace(async_save=1, save_write_mbps=2.5, average="none")
    node = Dist(0, 0, 1, torch.device("cpu"), local_world_size=3)  # three ranks' shares in this node's memory
    for available, background in ((3 * share / HOST_STAGING_FRACTION, True), (3 * share / HOST_STAGING_FRACTION - 1, False)):
        monkeypatch.setattr(saving, "host_available_bytes", lambda: available)
        saver = saving.make_saver(cfg, node, model, tmp_path, lambda line: None)
        assert saver.background == background and saver.write_bps == 2.5e6


def test_a_save_before_one_is_measured_is_the_checkpoints_bytes_at_the_planned_disk_rate():
    from conftest import tiny_config
    from experiment import saving
    from experiment.hardware import DISK_WRITE_GBPS
    from experiment.memory import checkpoint_bytes_per_rank
    from experiment.model import build_model

    model = build_model(tiny_config())
    for world in (1, 3):
        parts = checkpoint_bytes_per_rank(tiny_config(), world, "fp32")
        assert saving.checkpoint_seconds(model, world) == sum(a + b for a, b in parts) / (DISK_WRITE_GBPS * 1e9)
    bf16 = sum(a + b for a, b in checkpoint_bytes_per_rank(tiny_config(), 1, "bf16"))
    assert saving.checkpoint_seconds(model.to(torch.bfloat16), 1) == bf16 / (DISK_WRITE_GBPS * 1e9)


@pytest.mark.slow
def test_finish_save_reports_the_write_and_what_it_blocked_and_keeps_the_longest_write(tmp_path):
    from experiment import saving
    from experiment.checkpoint import RunState

    st, records = RunState(), []
    t, loop = _trainer(tmp_path, st, lambda line: None)
    t.report.add = records.append
    t.saver.write_bps = 1e6
    data = {"w": torch.zeros(300_000)}  # 1.2 MB: 1.2 s at 1 MB/s
    t.saver.begin(1, data, {}, _meta(1), background=True, context={"final": False})
    t.saver.wait()
    saving.finish_save(t, loop)  # the write is done: completing it blocks training for no more than that
    quarter = {"w": torch.zeros(75_000)}  # 0.3 s
    t.saver.begin(2, quarter, {}, _meta(2), background=False, context={"final": False})  # written here, blocking
    saving.finish_save(t, loop)
    (a, b) = records
    assert a["kind"] == b["kind"] == "save" and a["ok"] and b["ok"] and (a["step"], b["step"]) == (1, 2)
    assert a["seconds"] >= 1.1 and 0 <= a["blocked"] < a["seconds"] / 2  # the background write's time was training's
    assert 0.25 <= b["seconds"] < a["seconds"] and b["seconds"] <= b["blocked"] < b["seconds"] + 0.5  # all of it
    assert st.save_seconds == pytest.approx(a["seconds"], abs=1e-3)  # the longest write so far
    assert loop.last_complete_step == 2 and loop.saved_best == ckpt.run_state(_meta(2)).best()


def test_a_failed_final_save_ends_the_run_with_1_and_a_failed_preemption_save_says_nothing_of_going_on(tmp_path):
    from experiment import saving
    from experiment.checkpoint import RunState

    st, lines = RunState(step=4), []
    t, loop = _trainer(tmp_path, st, lines.append)
    loop.last_complete_step = -1
    ckpt.optim_path(tmp_path, 4, 0).mkdir()  # its shard cannot be written
    t.saver.begin(4, {"w": torch.ones(3)}, {}, _meta(4), background=False, context={"final": True})
    saving.finish_save(t, loop)
    assert loop.end == 1 and loop.outcome.startswith("failed: the final checkpoint, step 000004, could not be")
    assert lines[-1].startswith(f"error: the final checkpoint, step 000004, could not be written to {tmp_path}")
    assert "the latest complete checkpoint is none: the same command resumes" in lines[-1]
    loop.last_complete_step = 2
    t.saver.begin(4, {"w": torch.ones(3)}, {}, _meta(4), background=False, context={"final": True})
    saving.finish_save(t, loop)
    assert "the latest complete checkpoint is step 000002:" in lines[-1]

    st, lines = RunState(step=4), []
    t, loop = _trainer(tmp_path, st, lines.append)
    loop.stop(0, "stopped: SIGTERM at step 4; the same command resumes it")
    t.saver.begin(4, {"w": torch.ones(3)}, {}, _meta(4), background=True, context={"final": False})
    t.saver.wait()
    saving.finish_save(t, loop)
    assert lines == [f"error: checkpoint step 000004 not saved ({lines[0].split('(', 1)[1].rsplit(')', 1)[0]}); "
                     "earlier checkpoints are kept"]  # neither "training goes on" nor the blocking line
    assert loop.end == 0 and not t.saver.background


def test_the_volume_is_named_with_its_free_space_or_why_it_cannot_be_read(tmp_path, monkeypatch):
    from experiment import saving

    monkeypatch.setattr(saving, "volume", lambda path: (Path("/mnt/x"), 2_500_000))
    assert saving.volume_text(tmp_path) == "the volume /mnt/x has 2.5 MB free"

    def unreadable(path):
        raise OSError("gone")

    monkeypatch.setattr(saving, "volume", unreadable)
    assert saving.volume_text(tmp_path) == "its volume cannot be read (gone)"


def test_repairing_best_json_says_so_and_a_failure_leaves_a_warning(tmp_path, monkeypatch):
    from experiment import saving
    from experiment.checkpoint import CheckpointError, RunState

    st, lines = RunState(best_val=1.5, best_step=4), []
    for answer, said in ((True, ["best.json names step 000004 because"]), (False, [])):
        monkeypatch.setattr(ckpt, "repair_best", lambda run_dir, val, step: answer)
        lines.clear()
        saving.repair_best(tmp_path, st, lines.append, "because")
        assert lines == said
    for error in (OSError("disk"), CheckpointError("torn")):
        def failing(run_dir, val, step, error=error):
            raise error
        monkeypatch.setattr(ckpt, "repair_best", failing)
        lines.clear()
        saving.repair_best(tmp_path, st, lines.append)
        assert lines == [f"warning: best.json could not be rewritten to name step 000004 ({error})"]


def test_the_export_at_the_end_says_where_the_file_is_or_why_there_is_none(tmp_path, monkeypatch):
    from experiment import export, saving
    from experiment.checkpoint import CheckpointError

    facts = {"step": 7, "bytes": 2e9, "seconds": 1.25}
    monkeypatch.setattr(export, "export", lambda run_dir, out, workspace: (tmp_path / "best.pt", facts))
    assert saving.export_best(tmp_path) == export.describe(tmp_path / "best.pt", facts)
    for error in (OSError("full"), CheckpointError("no best")):
        def failing(run_dir, out, workspace, error=error):
            raise error
        monkeypatch.setattr(export, "export", failing)
        assert saving.export_best(tmp_path) == (f"warning: the best model was not exported as one file ({error}); "
                                                "python -m experiment.export retries")


def test_retention_keeps_no_step_for_a_warmdown_not_begun(tmp_path):
    from experiment import saving
    from experiment.checkpoint import RunState

    st = RunState()
    t, loop = _trainer(tmp_path, st, lambda line: None)
    t.cfg.keep_last = 1
    for step in (0, 1, 2):
        t.saver.begin(step, {"w": torch.ones(3)}, {}, _meta(step), background=False, context={"final": False})
        saving.finish_save(t, loop)
    assert ckpt.complete_steps(tmp_path) == [2]  # step 0 is no warmdown's start


def test_a_restore_takes_this_ranks_shard_or_a_stream_of_its_own_and_cuda_rng_only_on_cuda(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from experiment import saving
    from experiment.distributed import Dist

    states = [torch.manual_seed(s).get_state() for s in (1, 2)]
    shards = [{"rng": {"cpu": states[0], "cuda": "cuda 0"}}, {"rng": {"cpu": states[1], "cuda": "cuda 1"}}]
    loaded = []
    monkeypatch.setattr(ckpt, "load_checkpoint", lambda run_dir, step: ({"w": 1}, shards, {"state": {"step": step}}))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: loaded.append((state, str(device))))
    model = SimpleNamespace(load_state_dict=lambda state: loaded.append(state))
    opt = SimpleNamespace(load_shards=lambda s: loaded.append(len(s)))
    new = []  # ranks past the saved world: a stream of their own each, neither shard's
    for rank, world, device, expect, cuda in ((1, 2, "cpu", 1, []), (2, 3, "cpu", None, []), (3, 4, "cpu", None, []),
                                              (1, 2, "cuda", 1, [("cuda 1", "cuda:1")])):
        loaded.clear()
        st = saving.restore_checkpoint(tmp_path, 5, model, opt, Dist(rank, rank, world, torch.device(device, rank)
                                                                      if device == "cuda" else torch.device(device)))
        rng = torch.get_rng_state()
        if expect is None:
            assert not any(torch.equal(rng, s) for s in (*states, *new))
            new.append(rng)
        else:
            assert torch.equal(rng, states[expect])
        assert st.step == 5 and loaded == [{"w": 1}, 2, *cuda]


def test_a_failed_save_of_an_earlier_step_leaves_a_later_best_standing(tmp_path):
    """Step 5's periodic save is in flight when step 6's eval makes a new best; step 5's write then
    fails: the best is step 6's (its save comes next), not the last completed save's."""
    from experiment import saving
    from experiment.checkpoint import RunState

    st = RunState(step=5)
    t, loop = _trainer(tmp_path, st, lambda line: None)
    loop.saved_best = (2.0, 2, "raw", 2.0)
    ckpt.optim_path(tmp_path, 5, 0).mkdir()
    t.saver.begin(5, {"w": torch.ones(3)}, {}, _meta(5, best_step=2), background=True, context={"final": False})
    st.step, st.last_eval_step, loop.val_loss, loop.score = 6, 6, 1.5, 1.5
    st.best_val, st.best_step, st.best_score = 1.5, 6, 1.5
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step, st.best_score) == (1.5, 6, 1.5)
    # The same, with the new best's eval (step 8) made a step before the one (9) at which step 7's write failed
    st.step = 7
    ckpt.optim_path(tmp_path, 7, 0).mkdir()
    t.saver.begin(7, {"w": torch.ones(3)}, {}, _meta(7, best_step=6), background=True, context={"final": False})
    st.step, st.last_eval_step, loop.val_loss, loop.score = 8, 8, 1.4, 1.4
    st.best_val, st.best_step, st.best_score = 1.4, 8, 1.4
    st.step = 9
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step, st.best_score) == (1.4, 8, 1.4)


def test_steps_are_compared_by_value_past_the_small_ints(tmp_path, monkeypatch):
    """Step numbers in a long run are ints past 256, each its own object: `is` would never match."""
    from experiment import saving

    big = int("1000")  # a step as a run counts it: built at run time
    t, loop, _, asked = _saving_trainer(tmp_path, monkeypatch, step=big)
    loop.last_saved_step = int("1000")
    saving.maybe_save(t, loop, save_due=True, preempted=False)
    assert asked == []  # this step's save is begun already
    # a resumed step whose own eval is not the best: best.json is left alone, whatever the saved best says
    t.st.best_step, t.st.best_val, loop.last_complete_step = 998, 1.5, int("1000")
    loop.saved_best = (2.0, 997, "raw", 2.0)
    saving.maybe_save(t, loop, save_due=False, preempted=False)
    assert loop.saved_best == (2.0, 997, "raw", 2.0)
    t.st.best_step = int("1000")  # now it is: named (a resumed step's best)
    ckpt.save_checkpoint(tmp_path, 1000, {"w": torch.ones(2)}, {}, _meta(1000, best_step=997))
    saving.maybe_save(t, loop, save_due=False, preempted=False)
    assert loop.saved_best[1] == 1000 and ckpt.read_best(tmp_path)["step"] == 1000
    # a new best at a step of its own (not due, not final), also during skipped updates: saved
    for bad in (0, 2):
        t, loop, _, asked = _saving_trainer(tmp_path / f"bad{bad}", monkeypatch, step=int("1001"), bad_in_a_row=bad)
        t.st.best_step = int("1001")
        saving.maybe_save(t, loop, save_due=False, preempted=False)
        assert [a[0] for a in asked] == [1001]
        t.saver.wait()
        t.saver.complete()


def test_the_line_that_every_later_save_blocks_is_said_once_whatever_fails_after(tmp_path):
    from experiment import saving
    from experiment.checkpoint import RunState

    st, lines = RunState(), []
    t, loop = _trainer(tmp_path, st, lines.append)
    for step in (1, 2, 3):  # three failed saves: the first in the background, the next two blocking
        st.step = step
        ckpt.optim_path(tmp_path, step, 0).mkdir()
        t.saver.begin(step, {"w": torch.ones(3)}, {}, _meta(step), background=True, context={"final": False})
        saving.finish_save(t, loop, wait=True)
    assert sum("not saved" in line for line in lines) == 3
    assert sum(line.startswith("save | every later save blocks training") for line in lines) == 1


def _failing_best_save(tmp_path, saved_best=2.0, best=1.5, base=0):
    """Step 2's save completed as the best (saved_best); step 3's eval was a new best (`best`) and its
    background save is in flight and will fail. base: steps counted from there, each int made anew."""
    from experiment import saving
    from experiment.checkpoint import RunState

    st = RunState()
    t, loop = _trainer(tmp_path, st, lambda line: None)
    for step, val, fails in ((int(str(base + 2)), saved_best, False), (int(str(base + 3)), best, True)):
        st.step, st.last_eval_step, loop.val_loss, loop.score = step, step, val, val
        st.best_val, st.best_step, st.best_score = val, int(str(step)), val  # read back: equal, not the same int
        if fails:
            ckpt.optim_path(tmp_path, step, 0).mkdir()
        meta = {"step": step, "val_loss": val, "state": {"best_val": val, "best_step": step, "best_score": val},
                "world_size": 1, "model_parts": 1}
        t.saver.begin(step, {"w": torch.ones(3)}, {}, meta, background=True, context={"final": False})
        if not fails:
            saving.finish_save(t, loop, wait=True)
    return saving, st, t, loop


def test_a_failed_best_save_completed_after_a_later_eval_of_another_step_keeps_the_saved_best(tmp_path):
    """Step 3's best save fails; it completes at step 5, whose weights had no eval; step 4's eval (1.6,
    better than the saved best 2.0) was of step 4's weights, which nothing will save: the best goes back
    to step 2."""
    saving, st, t, loop = _failing_best_save(tmp_path)
    st.step, st.last_eval_step, loop.val_loss, loop.score = 4, 4, 1.6, 1.6  # step 4's eval: no new best then
    st.step = 5
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step, st.best_score) == (2.0, 2, 2.0)


def test_a_failed_best_save_completed_at_an_eval_worse_than_the_saved_best_keeps_the_saved_best(tmp_path):
    saving, st, t, loop = _failing_best_save(tmp_path)
    st.step, st.last_eval_step, loop.val_loss, loop.score = 4, 4, 2.5, 2.5  # worse than step 2's 2.0
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step, st.best_score) == (2.0, 2, 2.0)


def test_a_checkpoint_share_holds_this_ranks_part_the_average_when_asked_and_cuda_rng_only_on_cuda(monkeypatch):
    """checkpoint_share on one rank and on rank 1 of 2 (the gather of data positions stood in for):
    the model part is the whole state alone, else the parameters this rank owns; weights="average"
    takes the average's model part; the CUDA RNG state is recorded on CUDA alone."""
    from types import SimpleNamespace

    from experiment import saving
    from experiment.checkpoint import RunState
    from experiment.distributed import Dist
    from experiment.model import GPTConfig

    config = GPTConfig(vocab_size=8, depth=1, aspect_ratio=8, head_dim=8, max_seq_len=8)
    state = {"a": torch.zeros(2), "b": torch.ones(2)}
    model = SimpleNamespace(state_dict=lambda: dict(state), config=config, activation_checkpointing=False,
                            wte=SimpleNamespace(weight=torch.zeros(1)))
    average = {"a": torch.full((2,), 5.0), "b": torch.full((2,), 6.0)}
    opt = SimpleNamespace(owner={"a": 0, "b": 1}, shard_state=lambda: {"shard": 1},
                          average=SimpleNamespace(model_part=lambda s: dict(average)))
    monkeypatch.setattr(saving, "gather_objects", lambda obj, d: [obj] * d.world_size)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([7], dtype=torch.uint8))
    st = RunState(step=3)
    for rank, world, device, weights, mine in ((0, 1, "cpu", "raw", state), (1, 2, "cpu", "raw", {"b": state["b"]}),
                                               (0, 2, "cuda", "raw", {"a": state["a"]}),
                                               (0, 1, "cpu", "".join(["aver", "age"]), average)):
        d = Dist(rank, rank, world, torch.device(device, rank) if device == "cuda" else torch.device(device))
        part, shard, meta = saving.checkpoint_share(model, opt, st, 1.5, {"tag": "x"}, d, weights)
        assert part.keys() == mine.keys() and all(torch.equal(part[k], mine[k]) for k in mine)
        assert shard["shard"] == 1 and sorted(shard["rng"]) == (["cpu", "cuda"] if device == "cuda" else ["cpu"])
        assert (meta["step"], meta["val_loss"], meta["world_size"], meta["model_parts"], meta["weights"],
                meta["tag"]) == (3, 1.5, world, world, weights, "x")


def test_a_save_is_taken_to_last_the_longest_measured_else_the_estimate():
    from types import SimpleNamespace

    from experiment import saving
    from experiment.checkpoint import RunState

    t = SimpleNamespace(st=RunState(), first_save_seconds=4.0)
    assert saving.save_seconds(t) == 4.0  # none measured yet
    t.st.save_seconds = 1.5
    assert saving.save_seconds(t) == 1.5


def test_a_new_best_whose_save_then_fails_falls_back_to_the_saved_best(tmp_path, monkeypatch):
    """Through maybe_save: step 5's best save completes, step 6's eval is a new best and its save
    fails: the best goes back to step 5 (a best not yet saved is no resumed step to name)."""
    from experiment import saving

    t, loop, lines, asked = _saving_trainer(tmp_path, monkeypatch)
    t.st.best_val, t.st.best_step, t.st.best_score = 2.0, 5, 2.0
    saving.maybe_save(t, loop, save_due=False, preempted=False)
    t.saver.wait()
    saving.finish_save(t, loop)
    assert loop.last_complete_step == 5 and loop.saved_best[:2] == (2.0, 5)
    t.st.step = t.st.last_eval_step = 6
    t.st.best_val, t.st.best_step, t.st.best_score = 1.5, 6, 1.5
    ckpt.optim_path(tmp_path, 6, 0).mkdir()  # its shard cannot be written
    saving.maybe_save(t, loop, save_due=False, preempted=False)
    saving.finish_save(t, loop, wait=True)
    assert (t.st.best_val, t.st.best_step) == (2.0, 5) and ckpt.read_best(tmp_path)["step"] == 5
    assert not any(line.startswith("best.json names") for line in lines)


@pytest.mark.parametrize("base", [0, 1000])
def test_a_best_steps_own_failed_save_completed_at_that_step_keeps_the_saved_best(tmp_path, base):
    """Step 3's eval (1.5) beat step 2's saved best (2.0) and step 3's own save fails, completed at
    step 3: that eval is of weights nothing holds, so the best goes back to step 2. base=1000: steps
    as a long run counts them (ints compared by value)."""
    saving, st, t, loop = _failing_best_save(tmp_path, base=base)
    st.step = st.last_eval_step = int(str(base + 3))
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step, st.best_score) == (2.0, base + 2, 2.0)


def test_an_eval_made_while_a_best_save_was_in_flight_is_compared_by_value_past_the_small_ints(tmp_path):
    """The case of test_a_best_eval_made_while_a_failed_best_save_was_in_flight_becomes_the_best with
    steps past 256: step 1004's eval (1.8) beats the saved best once step 1003's save fails."""
    saving, st, t, loop = _failing_best_save(tmp_path, base=1000)
    st.step, loop.val_loss, loop.score = int("1004"), 1.8, 1.8
    st.last_eval_step = int("1004")
    saving.finish_save(t, loop, wait=True)
    assert (st.best_val, st.best_step, st.best_score) == (1.8, 1004, 1.8)


def test_the_exports_share_of_a_save_matches_the_bytes_it_reads_and_writes(workspace):
    """saving.export_share (the stop's room for the final export, as a share of a save) against the
    files: the export reads the best step's model file and writes best.pt; a save writes the model file
    and the optimizer shard."""
    from experiment.saving import export_share

    run_dir = workspace / "checkpoints/d2"
    step = ckpt.read_best(run_dir)["step"]
    model, meta = ckpt.load_model(run_dir / "best.pt", torch.device("cpu"))
    average = meta.get("train_config", ckpt.read_meta(run_dir, step)["train_config"])["average"] != "none"
    model_bytes = ckpt.model_path(run_dir, step).stat().st_size
    saved = model_bytes + ckpt.optim_path(run_dir, step, 0).stat().st_size
    measured = (model_bytes + (run_dir / "best.pt").stat().st_size) / saved
    share = export_share(model.float(), 1, average)
    assert 0.85 * measured < share < 1.15 * measured, (share, measured)  # the files' headers and metadata aside
