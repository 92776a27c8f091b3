"""Kubernetes' variables: torchrun's ``PET_*`` in a pod whose command is the recipe (Kubeflow Trainer and PyTorchJob
set them; a JobSet or plain indexed Job manifest can too), and a LeaderWorkerSet's ``LWS_*``."""

import ipaddress
import re
import socket

from trl_ext.errors import UsageError
from trl_ext.placement.orchestrators.job import (
    C10D_PORT,
    TORCHRUN_PORT,
    Job,
    integer,
    meeting_port,
    node_rank,
    per_node,
    port,
    value,
)

# Kubeflow Trainer's first node: <trainjob>-node-0-0.<trainjob> (its torch plugin's PET_MASTER_ADDR)
_TRAINJOB = re.compile(r"^(?P<name>[a-z0-9-]+)-node-0-0\.(?P=name)(\.|$)")


def _is_name(address: str | None) -> bool:
    """Whether ``address`` is a host name (stable across a Kubernetes job's pods) rather than an IP address."""
    if not address or address == "localhost":
        return False
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return True
    return False


def _run(address: str | None) -> str | None:
    """A Kubernetes job's identity: the JobSet's name where the manifest passes it on (``JOBSET_NAME``), the TrainJob's
    name in Kubeflow Trainer's first-node address, else that address itself when it is a name (a PyTorchJob's
    ``<job>-master-0``): each stays the same when the job's pods are recreated."""
    if value("JOBSET_NAME"):
        return f"jobset-{value('JOBSET_NAME')}"
    if address and (match := _TRAINJOB.match(address)):
        return f"trainjob-{match.group('name')}"
    return f"k8s-{address.split('.')[0]}" if _is_name(address) else None


def kubeflow() -> Job | None:
    """torchrun's own variables in a pod whose command is not torchrun (Kubeflow Trainer and PyTorchJob set them; a
    JobSet or plain Job manifest can too). The node rank falls back to an indexed Job's ``JOB_COMPLETION_INDEX``. A
    range ``PET_NNODES=MIN:MAX``, or a PyTorchJob's elastic policy (``PET_RDZV_ENDPOINT`` without a node rank), is an
    elastic job (``_elastic``)."""
    nodes_text = value("PET_NNODES")
    rank_name = "PET_NODE_RANK" if value("PET_NODE_RANK") else "JOB_COMPLETION_INDEX"
    if not nodes_text or not (value(rank_name) or value("PET_RDZV_ENDPOINT") or ":" in nodes_text):
        return None
    if ":" in nodes_text or not value(rank_name):
        return _elastic(nodes_text)
    nodes = integer("PET_NNODES", nodes_text, minimum=1)
    rank = node_rank(rank_name, value(rank_name), nodes, "PET_NNODES")
    if rank_name == "JOB_COMPLETION_INDEX" and nodes > 1:
        _refuse_jobset_replicas(rank, value("PET_MASTER_ADDR") or value("MASTER_ADDR"))
    address = value("PET_MASTER_ADDR") or value("MASTER_ADDR")
    if nodes > 1 and not address:
        raise UsageError("PET_MASTER_ADDR is not set: with PET_NNODES > 1 every pod needs the first pod's address.",
                         every_rank=True)
    port_text = value("PET_MASTER_PORT") or value("MASTER_PORT")
    return Job("Kubeflow", per_rank=False, nodes=nodes, node_rank=rank, address=address,
               port=port("PET_MASTER_PORT", port_text) if port_text else TORCHRUN_PORT,
               per_node=_per_node(), run=_run(address), source="PET_NNODES, " + rank_name)


def _per_node() -> int | None:
    # a PyTorchJob's elastic policy names it PET_N_PROC_PER_NODE, which torchrun itself does not read
    name = "PET_NPROC_PER_NODE" if value("PET_NPROC_PER_NODE") else "PET_N_PROC_PER_NODE"
    return per_node(name, value(name))


