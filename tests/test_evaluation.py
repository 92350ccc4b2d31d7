"""What an eval measures: the val loss over its windows, the sample as the server decodes it, the
demo's sums (its EVAL_METRIC) counted exactly."""

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
        return iter(self.tok.encode(text)[:n])


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
