"""Slurm, in one room: the job a process runs in (``job``), which output directory is the job's (``ownership``), one
node's launcher (``node``), and the signals a scheduler sends with the stop at a step boundary (``preemption``)."""
