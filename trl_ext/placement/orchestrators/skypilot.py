"""SkyPilot's variables: its nodes' addresses, this node's rank, the GPUs per node, the task's id (kept across a
managed job's recoveries)."""

from trl_ext.errors import UsageError
from trl_ext.placement.orchestrators.job import Job, integer, meeting_port, node_rank, value


def read() -> Job | None:
    """The SkyPilot task this process runs in (one process per node), or None."""
    if value("SKYPILOT_NODE_RANK") is None or value("SKYPILOT_NODE_IPS") is None:
        return None
    ips = [line.strip() for line in value("SKYPILOT_NODE_IPS").splitlines() if line.strip()]
    nodes = integer("SKYPILOT_NUM_NODES", value("SKYPILOT_NUM_NODES") or str(len(ips)), minimum=1)
    if len(ips) != nodes:
        raise UsageError(f"SKYPILOT_NODE_IPS lists {len(ips)} address(es) but SKYPILOT_NUM_NODES={nodes}; check the "
                         "task's environment.", every_rank=True)
    rank = node_rank("SKYPILOT_NODE_RANK", value("SKYPILOT_NODE_RANK"), nodes, "SKYPILOT_NUM_NODES")
    gpus = integer("SKYPILOT_NUM_GPUS_PER_NODE", value("SKYPILOT_NUM_GPUS_PER_NODE") or "0")
    run = f"skypilot-{value('SKYPILOT_TASK_ID')}" if value("SKYPILOT_TASK_ID") else None  # kept across recoveries
    return Job("SkyPilot", per_rank=False, nodes=nodes, node_rank=rank, address=ips[0], port=meeting_port(run),
               per_node=gpus or None, run=run, source="SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES")
