"""The memory tier on several machines: every memory checkpoint replicated to the next machine (a ring), and, when a
run resumes, each machine given what it lacks of the newest checkpoint the machines hold together.

- **Replication** (``replicate``): once every machine has its part of memory ``checkpoint-N`` in place (the files its
  own ranks wrote), each machine's first process sends its part to the next machine's and receives the previous
  machine's, file by file over the executor's gloo group. A checkpoint holds its machines' parts in a note inside it
  (``HOLDS``; taken on one machine, that machine's whole part: ``note_alone``). Only once every machine has its
  replica do they write their manifests, which is what makes a memory checkpoint resumable: a half-replicated one is
  never resumed. Each machine holds its own part plus one peer's.
- **Resume** (``settle``): the machines say which memory checkpoints they hold whole, and whose parts; the newest step
  whose parts together cover every machine that took it, and newer than the disk's, is chosen; each machine that lacks
  parts of it receives them from one that holds them (a recreated machine: all of them), and the memory tier then
  resumes it as on one machine. At another number of machines, every machine receives every part (resharding reads
  them all).

Own code, not nvidia-resiliency-ext's local checkpointing: it saves torch state dicts of its own layout, not the Hub
and DeepSpeed/DCP files our resume and resharding read (docs/reliability.md).
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trl_ext.errors import CheckpointError
from trl_ext.files import checkpoint_dirs

HOLDS = ".trl_ext-machines.json"  # in a memory checkpoint: how many machines took it, whose parts it holds
CHUNK = 64 << 20  # bytes per message: a file goes in pieces, so a transfer holds one piece in memory, not a file


@dataclass
class Machines:
    """The run's machines, each known by its first process.

    Args:
        leaders: the global rank of each machine's first process, by machine.
        index: this process's machine.
        rank: this process's global rank.
    """

    leaders: list[int]
    index: int
    rank: int

    @classmethod
    def of(cls, args) -> "Machines":
        """The machines of a run (collective when distributed: every rank calls it at the same point).

        Args:
            args: the run's ``TrainingArguments`` (its process and local process indexes).

        Returns:
            The machines, the same on every rank.
        """
        from trl_ext.process.collectives import from_every_rank

        first = args.process_index - args.local_process_index  # ranks are numbered machine by machine
        leaders = sorted(set(from_every_rank(first)))
        return cls(leaders, leaders.index(first), args.process_index)

    @property
    def count(self) -> int:
        return len(self.leaders)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leaders[self.index]

    def leader(self, machine: int) -> int:
        return self.leaders[machine % self.count]


def files_under(directory: Path) -> list[str]:
    """Every file under ``directory`` but the parts note, relative to it, sorted."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != HOLDS)


