"""examples/quickstart.ipynb, run as a user runs it in Jupyter: every cell in a real kernel, then every cell again in
the same kernel (leftover distributed state, loaded models and existing output directories must not break the
second run). Any cell error fails the test; the artifacts of both runs must exist and pass the audit.
"""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from trl_ext.files.audit import audit

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"
# Directories each run writes (one per training cell), and the kind of checkpoint each must hold.
ARTIFACTS = {"sft": "adapter", "reward": "adapter", "dpo": "adapter", "sft-merged": "full", "sft-vlm": "adapter",
             "sft-zero3": "adapter"}

pytestmark = pytest.mark.slow  # the last cell trains on 2 processes (ZeRO-3)


def _text(cell) -> str:
    return "".join(out.get("text", "") + "".join(out.get("data", {}).get("text/plain", ""))
                   for out in cell.get("outputs", []))


def test_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_quickstart_runs_twice_in_one_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXT_NOTEBOOK_DIR", str(tmp_path))  # read by the first cell: outputs go here
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(tmp_path)}})
    outputs = []
    with client.setup_kernel():
        for _ in range(2):
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)  # raises CellExecutionError, with the traceback, on any error
            outputs.append("\n".join(_text(c) for c in nb.cells))

    runs = sorted(tmp_path.glob("notebook-*"))
    assert len(runs) == 2, runs
    for run, text in zip(runs, outputs):
        for name, kind in ARTIFACTS.items():
            (found,) = [d for d in run.glob(f"{name}-*") if d.name.rsplit("-", 1)[0] == name]
            report = audit(str(found))
            assert report.ok and report.kind == kind, report.format()
        assert "'processes': 2, 'zero_stage': 3" in text  # the launch cell really ran on 2 ZeRO-3 processes
        assert "'partitioned': '0 of" not in text
        assert "Launching training on" not in text  # accelerate's guess ("2 CUDAs" on CPU); trl_ext says what runs
        assert "[trl_ext] launch: 2 processes, DeepSpeed ZeRO-3" in text
    reward_config = next(runs[1].glob("reward-*")) / "adapter_config.json"
    assert '"SEQ_CLS"' in reward_config.read_text()
    sft_cell = next(c for c in nb.cells if c.cell_type == "code" and "SFT with LoRA" in c.source)
    assert any("image/png" in out.get("data", {}) for out in sft_cell.outputs)  # the inline loss plot
    vlm_cell = next(c for c in nb.cells if c.cell_type == "code" and "trl-ext/tiny-vlm" in c.source)
    accuracy = re.search(r"held-out answer accuracy: 0.00 -> ([\d.]+)", _text(vlm_cell))
    assert accuracy and float(accuracy.group(1)) >= 0.3, _text(vlm_cell)  # 0.66 measured
    assert any("image/png" in out.get("data", {}) for out in vlm_cell.outputs)  # the test image and its answer
    dpo_cell = next(c for c in nb.cells if c.cell_type == "code" and "DPOTrainer(" in c.source)
    moved = re.search(r"rewards/accuracies: 0.000 before training, ([\d.]+) after", _text(dpo_cell))
    assert moved and float(moved.group(1)) >= 0.6, _text(dpo_cell)  # 0.788 measured: a change a person can see
