"""What an eval measures: the val loss over its windows, the sample as the server decodes it, the
demo's sums (its EVAL_METRIC) counted exactly."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config

from experiment.batches import val_batches
from experiment.dataloader import demo_lines, prepare, write_demo_corpus
from experiment.distributed import Dist
from experiment.engine import generate
from experiment import demo_metric, metric
from experiment.evaluation import evaluate, sample_text
from experiment.model import build_model

CPU = Dist(0, 0, 1, torch.device("cpu"))


def _demo(tmp_path):
    prepared = prepare(write_demo_corpus(tmp_path / "data", n_lines=3000).parent, tmp_path, max_seq_len=32)
    return prepared, build_model(tiny_config(vocab_size=prepared.meta["vocab_size"], bigram=True), seed=5)


def test_the_val_loss_is_the_mean_token_loss_over_the_eval_windows(tmp_path):
    prepared, model = _demo(tmp_path)
    val = prepared.tokens("val")
    with torch.no_grad():  # an independent sum: every eval window's tokens, each once
        batches = list(val_batches(val, 32, 4, 2048))
        total = sum(F.cross_entropy(model(x).reshape(-1, model.config.vocab_size), y.reshape(-1), reduction="sum")
                    for x, y in batches)
        count = sum(y.numel() for _, y in batches)
    expected = (total / count).item()
    loss, _, _ = evaluate(model, prepared, 32, 4, 2048, CPU)
    assert abs(loss - expected) < 1e-6 and len(batches) > 1


def test_the_eval_sample_is_the_servers_decoding_at_seed_0_and_temperature_0_8(tmp_path):
    prepared, model = _demo(tmp_path)
    with torch.no_grad():  # a head far from uniform, so the temperature shows in the draws
        model.lm_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    tok, prompt = prepared.tokenizer(), prepared.tokens("val")[:8].tolist()
    model.eval()
    expected = list(generate(model, prompt, 24, temperature=0.8, generator=torch.Generator().manual_seed(0),
                             allowed_vocab=tok.n_real))
    model.train()
    assert sample_text(model, tok, prompt, 24) == tok.decode(expected)


class _Answers:
    """A stand-in model that completes the first `right` held-out sums exactly (answer, then a
    newline, in the tokens it was asked for) and the rest wrongly."""

    def __init__(self, tok, right):
        self.tok, self.right, self.training, self.calls = tok, right, True, []

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def generate(self, ids, n, **kwargs):
        answer = self.lines[len(self.calls)].split("=")[1].strip()
        self.calls.append(n)
        wrong = answer + "9" if len(self.calls) % 2 else answer[:-1]  # above and below it, as text
        text = (answer if len(self.calls) <= self.right else wrong) + "\n"
        yield from self.tok.encode(text)[:n]  # a generator, as GPT.generate is


def test_the_demo_counts_exactly_the_sums_completed_within_their_length_plus_a_newline(tmp_path, monkeypatch):
    prepared, _ = _demo(tmp_path)
    tok = prepared.tokenizer()
    for right in (0, 3, 10):
        model = _Answers(tok, right)
        model.lines = list(demo_lines(10, seed=99))
        monkeypatch.setattr(demo_metric, "N_SUMS", 10)
        assert metric.measure(demo_metric.sums, model, tok, 60) == ({"sums_correct": right / 10}, None)
        # room for the answer and the newline that ends it, no more
        assert model.calls == [len(line.split("=")[1]) + 1 for line in model.lines]


def _sources(val_tokens=1000):
    """A prepared stand-in of two sources: a's val tokens [0, 600) of 900 characters, b's [600, 1000)
    of 400; the split's 1,300 characters."""
    splits = [{"name": "a", "val": [0, 600], "val_chars": 900}, {"name": "b", "val": [600, val_tokens], "val_chars": 400}]
    return {"split": {"val_tokens": val_tokens, "val_chars": 1300}, "source_splits": splits}


