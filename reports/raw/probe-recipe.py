"""Per depth: the probe's plain step against the recipe's (ATTN_DROPOUT=0.2 + the weight average), CPU,
batch 16 x 256, interleaved, median of 5 timed steps each after one warm-up, 3 rounds."""
import statistics, sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # the repository root
from experiment.model import GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.step import forward_backward, optimizer_step
from experiment.average import WeightAverage
torch.manual_seed(0)
def setup(depth, recipe):
    c = GPTConfig(vocab_size=65, depth=depth, aspect_ratio=32, head_dim=64, max_seq_len=256, bigram_vocab=65)
    m = build_model(c, torch.device("cpu"))
    opt = ShardedOptimizer(m, **LRS, communicate=False)
    avg = None
    if recipe:
        m.set_dropout(0.0, 0.2)
        avg = WeightAverage(opt, 0.1)
    x = torch.randint(0, 65, (16, 256))
    t = [0]
    def step():
        forward_backward(m, x, x); optimizer_step(m, opt)
        t[0] += 1
        if avg: avg.update(t[0])
    return step
def med(step, n=5):
    step()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
for depth in map(int, sys.argv[1:]):
    plain, rec = setup(depth, False), setup(depth, True)
    rs = []
    for r in range(3):
        a, b = med(plain), med(rec)
        rs.append((a, b))
    pa = statistics.median(a for a, _ in rs); pb = statistics.median(b for _, b in rs)
    print(f"d{depth} plain {4096/pa:,.0f} tok/s  recipe {4096/pb:,.0f} tok/s  ratio {pb/pa:.3f}  rounds " +
          " ".join(f"{b/a:.3f}" for a, b in rs), flush=True)