def read_holds(checkpoint: Path) -> dict | None:
    """A memory checkpoint's parts note: ``{"machines": M, "world": ranks, "parts": {machine: [files]}}``, or None."""
    try:
        raw = json.loads((checkpoint / HOLDS).read_text())
        return {"machines": int(raw["machines"]), "world": int(raw["world"]),
                "parts": {int(k): list(v) for k, v in raw["parts"].items()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_holds(checkpoint: Path, machines: int, world: int, parts: dict[int, list[str]]) -> None:
    tmp = checkpoint.parent / f".{checkpoint.name}.{HOLDS}.tmp"  # outside it: a manifest never lists a partial note
    tmp.write_text(json.dumps({"machines": machines, "world": world,
                               "parts": {str(k): v for k, v in sorted(parts.items())}}))
    os.replace(tmp, checkpoint / HOLDS)


def note_alone(world: int, checkpoint: Path, step: int) -> None:
    """A memory checkpoint taken on one machine noted as that machine's whole part (``HOLDS``, before its manifest):
    when the run grows to several machines (an elastic job that a machine joins), ``settle`` finds it and gives it to
    the machines that joined.

    Args:
        world: the run's number of processes.
        checkpoint: the committed memory ``checkpoint-N``.
        step: its step (unused: a commit hook's signature).
    """
    write_holds(checkpoint, 1, world, {0: files_under(checkpoint)})


# Transfers between two machines' first processes

def _pair(group, outgoing: torch.Tensor | None, to: int | None, incoming: torch.Tensor | None,
          source: int | None) -> None:
    """One message each way at once (either may be None): a ring's sends and receives never wait on each other."""
    works = []
    if outgoing is not None:
        works.append(dist.isend(outgoing, to, group=group))
    if incoming is not None:
        works.append(dist.irecv(incoming, source, group=group))
    for work in works:
        work.wait()


def _pieces(sizes: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    return [(name, start, min(CHUNK, size - start)) for name, size in sizes for start in range(0, size, CHUNK)]


def transfer(group, send: tuple[int, Path, list[str]] | None, receive: tuple[int, Path] | None) -> list[str]:
    """Send files to one process while receiving others' files from one process (either may be None).

    A file that cannot be read or written does not stop the exchange halfway: every message announced is sent and
    received (zeros in place of what could not be read), and the error is raised once the partner has had all of
    them, so that neither side is left waiting for the group's timeout. A received file is then incomplete: the
    caller's agreement on the outcome keeps it from counting.

    Args:
        group: the process group (its ranks are global ranks).
        send: ``(to_rank, directory, names)``: the files under ``directory`` to send.
        receive: ``(from_rank, directory)``: where received files go (written over where they exist).

    Returns:
        The names received.

    Raises:
        CheckpointError: a file of this side could not be read or written (after the exchange).
    """
    failed = []
    sizes = []
    for name in send[2] if send is not None else []:
        try:
            sizes.append([name, (send[1] / name).stat().st_size])
        except OSError as exc:
            failed.append(f"could not read {name}: {exc}")
    header = json.dumps(sizes).encode() if send is not None else b""
    length = torch.zeros(1, dtype=torch.int64)
    _pair(group, torch.tensor([len(header)]) if send else None, send and send[0], length if receive else None,
          receive and receive[0])
    incoming = torch.empty(int(length), dtype=torch.uint8) if receive else None
    _pair(group, torch.frombuffer(bytearray(header), dtype=torch.uint8) if send and header else None, send and send[0],
          incoming if receive and int(length) else None, receive and receive[0])
    received = json.loads(bytes(incoming.numpy())) if receive and int(length) else []
    out_pieces, in_pieces = _pieces(sizes), _pieces(received)
    for i in range(max(len(out_pieces), len(in_pieces))):
        outgoing = None
        if i < len(out_pieces):
            name, start, size = out_pieces[i]
            outgoing = torch.zeros(size, dtype=torch.uint8)  # the piece announced, whatever happens to the file
            if not failed:
                try:
                    with open(send[1] / name, "rb") as f:
                        f.seek(start)
                        data = f.read(size)
                except OSError as exc:
                    failed.append(f"could not read {name}: {exc}")
                else:
                    if len(data) == size:
                        outgoing = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    else:
                        failed.append(f"could not read {name}: it shrank to {start + len(data)} bytes while sent")
        buffer = torch.empty(in_pieces[i][2], dtype=torch.uint8) if i < len(in_pieces) else None
        _pair(group, outgoing, send and send[0], buffer, receive and receive[0])
        if buffer is not None and not failed:
            name, start, _ = in_pieces[i]
            path = receive[1] / name
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "r+b" if start else "wb") as f:
                    f.seek(start)
                    f.write(buffer.numpy().tobytes())
            except OSError as exc:
                failed.append(f"could not write {path}: {exc}")
    for name, size in received:  # empty files travel in the header alone
        if size == 0 and not failed:
            (receive[1] / name).parent.mkdir(parents=True, exist_ok=True)
            (receive[1] / name).touch()
    if failed:
        raise CheckpointError(f"saving failed: {failed[0]}", kind="save")
    return [name for name, _ in received]


# Replication, on the executor's thread of every rank

def replicate(machines: Machines, world: int, checkpoint: Path, group) -> None:
    """Once every machine's first process has put its part of ``checkpoint`` in place: each sends it to the next
    machine and receives the previous machine's, and notes both (``HOLDS``); every rank's outcome agreed on.

    Args:
        machines: the run's machines.
        world: the run's number of processes.
        checkpoint: this machine's memory ``checkpoint-N``, in place, without its manifest yet.
        group: the executor's gloo group.

    Raises:
        CheckpointError: some machine's replica failed (on every rank); no manifest is written anywhere.
    """
    from trl_ext import errors

    dist.barrier(group=group)  # every machine's part is in place
    error = None
    if machines.is_leader:
        try:
            own = files_under(checkpoint)
            # a file both parts hold (none today) keeps this machine's copy
            staging = checkpoint.parent / f".{checkpoint.name}.trl_ext-replica"  # made by transfer, file by file
            shutil.rmtree(staging, ignore_errors=True)
            theirs = transfer(group, (machines.leader(machines.index + 1), checkpoint, own),
                              (machines.leader(machines.index - 1), staging))
            for name in theirs:
                if not (checkpoint / name).exists():
                    (checkpoint / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staging / name, checkpoint / name)
            shutil.rmtree(staging, ignore_errors=True)
            previous = (machines.index - 1) % machines.count
            write_holds(checkpoint, machines.count, world, {machines.index: own, previous: theirs})
        except Exception as exc:  # noqa: BLE001 - agreed on below, never left to hang the others
            error = CheckpointError(f"saving failed: memory {checkpoint.name}'s replica to the next machine: "
                                    f"{type(exc).__name__}: {exc}", kind="save")
    errors.agree(error, group)


# Resuming, on every rank before training

@dataclass
class Plan:
    """What a resume from memory takes on several machines.

    Args:
        step: the checkpoint's step (None: none is whole across the machines, or none is newer than the disk's).
        machines: how many machines took it.
        world: how many processes took it.
        moves: ``(from machine, to machine, part)``: the parts each machine lacks, and who sends them.
    """

    step: int | None
    machines: int = 0
    world: int = 0
    moves: tuple[tuple[int, int, int], ...] = ()


def plan(held: list[dict[int, dict]], disk_step: int, world: int) -> Plan:
    """The newest step the machines' memory checkpoints hold whole together, newer than ``disk_step``, and the parts
    to move so that every machine has what it resumes from.

    Args:
        held: per machine now, ``{step: holds note}`` of its whole memory checkpoints.
        disk_step: the newest disk checkpoint's step (0: none).
        world: the run's number of processes now. With as many machines and processes as when the checkpoint was
            taken, each machine needs its own part and the first machine's (the files written once); otherwise
            every part (resharding reads them all).

    Returns:
        The plan (deterministic: every rank computes the same from the same reports).
    """
    for step in sorted({s for steps in held for s in steps}, reverse=True):
        if step <= disk_step:
            break
        notes = {m: steps[step] for m, steps in enumerate(held) if step in steps}
        taken = {(n["machines"], n["world"]) for n in notes.values()}
        if len(taken) != 1:
            continue
        count, taken_world = taken.pop()
        holders = {part: sorted(m for m, n in notes.items() if part in n["parts"]) for part in range(count)}
        if any(not who for who in holders.values()):
            continue  # some machine's part is nowhere
        moves = []
        for machine in range(len(held)):
            has = set(notes[machine]["parts"]) if machine in notes else set()
            needs = {0, machine} if len(held) == count and world == taken_world else set(range(count))
            moves += [(holders[part][0], machine, part) for part in sorted(needs - has)]
        return Plan(step, count, taken_world, tuple(moves))
    return Plan(None)


def gather(tier, machines: Machines, moves: Plan, group) -> str | None:
    """Carry out ``moves`` (every rank; the machines' first processes send and receive): each machine's memory
    checkpoint of ``moves.step`` completed with the parts it lacked, noted and given a new manifest.

    Returns:
        Why it failed on some machine (one clause), or None.
    """
    from trl_ext.process.collectives import from_every_rank
    from trl_ext.saving.memory_tier import manifest_path

    here = tier.root / checkpoint_dirs.name(moves.step)
    error = None
    try:
        notes = read_holds(here) if here.is_dir() else None
        parts = dict(notes["parts"]) if notes else {}
        for source, target, part in moves.moves:
            if machines.is_leader and machines.index == source:
                transfer(group, (machines.leader(target), here, parts[part]), None)
            elif machines.is_leader and machines.index == target:
                here.mkdir(parents=True, exist_ok=True)
                manifest_path(here).unlink(missing_ok=True)  # not resumable while it changes
                parts[part] = transfer(group, None, (machines.leader(source), here))
        if machines.is_leader and any(target == machines.index for _, target, _ in moves.moves):
            write_holds(here, moves.machines, moves.world, parts)
            tier.committed(here, moves.step)
    except Exception as exc:  # noqa: BLE001 - said below, on every rank
        error = f"{type(exc).__name__}: {exc}"
    failures = [e for e in from_every_rank(error, group) if e]
    return failures[0] if failures else None


def settle(tier, args, group) -> None:
    """Before a run resumes, on every rank of a run on several machines: which memory checkpoint the machines resume
    (``plan``), its parts moved to the machines that lack them (``gather``), and the answer kept on the tier
    (``agreed``, read by ``MemoryTier.newest`` and ``MemoryTier.here``); the moves said in one line.

    Args:
        tier: the run's memory tier (its ``machines`` known).
        args: the run's ``TrainingArguments``.
        group: the executor's gloo group.
    """
    from trl_ext.process.collectives import from_every_rank
    from trl_ext.process.notices import notice

    machines = tier.machines
    tier.share_token(args, create=False)
    disk = max(checkpoint_dirs.committed(args.output_dir), default=0) if args.process_index == 0 else None
    held = tier.whole() if machines.is_leader else None
    reports = from_every_rank((str(tier.root), disk, held), group)
    disk_step = reports[0][1]
    moves = plan([reports[leader][2] or {} for leader in machines.leaders], disk_step, args.world_size)
    tier.agreed = Agreed(None, reports[0][0])
    if moves.step is None:
        return
    name = checkpoint_dirs.name(moves.step)
    why = gather(tier, machines, moves, group) if moves.moves else None
    if why is not None:
        tier.agreed.skipped = f"memory {name} is not resumed: moving its parts between machines failed ({why})"
        return
    tier.agreed.step = moves.step
    if moves.moves:
        taken = f"{moves.machines} machine{'s' if moves.machines > 1 else ''}"
        notice(f"memory {name} (taken on {taken}, resumed on {machines.count}): {said(moves)}")


def said(moves: Plan) -> str:
    """The moves in words: ``machine 1 received the parts of machines 0 and 1 from machine 0``."""
    grouped: dict[tuple[int, int], list[int]] = {}
    for source, target, part in moves.moves:
        grouped.setdefault((target, source), []).append(part)
    lines = []
    for (target, source), parts in grouped.items():
        whose = f"machine {parts[0]}'s part" if len(parts) == 1 else \
            f"the parts of machines {', '.join(map(str, parts[:-1]))} and {parts[-1]}"
        lines.append(f"machine {target} received {whose} from machine {source}")
    return "; ".join(lines)


@dataclass
class Agreed:
    """What the machines' memory tiers resume, as ``settle`` agreed it (the same on every rank).

    Args:
        step: the step resumed from memory (None: none).
        root: the first machine's tier directory (the path rank 0 names).
        skipped: why a memory checkpoint is not resumed, or None.
    """

    step: int | None
    root: str
    skipped: str | None = None