def test_each_source_is_evaluated_for_its_weight_of_the_eval_tokens_and_one_window_at_least():
    from types import SimpleNamespace

    from experiment.evaluation import eval_parts
    prepared = SimpleNamespace(meta=_sources())
    whole = [({"name": None, "val": [0, 1000], "val_chars": 1300}, 1.0, 320)]
    assert eval_parts(prepared, 320, 32) == whole  # no weights: the whole split
    assert eval_parts(prepared, 20, 32)[0][2] == 32  # one window at least
    a, b = prepared.meta["source_splits"]
    assert eval_parts(prepared, 320, 32, [0.75, 0.25]) == [(a, 0.75, 240), (b, 0.25, 80)]
    assert eval_parts(prepared, 320, 32, [0.95, 0.05]) == [(a, 0.95, 304), (b, 0.05, 32)]
    prepared.meta["source_splits"] = []  # one source: weights say nothing
    assert eval_parts(prepared, 320, 32, [1.0]) == whole


def test_the_eval_coverage_counts_the_windows_read_of_the_whole_ones():
    from types import SimpleNamespace

    from experiment.evaluation import eval_coverage
    prepared = SimpleNamespace(meta=_sources())
    # 999 // 32 = 31 whole windows: 320 tokens read 10 of them; 2,048 would read all 31
    assert eval_coverage(prepared, 320, 32) == (320, 1000, False)
    assert eval_coverage(prepared, 2048, 32) == (31 * 32, 1000, True)
    assert eval_coverage(prepared, 31 * 32, 32) == (31 * 32, 1000, True)
    # by source: a reads 240 // 32 = 7 of its 18, b 80 // 32 = 2 of its 12
    assert eval_coverage(prepared, 320, 32, [0.75, 0.25]) == (9 * 32, 1000, False)
    # all of both: a 18 windows, b 12
    assert eval_coverage(prepared, 4096, 32, [0.5, 0.5]) == (30 * 32, 1000, True)
    assert eval_coverage(prepared, 4096, 32, [0.99, 0.01]) == (19 * 32, 1000, False)  # b reads 1 of 12


def test_with_several_sources_the_loss_and_bpc_are_the_weighted_means_of_theirs(tmp_path):
    import math
    from types import SimpleNamespace

    from experiment.evaluation import _val_loss
    real, model = _demo(tmp_path)
    val = real.tokens("val")
    n, half = len(val), len(val) // 2
    a_chars = 5 * half // 2  # about 2.5 characters a token
    meta = {"split": {"val_tokens": n, "val_chars": 3 * n},
            "source_splits": [{"name": "a", "val": [0, half], "val_chars": a_chars},
                              {"name": "b", "val": [half, n], "val_chars": 4 * (n - half)}]}
    prepared = SimpleNamespace(meta=meta, tokens=real.tokens)
    la, lb = _val_loss(model, val[:half], 32, 4, 192, CPU), _val_loss(model, val[half:], 32, 4, 64, CPU)
    assert la != lb
    grad_enabled = []
    model.register_forward_hook(lambda *args: grad_enabled.append(torch.is_grad_enabled()))
    loss, bpc, by_source = evaluate(model, prepared, 32, 4, 256, CPU, [0.75, 0.25])
    assert grad_enabled and not any(grad_enabled)  # no autograd graph: an eval holds no activations
    assert by_source == {"a": la, "b": lb}
    assert loss == 0.75 * la + 0.25 * lb
    # each source's bits per character: its loss in bits over its characters per token (2.5 and 4)
    assert bpc == pytest.approx(0.75 * la / math.log(2) / (a_chars / half) + 0.25 * lb / math.log(2) / 4, rel=1e-12)
    whole, whole_bpc, none = evaluate(model, prepared, 32, 4, 256, CPU)
    assert none is None and whole == _val_loss(model, val, 32, 4, 256, CPU)
    assert whole_bpc == pytest.approx(whole / math.log(2) / 3, rel=1e-12)


def test_an_eval_leaves_the_model_in_the_mode_it_found_it_even_on_an_error(tmp_path):
    from experiment.evaluation import evaluating
    _, model = _demo(tmp_path)
    for mode in (True, False):
        model.train(mode)
        with evaluating(model) as m:
            assert m is model and not model.training
        assert model.training is mode
    model.train()
    with pytest.raises(RuntimeError), evaluating(model):
        raise RuntimeError("an eval that fails")
    assert model.training