def _elastic(nodes_text: str) -> Job:
    """An elastic job: its pods meet in torchrun's c10d rendezvous at ``PET_RDZV_ENDPOINT`` (``host[:port]``, port
    29400 by default, as torchrun's), else at the first pod's ``PET_MASTER_ADDR``, and it numbers them. Its run is
    ``PET_RDZV_ID`` where the job names one (as torchrun's ranks call it), else the first pod's name."""
    low, _, high = nodes_text.partition(":")
    most = integer("PET_NNODES", high or low, minimum=1)
    fewest = integer("PET_NNODES", low, minimum=1)
    if fewest > most:
        raise UsageError(f"PET_NNODES={nodes_text!r}: the fewest machines is above the most; give MIN:MAX.",
                         every_rank=True)
    endpoint = value("PET_RDZV_ENDPOINT")
    if endpoint:
        address, _, port_text = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        name, port_text = "PET_RDZV_ENDPOINT", port_text or str(C10D_PORT)
    else:
        address = value("PET_MASTER_ADDR") or value("MASTER_ADDR")
        name, port_text = "PET_MASTER_PORT", value("PET_MASTER_PORT") or value("MASTER_PORT") or str(C10D_PORT)
    if not address:
        raise UsageError(f"PET_NNODES={nodes_text} is an elastic job, and neither PET_RDZV_ENDPOINT nor "
                         "PET_MASTER_ADDR says where its pods meet; set one to the first pod's address.",
                         every_rank=True)
    rdzv_id = value("PET_RDZV_ID")
    restarts = value("PET_MAX_RESTARTS")
    return Job("Kubeflow", per_rank=False, nodes=most, min_nodes=fewest, address=address,
               port=port(name, port_text), per_node=_per_node(),
               run=f"torchrun-{rdzv_id}" if rdzv_id and rdzv_id != "none" else _run(address),
               max_restarts=integer("PET_MAX_RESTARTS", restarts) if restarts else None,
               rendezvous_conf=value("PET_RDZV_CONF") or "", host=value("HOSTNAME"),  # the pod's name
               source="PET_NNODES (elastic), " + name)


def _refuse_jobset_replicas(completion_index: int, address: str | None) -> None:
    """A JobSet of ``replicas: N`` Jobs of one pod each gives every pod ``JOB_COMPLETION_INDEX=0`` (its index in its
    own Job): every pod would act as machine 0 and the first would wait for the others in vain. JobSet names each pod's
    host ``<jobset>-<replicatedJob>-<job index>-<pod index>``, and the first pod's address is one of them: a pod of
    another Job than the first's is refused in one line (the first pod then fails with the JobSet)."""
    host = value("HOSTNAME") or socket.gethostname()
    jobset = value("JOBSET_NAME")
    prefixes = [rf"{re.escape(jobset)}-.+"] if jobset else []
    first = re.match(r"^(?P<prefix>.+)-(?P<job>\d+)-\d+$", (address or "").split(".")[0])
    if first:  # the same replicated Job as the first pod's, which is in Job 0 (or whichever its address names)
        prefixes.append(re.escape(first.group("prefix")))
    for prefix in prefixes:
        match = re.match(rf"^{prefix}-(?P<job>\d+)-\d+$", host)
        if match and match.group("job") != (first.group("job") if first else "0"):
            raise UsageError(
                f"JOB_COMPLETION_INDEX={completion_index} is this pod's index in its own Job, but the pod ({host}) is "
                f"in Job {match.group('job')} of {f'JobSet {jobset}' if jobset else 'its JobSet'}: with `replicas: N` "
                "every Job's pods count from 0. Set PET_NODE_RANK from the Job's index in the pod's env (valueFrom: "
                "{fieldRef: {fieldPath: \"metadata.labels['jobset.sigs.k8s.io/job-index']\"}}), as "
                "examples/kubernetes/jobset.yaml does.", every_rank=True)


def leader_worker_set() -> Job | None:
    """A LeaderWorkerSet group: the leader's address, the group's size, this pod's index in it."""
    if not (value("LWS_LEADER_ADDRESS") and value("LWS_GROUP_SIZE")):
        return None
    nodes = integer("LWS_GROUP_SIZE", value("LWS_GROUP_SIZE"), minimum=1)  # the leader and its workers
    rank = node_rank("LWS_WORKER_INDEX", value("LWS_WORKER_INDEX") or "0", nodes, "LWS_GROUP_SIZE")
    address = value("LWS_LEADER_ADDRESS")
    run = f"lws-{address.split('.')[0]}"  # <lws>-<group>: the group's leader, the same when the group is recreated
    return Job("LeaderWorkerSet", per_rank=False, nodes=nodes, node_rank=rank, address=address,
               port=meeting_port(None), run=run, source="LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX")
