"""Bundled image datasets ``trl-ext/shapes-sft`` and ``trl-ext/shapes-preference``, generated at load time.

Each image (32x32, PIL) holds one filled shape (square, circle or triangle) of one of four colours, in the left or the
right half. A question asks for its colour or its side, and the answer is one word. The tiny VLM learns both within a
couple of CPU minutes, so a demo shows held-out accuracy rising. Nothing is stored in the package: the same seed gives
the same pixels and rows on every machine. Rows follow TRL's vision formats: ``messages`` (SFT) or
``prompt``/``chosen``/``rejected`` (DPO) with ``{"type": "image"}`` content parts, plus an ``images`` column.
"""

import random

from datasets import Dataset, DatasetDict, Features, Image, Sequence, Value

from trl_ext.errors import DatasetError

SHAPES_NAMES = {"trl-ext/shapes-sft": "sft", "trl-ext/shapes-preference": "preference"}
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 235), "yellow": (235, 215, 40)}
SIDES = ("left", "right")
KINDS = ("square", "circle", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "side": "Is the shape on the left or the right?"}
SIZE = 32
N_TRAIN, N_TEST = 480, 64


def draw(colour: str, side: str, kind: str, rng: random.Random):
    """One 32x32 RGB image: a shape of ``colour`` in the ``side`` half, at a random place and size, on grey."""
    from PIL import Image as PILImage
    from PIL import ImageDraw

    image = PILImage.new("RGB", (SIZE, SIZE), (90, 90, 90))
    pen = ImageDraw.Draw(image)
    r = rng.randint(4, 6)
    x = rng.randint(r, SIZE // 2 - r - 1) + (SIZE // 2 if side == "right" else 0)
    y = rng.randint(r, SIZE - r - 1)
    box = (x - r, y - r, x + r, y + r)
    fill = COLOURS[colour]
    if kind == "square":
        pen.rectangle(box, fill=fill)
    elif kind == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return image


def _samples(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        colour, side, kind = rng.choice(list(COLOURS)), rng.choice(SIDES), rng.choice(KINDS)
        topic = rng.choice(list(QUESTIONS))
        answer = colour if topic == "colour" else side
        wrong = rng.choice([c for c in COLOURS if c != colour]) if topic == "colour" else SIDES[1 - SIDES.index(side)]
        rows.append(dict(image=draw(colour, side, kind, rng), question=QUESTIONS[topic], answer=answer, wrong=wrong))
    return rows


def _user(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": question}]}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


_MESSAGE = [{"role": Value("string"), "content": [{"type": Value("string"), "text": Value("string")}]}]


def load_shapes(kind: str, seed: int = 0) -> DatasetDict:
    """Generate the shapes data set.

    Args:
        kind: "sft" (``messages`` + ``images``) or "preference" (``prompt``/``chosen``/``rejected`` + ``images``).
        seed: The generator's seed; the bundled names use 0.

    Returns:
        A ``DatasetDict`` with ``train`` (480 rows) and ``test`` (64 rows) splits.
    """
    if kind not in ("sft", "preference"):
        raise DatasetError(f"Unknown shapes dataset {kind!r}; choose 'sft' or 'preference'.")
    rng = random.Random(seed)
    splits = {}
    for split, n in (("train", N_TRAIN), ("test", N_TEST)):
        samples = _samples(n, rng)
        images = {"images": [[s["image"]] for s in samples]}
        if kind == "sft":
            columns = {"messages": [_user(s["question"]) + _assistant(s["answer"]) for s in samples], **images}
            features = Features({"messages": _MESSAGE, "images": Sequence(Image())})
        else:
            columns = {"prompt": [_user(s["question"]) for s in samples],
                       "chosen": [_assistant(s["answer"]) for s in samples],
                       "rejected": [_assistant(s["wrong"]) for s in samples], **images}
            features = Features({"prompt": _MESSAGE, "chosen": _MESSAGE, "rejected": _MESSAGE,
                                 "images": Sequence(Image())})
        splits[split] = Dataset.from_dict(columns, features=features)
    return DatasetDict(splits)


def answer_accuracy(model, processor, dataset, max_new_tokens: int = 8, batch_size: int = 32) -> float:
    """Share of rows whose greedy answer (one process, no sampling) equals the reference answer.

    Args:
        model: An image-text-to-text model (or a PEFT model around one).
        processor: Its processor.
        dataset: A ``trl-ext/shapes-sft`` split (``messages`` with the answer last, and ``images``).
        max_new_tokens: Generation length; the answers are one word (a few byte-level tokens).
        batch_size: Rows per generation batch.

    Returns:
        The exact-match accuracy, between 0 and 1.
    """
    import torch

    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues after the prompt
    correct = 0
    try:
        for start in range(0, len(dataset), batch_size):
            rows = dataset[start:start + batch_size]
            prompts = [processor.apply_chat_template(m[:-1], add_generation_prompt=True) for m in rows["messages"]]
            batch = processor(images=rows["images"], text=prompts, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
            answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            for answer, messages in zip(answers, rows["messages"]):
                correct += answer.strip() == messages[-1]["content"][0]["text"]
    finally:
        tokenizer.padding_side = side
    return correct / len(dataset)
