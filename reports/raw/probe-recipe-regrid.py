"""The rule asked again at the recipe's rate: argv d2 d4 d6 d8 ratios, the grid's jsonl, [the code corpus's vocabulary]."""
import json, sys, collections
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # the repository root
from experiment import autosize
from experiment.model import GPTConfig
VOCAB = {"code": int(sys.argv[6]) if len(sys.argv) > 6 else 65}
ratio = {2: float(sys.argv[1]), 4: float(sys.argv[2]), 6: float(sys.argv[3]), 8: float(sys.argv[4])}
cells = collections.defaultdict(dict); autos = {}
for line in open(sys.argv[5]):
    r = json.loads(line)
    key = (r["corpus"], r["chars"], r["seconds"])
    if r["run"] == "auto" and r.get("candidates"):
        autos[key] = r
    elif r["run"].startswith("d"):
        cells[key][r["depth"]] = r
same = 0; n = 0
for key, runs in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
    if key not in autos: print(key, "no auto row"); continue
    rates = {int(k[1:]): v for k, v in autos[key]["candidates"].items()}
    best = min(r["served"] for r in runs.values())
    picks = []
    for scale in (False, True):
        cands = [autosize.candidate(GPTConfig(vocab_size=VOCAB.get(key[0], 65), depth=d, aspect_ratio=32, head_dim=64, max_seq_len=256),
                                    rate / (ratio[d] if scale else 1), key[2], runs[min(runs)]["train_tokens"], 4096, True)
                 for d, rate in sorted(rates.items())]
        picks.append(autosize.choose(cands).depth)
    regret = [runs[p]["served"] / best - 1 if p in runs else float("nan") for p in picks]
    n += 1; same += picks[0] == picks[1]
    print(key, f"old d{picks[0]} {regret[0]:+.1%}", f"new d{picks[1]} {regret[1]:+.1%}", "" if picks[0] == picks[1] else "CHANGED")
print("same", same, "of", n)
