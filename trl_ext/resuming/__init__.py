"""Every resume, in one room: which checkpoint (``choose``: the one asked for, or the newest committed), its audit
before anything loads (``checks``), another number of processes (``world_size``: the global batch kept; ``universal``:
DeepSpeed's universal checkpoint; ``fsdp2``: each rank's rows, optimizer states across layouts; ``rng``: each rank's
RNG state), and the trainer's one entry into it (``resume.prepare``, whose ``Resume`` answers Trainer's loading hooks).
"""

from trl_ext.resuming.resume import Resume, prepare

__all__ = ["Resume", "prepare"]
