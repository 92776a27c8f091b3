"""Slurm, in one room: the job a process runs in (``job``), which output directory is the job's and what the job
records there across its runs (``ownership``), one node's launcher (``node``), the signals a scheduler sends and the
stop at a step boundary (``preemption``) with the time-limit warning's timing (``deadline``), how a rank ended
(``outcome``), and whether the job finishes, requeues itself or stops after its step ends (``restart``)."""
