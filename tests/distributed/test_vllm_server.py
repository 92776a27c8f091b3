"""vLLM server mode that never hangs: 2-process GRPO (LoRA) against a real HTTP server that stops answering.

The server (tests/vllm_server_standin.py) answers steps 1 and 2, then, at step 3:
- under ZeRO-3, stalls on the generation request: rank 0's request times out after ``vllm_request_timeout``;
- under FSDP2, closes the connection of the weight update, and its receiving side stops reading: the transfer (NCCL's
  stand-in, which waits without a timeout as NCCL does) blocks, and the watchdog ends the process.

Each time every process stops within the bound, the message names the server and the step, checkpoint-2 (saved
before the failure) audits clean and nothing of step 3 was written; the two good syncs sent the checkpoint's names.
Without the bounds both runs hang until the launch's timeout.
"""

import time
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.harness import SCRIPTS, accelerate_launch, write_accelerate_config
from tests.vllm_server_standin import Fault, StandInServer
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow
pytest.importorskip("requests")

TIMEOUT = 3  # vllm_request_timeout in these runs
WATCHDOG_GRACE = 30  # trl_ext.trainers.vllm_server.WATCHDOG_GRACE
EXIT_ALLOWANCE = 45  # seconds for the processes to end once rank 0 has failed (interpreter and launcher teardown)

CASES = {
    "zero3": (Fault("/v1/completions", 3, "stall"), "generating", TIMEOUT),
    "fsdp2": (Fault("/update_weights", 3, "close"), "the weight sync", TIMEOUT + WATCHDOG_GRACE),
}


def checkpoint_names() -> set[str]:
    names = set()
    for file in Path(default_model_path()).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


@pytest.mark.parametrize("backend", list(CASES))
def test_a_server_that_stops_answering_stops_every_rank_within_the_bound(backend, tmp_path):
    fault, doing, bound = CASES[backend]
    out = tmp_path / "run"
    config = write_accelerate_config(tmp_path / "configs", backend)
    with StandInServer(faults=(fault,)) as server:
        result = accelerate_launch(
            SCRIPTS / "grpo_train.py",
            ["--output_dir", str(out), "--max_steps", "4", "--save_steps", "2", "--vllm_server", server.url,
             "--request_timeout", str(TIMEOUT)], config, timeout=240)
        ended = time.monotonic()
    assert not result.timed_out, result.output[-6000:]
    assert result.returncode != 0
    assert len(server.fault_times) == 1, server.counts
    assert ended - server.fault_times[0][1] < bound + EXIT_ALLOWANCE

    # one message, on the rank that talks to the server, naming the server, what it was doing and the step
    assert f"the vLLM server at {server.url}" in result.output or f"vLLM server {server.url}:" in result.output
    assert f"While {doing}, at training step 3" in result.output or (
        f"did not finish {doing} within {bound} s" in result.output and "at training step 3" in result.output)

    # the last checkpoint intact, nothing of step 3
    assert audit(str(out / "checkpoint-2"), base=default_model_path()).ok
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]

    # only rank 0 talks to the server, once per step; each good sync sent the checkpoint's names, merged
    assert server.counts["/v1/completions"] == (3 if backend == "zero3" else 2)
    names = [name for name, _ in server.received]
    per_sync = len(checkpoint_names())
    assert set(names[:2 * per_sync]) == checkpoint_names() and len(names) >= 2 * per_sync
