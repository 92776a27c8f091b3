"""An elastic pod's torchrun (``launching.elastic``): the rendezvous settings, the processes per machine, and the
job's first round waiting longer for more machines than its later rounds (patch ``elastic-first-round``), with
torchrun's real c10d rendezvous in this process. The launches are in tests/distributed/test_memory_tier.py."""


import pytest

from tests.machines import free_ports
from trl_ext.errors import UsageError
from trl_ext.launching import elastic
from trl_ext.placement.orchestrators import Job

JOB = Job("Kubeflow", per_rank=False, nodes=4, min_nodes=1, address="dpo-worker-0", port=23456)


def test_trl_exts_settings_unless_the_job_sets_its_own(monkeypatch):
    monkeypatch.setenv("TRL_EXT_RENDEZVOUS_TIMEOUT", "90")
    assert elastic.rendezvous_conf(JOB) == "join_timeout=90,last_call_timeout=2,keep_alive_interval=1"
    own = Job(**{**JOB.__dict__, "rendezvous_conf": "keep_alive_interval=5, read_timeout=120"})
    assert elastic.rendezvous_conf(own) == "join_timeout=90,last_call_timeout=2,keep_alive_interval=5,read_timeout=120"


def test_processes_per_machine():
    assert elastic.per_machine(Job(**{**JOB.__dict__, "per_node": 8}), None) == 8
    assert elastic.per_machine(JOB, 16) == 4  # the total at the most machines
    with pytest.raises(UsageError, match="--num_processes 6 does not divide among the elastic job's 4 machines"):
        elastic.per_machine(JOB, 6)


def _handler(port: int, last_call: float, host: bool = True, most: int = 2):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "first-round", 1, most, last_call_timeout=last_call,
                                  is_host=host, join_timeout=300)  # a loaded machine: rounds took 10-20 s
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


@pytest.fixture
def joins(monkeypatch):
    """The ``last_call_timeout`` each rendezvous join reads, by handler, with the patch applied: what each join
    reads, not how long it took (on a loaded machine a round's syncs take seconds more than its last call: 22 s and
    11 s for 4 s and 1 s, measured under CI's load)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        _DistributedRendezvousOpExecutor,
        _RendezvousJoinOp,
    )

    assert elastic.patches.applies("elastic-first-round")
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous", elastic.first_round_waits(2.0))
    read, run = [], _DistributedRendezvousOpExecutor.run

    def recorded(executor, op, *args, **kwargs):
        if isinstance(op, _RendezvousJoinOp):
            read.append((executor._node.local_id, executor._settings.timeout.last_call.total_seconds()))
        return run(executor, op, *args, **kwargs)

    monkeypatch.setattr(_DistributedRendezvousOpExecutor, "run", recorded)
    return read


@pytest.mark.slow  # 3 s of waiting
def test_a_jobs_first_round_waits_longer_than_its_later_ones(joins):
    """One machine of 1 to 2, two rounds: the join of the first round reads the first round's last call, the next
    round's the handler's own, which the handler keeps."""
    handler = _handler(free_ports(), last_call=1)
    for _ in range(2):
        handler.next_rendezvous()
    assert [seconds for _, seconds in joins] == [2.0, 1.0]
    assert handler._settings.timeout.last_call.total_seconds() == 1  # its own settings, kept for later rounds
    assert handler._state_holder._settings is handler._settings is handler._op_executor._settings
    handler.shutdown()


@pytest.mark.slow  # 2 s of waiting
def test_a_machine_joining_a_running_job_waits_the_later_rounds_time(joins, monkeypatch):
    """A pod recreated after a loss joins a running job (1 to 2 machines, its first round done with one): its join
    reads the later rounds' last call, as the job's state in torchrun's real c10d store says, so that it never holds
    the survivors for the first round's wait; a machine of a job whose first round is still forming reads the first
    round's. What the join is given is recorded in place of the join itself: a real grown round of two live handlers
    in one process (a thread each) passed here but hung until its 300-s join timeout on CI's loaded machine, twice
    (cause not found); the grown round between real processes is tests/distributed/test_memory_tier.py's."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    port = free_ports()
    running = _handler(port, last_call=60)
    assert running.next_rendezvous().world_size == 1  # its first round, alone, after the first round's 2 s
    given = []
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous",
                        lambda handler: given.append(handler._settings.timeout.last_call.total_seconds()))
    next_rendezvous = elastic.first_round_waits(2.0)
    joining = _handler(port, last_call=60, host=False)
    next_rendezvous(joining)
    starting = _handler(free_ports(), last_call=60)
    next_rendezvous(starting)
    assert [seconds for _, seconds in joins] == [2.0] and given == [60.0, 2.0]
    assert joining._settings.timeout.last_call.total_seconds() == 60  # the handler's own settings, kept
    for handler in (joining, starting, running):
        handler.shutdown()
