"""The built-in demo's EVAL_METRIC (experiment/metric.py), and an example of one: of 50 sums drawn
apart from the training text, the fraction the model completes exactly, greedy.

    EVAL_METRIC=experiment/demo_metric.py:sums
"""

from experiment.dataloader import demo_lines

HELD_OUT_SEED = 99  # the training text is drawn with another seed
N_SUMS = 50


def sums(generate, tokenizer) -> dict[str, float]:
    correct = 0
    for line in demo_lines(N_SUMS, seed=HELD_OUT_SEED):
        prompt, answer = line.split("=")
        # In the corpus a line follows a newline (BOS only opens the file), so the prompt does too;
        # room for the answer and the newline that ends it, no more.
        out = generate("\n" + prompt + "=", max_tokens=len(answer) + 1, stop="\n")
        correct += out == answer.strip()
    return {"sums_correct": correct / N_SUMS}
