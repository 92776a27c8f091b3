"""Every orchestrator in one room: who started this process and its job (``orchestrators``, the one reader of their
variables), which output directory is the run's and what it records there across its runs (``ownership``), one
machine's launcher (``node``) and the machines' bounded meeting (``rendezvous``), the signals a scheduler sends and the
stop at a step boundary (``preemption``) with Slurm's time-limit warning's timing (``deadline``), how a rank ended
(``outcome``), and whether a Slurm job finishes, requeues itself or stops after its step ends (``restart``)."""
