"""Load the bundled arithmetic datasets as a ``DatasetDict`` with ``train`` and ``test`` splits."""

import os
import re
import shutil
import tempfile
from pathlib import Path

from datasets import DatasetDict, load_dataset

from trl_ext.errors import DatasetError

DATA_DIR = Path(__file__).parent / "data"
# sft: conversational "messages"; preference: prompt/chosen/rejected (DPO); reward: chosen/rejected;
# prompt: prompt/answer (GRPO, RLOO: the answer feeds a verifiable reward), derived from the preference files;
# unpaired: prompt/completion/label (KTO), the preference files unpaired by TRL;
# prompt-1digit: its rows whose operands are both under 10, a task space small enough for RL to revisit each prompt.
DATASET_KINDS = ("sft", "preference", "reward", "unpaired", "prompt", "prompt-1digit")
DATASET_NAMES = {f"trl-ext/arithmetic-{kind}": kind for kind in DATASET_KINDS}


def load_default_dataset(kind: str) -> DatasetDict:
    if kind not in DATASET_KINDS:
        raise DatasetError(f"Unknown bundled dataset {kind!r}; choose one of {', '.join(DATASET_KINDS)}.")
    if kind == "prompt-1digit":  # same split as "prompt", so held-out texts stay out of training (and of SFT's)
        return load_default_dataset("prompt").filter(
            lambda row: all(int(n) < 10 for n in re.findall(r"\d+", row["prompt"][0]["content"])))
    if kind == "unpaired":
        from trl.data_utils import unpair_preference_dataset

        return DatasetDict({split: unpair_preference_dataset(rows) for split, rows in
                            load_default_dataset("preference").items()})
    if kind == "prompt":
        pairs = load_default_dataset("preference")
        return pairs.map(lambda row: {"answer": row["chosen"][0]["content"]}, remove_columns=["chosen", "rejected"])
    files = {split: str(DATA_DIR / f"{kind}_{split}.jsonl") for split in ("train", "test")}
    return load_dataset("json", data_files=files)


def load_dataset_by_name(name: str, config: str | None = None) -> DatasetDict:
    """``trl-ext/arithmetic-{sft,preference,reward,unpaired,prompt,prompt-1digit}`` load the bundled data and
    ``trl-ext/shapes-{sft,preference}`` generate the bundled image data; anything else goes to ``load_dataset``."""
    from trl_ext.assets.shapes import SHAPES_NAMES, load_shapes

    if name in SHAPES_NAMES:
        return load_shapes(SHAPES_NAMES[name])
    if name in DATASET_NAMES:
        return load_default_dataset(DATASET_NAMES[name])
    return load_dataset(name, config)


def embedded_dataset_dir(name: str) -> str | None:
    """A bundled dataset's name as a local directory that plain ``datasets.load_dataset(directory)`` loads into the
    same rows and splits (one Parquet file per split, written once per machine in the asset cache), for code that
    loads datasets itself: TRL's scripts under ``trl-ext <command>``. None for any other name.

    Args:
        name: a dataset name (``trl-ext/arithmetic-preference``, ``trl-ext/shapes-sft``, ...).

    Returns:
        The directory, or None when ``name`` is not a bundled dataset.
    """
    from trl_ext.assets.cache import cache_root
    from trl_ext.assets.shapes import SHAPES_NAMES

    if name not in DATASET_NAMES and name not in SHAPES_NAMES:
        return None
    target = cache_root() / "datasets" / name.replace("/", "--")
    if (target / "train.parquet").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for split, rows in load_dataset_by_name(name).items():
            rows.to_parquet(str(tmp / f"{split}.parquet"))
        try:
            os.rename(tmp, target)  # one rename: a concurrent writer's finished copy is as good
        except OSError:
            if not (target / "train.parquet").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
