"""What a Slurm job does when its step ends: finish, requeue itself, or stop for good, decided in the batch script from
the step's exit code (``srun``'s: the highest of the nodes' launchers' codes), what the first node's ranks left, the
job's record in its output directory and Slurm's view of the job's nodes.

``python -m trl_ext.launching.restart STATUS [--warned] [--terminated]`` prints the one line that says what happens
and exits with ``FINISHED``, ``REQUEUE``, ``STOPPED`` or ``FAILED`` (``recipes/slurm.sbatch`` acts on it):

- 0: trained and saved: finished.
- 138 (the time-limit warning): stopped with a checkpoint: requeue.
- 143 (SIGTERM: ``scontrol requeue``, preemption, ``scancel``, the time limit), or any code once the batch script itself
  got SIGTERM: stopped; Slurm requeues or cancels the job. (srun's 143 without either is a task it terminated after
  another failed: a failure, below.)
- The ranks stopped on SIGTERM but the batch script got none: not Slurm ending the job (that signals the script too)
  but a signal for the step alone: one slurmctld held for the job's earlier run and delivered once a lost node came
  back, or ``scancel --signal=TERM`` without ``--full``. Requeue, counted as a failure below (a checkpoint was saved).
- ``LOST`` (a node's ranks lost a peer or their node), 137 (a process killed with SIGKILL: the OOM killer, a node
  going away), srun's codes for a node it cannot reach, or a node of the job that Slurm shows not responding or down:
  requeue, unless the job already failed this way ``TRL_EXT_MAX_FAILURES`` times in a row (3 by default; the former
  ``TRL_EXT_SLURM_MAX_FAILURES`` is still read) without committing a new checkpoint: ``failure_limit``'s rule, applied
  here before the job is requeued.
- ``ERROR`` (a rank raised an error of its own) or anything else: failed, once; requeuing a bug would loop forever.
"""

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass

from trl_ext.placement import failure_limit, orchestrators, outcome, ownership

FINISHED, REQUEUE, STOPPED, FAILED = 0, 10, 11, 12  # this module's answer to the batch script
WARNED, TERMINATED, KILLED = 138, 143, 137  # 128 + SIGUSR1, SIGTERM, SIGKILL
LOST, ERROR = 200, 201  # a node launcher's codes: above every 128 + signal, so that srun's highest code is ours
# srun's own code when it cannot launch on or reach a node: Slurm's communication errors 1001-1004, modulo 256
UNREACHABLE = (233, 234, 235, 236)
_UNWELL = ("NOT_RESPONDING", "DOWN", "FAIL", "POWERED_DOWN", "REBOOT")  # node states: the node is lost to the job


@dataclass(frozen=True)
class BatchAction:
    """What the job does next.

    Args:
        action: ``FINISHED``, ``REQUEUE``, ``STOPPED`` or ``FAILED``.
        line: the one line that says so (without the ``[trl_ext] Slurm job N:`` prefix).
        exit_code: the batch script's exit code when it does not requeue.
    """

    action: int
    line: str
    exit_code: int


def _slurm_job() -> orchestrators.Job | None:
    job = orchestrators.current()
    return job if job is not None and job.orchestrator == "Slurm" else None


def unwell_nodes(node_list: str) -> list[str]:
    """The nodes of ``node_list`` that Slurm shows not responding, down, failing or rebooting.

    Args:
        node_list: a Slurm host list (``n[1-2]``).

    Returns:
        Their names (empty when Slurm cannot be asked).
    """
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node_list], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    unwell = []
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if any(flag in fields.get("State", "") for flag in _UNWELL):
            unwell.append(fields.get("NodeName", "?"))
    return unwell


