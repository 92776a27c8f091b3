"""Two nodes, simulated on one machine: two ``accelerate launch`` on loopback (``--num_machines 2 --machine_rank
{0,1} --main_process_ip 127.0.0.1``), one process each, 2-process ZeRO-3 with LoRA.

Shared storage: both nodes see one ``output_dir`` (with ``save_on_each_node``, which must not make two writers race
on it). Node-local storage: each node runs in its own mount namespace
(``unshare -m``) with a private directory bind-mounted over ``output_dir``, so each sees only what its own ranks
wrote. In each case one node's process is SIGKILLed after checkpoint-2: every process must exit in bounded time, and
the run must then resume from checkpoint-2 and finish. Node-local storage without ``save_on_each_node`` is refused
on every rank before training.
"""

import json
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from accelerate.utils.other import get_free_port
from transformers.trainer_utils import get_last_checkpoint

from tests.harness import SCRIPTS, Launch, run_command, write_accelerate_config
from trl_ext.assets import default_model_path
from trl_ext.files.audit import audit

pytestmark = pytest.mark.slow

TRAIN = ["--trainer", "sft", "--lora", "--rows", "16", "--max_steps", "4", "--save_steps", "2"]
KILL = ["--kill_at_step", "3", "--kill_rank", "1"]  # node 1's only process dies after checkpoint-2
BOUND = 120  # seconds: a run whose peer died must stop long before the collective timeout (30 minutes)


def node_config(tmp: Path, machine_rank: int) -> Path:
    path = write_accelerate_config(tmp / "configs", "zero3")
    config = yaml.safe_load(path.read_text())
    config.update(num_machines=2, machine_rank=machine_rank, main_process_ip="127.0.0.1")
    config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"  # torchrun per node, not pdsh
    node = tmp / "configs" / f"node{machine_rank}.yaml"
    node.write_text(yaml.safe_dump(config))
    return node


def two_nodes(tmp: Path, *args: str, node_local: bool) -> tuple[list[Launch], float]:
    """Launch both nodes at once; returns their results and the seconds until both had exited."""
    out, port = tmp / "out", get_free_port()  # one port for both nodes
    out.mkdir(exist_ok=True)
    results = [None, None]
    configs = [node_config(tmp, rank) for rank in (0, 1)]  # before the threads: they would write the same files

    def node(rank: int) -> None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(configs[rank]),
               "--main_process_port", str(port), str(SCRIPTS / "train.py"), *TRAIN, "--output_dir", str(out), *args]
        if node_local:
            private = tmp / f"node{rank}-disk"
            private.mkdir(exist_ok=True)
            cmd = ["unshare", "-m", "--propagation", "private", "bash", "-c",
                   f"mount --bind {shlex.quote(str(private))} {shlex.quote(str(out))} && exec {shlex.join(cmd)}"]
        results[rank] = run_command(cmd, timeout=400)

    start = time.monotonic()
    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - start


def disks(tmp: Path, node_local: bool) -> list[Path]:
    """The output directory each node sees."""
    return [tmp / f"node{rank}-disk" for rank in (0, 1)] if node_local else [tmp / "out"]


@pytest.mark.parametrize("node_local", [False, True], ids=["shared", "node-local"])
def test_two_nodes_survive_a_lost_node_and_resume(tmp_path, node_local):
    extra = ["--save_on_each_node"]  # on shared storage too: both nodes' writers must not race on one directory
    killed, seconds = two_nodes(tmp_path, *extra, *KILL, node_local=node_local)
    output = killed[0].output + killed[1].output
    assert all(r.returncode != 0 and not r.timed_out for r in killed), output[-6000:]
    assert "rank 1 SIGKILLs itself at step 3" in output, output[-6000:]
    print(f"\n{'node-local' if node_local else 'shared'}: both nodes exited {seconds:.0f} s after the start")
    # start-up, three steps and a save (50 s alone, several times that under CI's load), then the bound: long before
    # the collective timeout
    assert seconds < BOUND + 480, seconds
    for disk in disks(tmp_path, node_local):  # every node's copy: checkpoint-2 whole, nothing half-written visible
        assert get_last_checkpoint(str(disk)) == str(disk / "checkpoint-2"), sorted(p.name for p in disk.iterdir())
        assert (disk / "checkpoint-2" / "latest").read_text() == "global_step2"
    report = audit(str(disks(tmp_path, node_local)[0] / "checkpoint-2"), base=default_model_path())
    assert report.ok, report.format()

    resumed, _ = two_nodes(tmp_path, *extra, "--resume", node_local=node_local)
    assert all(r.returncode == 0 for r in resumed), (resumed[0].output + resumed[1].output)[-6000:]
    for disk in disks(tmp_path, node_local):
        assert get_last_checkpoint(str(disk)) == str(disk / "checkpoint-4")
        assert not [p.name for p in disk.iterdir() if p.name.startswith(".")], "a partial directory was left behind"

    report = json.loads((disks(tmp_path, node_local)[0] / "report_rank0.json").read_text())
    assert report["global_step"] == 4 and report["steps_run_here"] == 2 and report["world_size"] == 2


def test_node_local_storage_without_save_on_each_node_is_refused_before_training(tmp_path):
    refused, _ = two_nodes(tmp_path, node_local=True)
    output = refused[0].output + refused[1].output
    assert all(r.returncode != 0 and not r.timed_out for r in refused), output[-6000:]
    line = "is not shared between the nodes (each node sees its own): checkpoints would be split across nodes"
    assert all(line in r.output for r in refused), output[-6000:]  # on every rank, before any step
    assert "set save_on_each_node=True" in output and "'loss'" not in output
    assert not any(p.name.startswith("checkpoint-") for d in disks(tmp_path, True) for p in d.iterdir())
