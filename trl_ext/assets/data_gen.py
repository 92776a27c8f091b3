"""Regenerate the bundled arithmetic datasets (``python -m trl_ext.assets.data_gen``).

The task: single- and two-digit addition. A tiny model learns to prefer the correct sum over a wrong one within a
couple of CPU minutes, so demos show reward accuracy rising. Output is deterministic (fixed seed).
"""

import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
TEMPLATES = ["What is {a}+{b}?", "Compute {a} + {b}.", "{a} plus {b} equals?"]


def _problems(rng: random.Random):
    problems = [(a, b, t) for a in range(20) for b in range(20) for t in TEMPLATES]
    rng.shuffle(problems)
    return problems


def _wrong(rng: random.Random, a: int, b: int) -> int:
    """A typical mistake: multiplying, subtracting, or being off by one or ten."""
    candidates = {a * b, abs(a - b), a + b + 1, a + b + 10, max(a + b - 1, 0)} - {a + b}
    return rng.choice(sorted(candidates))


def build(seed: int = 0) -> dict[str, dict[str, list[dict]]]:
    rng = random.Random(seed)
    problems = _problems(rng)
    n_test = len(problems) // 10
    splits = {"test": problems[:n_test], "train": problems[n_test:]}
    out: dict[str, dict[str, list[dict]]] = {"sft": {}, "preference": {}, "reward": {}}
    for split, rows in splits.items():
        sft, pref, reward = [], [], []
        for a, b, template in rows:
            question = template.format(a=a, b=b)
            good, bad = str(a + b), str(_wrong(rng, a, b))
            user = {"role": "user", "content": question}
            sft.append({"messages": [user, {"role": "assistant", "content": good}]})
            pref.append(
                {
                    "prompt": [user],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                }
            )
            reward.append(
                {
                    "chosen": [user, {"role": "assistant", "content": good}],
                    "rejected": [user, {"role": "assistant", "content": bad}],
                }
            )
        out["sft"][split], out["preference"][split], out["reward"][split] = sft, pref, reward
    return out


def main() -> None:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for name, splits in build().items():
        for split, rows in splits.items():
            path = DATA_DIR / f"{name}_{split}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
            print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