def decide(status: int, warned: bool = False, terminated: bool = False, run_dir: str | None = None,
           unwell: list[str] = (), limit: int | None = None) -> BatchAction:
    """The job's next move after its step ended with ``status``; a failure that requeues is counted in the job's record.

    Args:
        status: the step's exit code (``srun``'s).
        warned: the batch script received the time-limit warning.
        terminated: the batch script received SIGTERM (the job is being requeued, preempted or cancelled).
        run_dir: the first node's run directory (where the run said which output directory it trains in).
        unwell: the job's nodes that Slurm shows not responding or down.
        limit: failures in a row without a new checkpoint that still requeue (default: ``failure_limit.max_failures()``,
            the rule every orchestrator's runs follow).

    Returns:
        The decision.
    """
    # What the first node's ranks left: every rank stops on the signal all agreed on, so theirs is the step's, whatever
    # code srun reports (a node's launcher that srun terminated once another had exited counts as 143).
    stops = {s["signal"] for s in outcome.stops(run_dir)} if run_dir else set()
    first_node = {f["kind"] for f in outcome.failures(run_dir)} if run_dir else set()
    if status == 0:
        return BatchAction(FINISHED, "finished", 0)
    if status == WARNED or "SIGUSR1" in stops:
        return BatchAction(REQUEUE, "stopped on the time-limit warning with a checkpoint; requeued: it runs again with "
                           "the same id and resumes from it", WARNED)
    if terminated:
        what = "stopped on SIGTERM with a checkpoint" if status == TERMINATED or stops else \
            f"signalled by Slurm (SIGTERM) while its step ended with exit {status}"
        return BatchAction(STOPPED, f"{what}: a job that Slurm requeues (scontrol requeue, preemption, a node failure) "
                           "runs again and resumes from its newest checkpoint; a cancelled one does not", status)
    if status == ERROR or outcome.ERROR in first_node:  # srun's code may be another node's, killed after the error
        return BatchAction(FAILED, f"failed: a rank raised an error (exit {status}; the log above has it); not "
                           "requeued", status)
    why = ("its ranks stopped on a SIGTERM for the step alone, with a checkpoint (a signal Slurm held for the job's "
           "earlier run, delivered late by a node that came back; or scancel --signal=TERM without --full)"
           if "SIGTERM" in stops else
           "a node's ranks lost a peer or their node" if status == LOST or outcome.PEER in first_node else
           "a process was killed (SIGKILL: the OOM killer, or its node went away)" if status == KILLED else
           f"srun could not reach a node (Slurm error {status + 768})" if status in UNREACHABLE else
           f"node(s) {', '.join(unwell)} stopped responding" if unwell else None)
    if why is None:
        return BatchAction(FAILED, f"failed (exit {status}); not requeued", status)
    if unwell and "stopped responding" not in why:
        why += f"; Slurm shows {', '.join(unwell)} not responding"
    failures, since = _count_failure(run_dir)
    limit = failure_limit.max_failures() if limit is None else limit
    if failures > limit:
        return BatchAction(FAILED, f"{why}: {failures} failures in a row without a new checkpoint (the limit is "
                           f"{limit}, {failure_limit.setting()}); not requeued", status)
    return BatchAction(REQUEUE, f"{why}: requeued (failure {failures} of {limit} in a row without a new checkpoint"
                    f"{since}): it runs again on the nodes Slurm gives it and resumes", status)


def _count_failure(run_dir: str | None) -> tuple[int, str]:
    """This failure's number in the current run of failures without a new checkpoint, recorded in the job's output
    directory; without one (the run failed before it chose it), the job's restarts stand in for the count."""
    output_dir = ownership.announced_output_dir(run_dir) if run_dir else None
    record = ownership.record(output_dir) if output_dir else {}
    if not record:
        job = _slurm_job()
        return (job.restart + 1 if job else 1), ""
    newest = ownership.newest_checkpoint(output_dir)
    failures, _ = failure_limit.next_count({**record, "stopped": False, "gave_up": False}, newest)  # the one rule
    ownership.update(output_dir, failures=failures, checkpoint=newest)
    return failures, f"; newest checkpoint-{newest}" if newest else "; no checkpoint yet"


def main(argv: list[str] | None = None) -> int:
    """The batch script's decision after its step ended: prints the one line and returns the action.

    Args:
        argv: ``STATUS [--warned] [--terminated]`` (default: the command line).

    Returns:
        ``FINISHED``, ``REQUEUE``, ``STOPPED`` or ``FAILED``; the exit code for the script is printed last on stdout.
    """
    parser = argparse.ArgumentParser(prog="python -m trl_ext.launching.restart")
    parser.add_argument("status", type=int)
    parser.add_argument("--warned", action="store_true")
    parser.add_argument("--terminated", action="store_true")
    args = parser.parse_args(argv)
    job = _slurm_job()
    unwell = unwell_nodes(job.hosts) if job is not None and job.hosts and args.status not in (0, WARNED) else []
    run = ownership.run_dir(job) if job is not None else None  # the first node's
    decision = decide(args.status, args.warned, args.terminated, run, unwell)
    if run:  # the first node's; the other nodes' launchers removed theirs
        shutil.rmtree(run, ignore_errors=True)
    print(f"[trl_ext] Slurm job {job.job_id if job else '?'}: {decision.line}", file=sys.stderr, flush=True)
    print(decision.exit_code, flush=True)
    return decision.action


if __name__ == "__main__":
    sys.exit(main())
