"""Every process role, and how each starts the next. What this process is (which job, machine, rank, whose run) is
asked of ``placement``, which starts nothing; here is what starts processes.

- the launch decision (``decision``, carried out by ``launch``): a recipe's or ``trl-ext``'s first step decides once,
  before torch or TRL is imported, which of the roles below this process becomes;
- the Ray driver (``ray.recipe``, ``python -m trl_ext.ray``; ``trl_ext.ray.fit`` from Python): starts the ranks as a
  Ray Train worker group (``ray.group``), each worker one rank (``ray.worker``);
- the node launcher (``node``, ``python -m trl_ext.launching.node``): one per machine; meets the other machines within
  a stated time (``rendezvous``), then starts this machine's ranks through ``accelerate_run``;
- the machine's launch (``accelerate_run``, ``python -m trl_ext.launching.accelerate_run``): accelerate's own launch,
  which starts the ranks, ending with their exit code; an elastic job's machine runs torchrun itself instead
  (``elastic``, ``python -m trl_ext.launching.elastic``), in a rendezvous that numbers the machines;
- a rank: the recipe or ``trl-ext <command>`` (``scripting``, ``trl_cli``, ``trl_script``) training in this process; a
  rank that another launcher started applies its accelerate config here (``in_process``);
- the restart verdict (``restart``, ``python -m trl_ext.launching.restart``): after a Slurm step ends, the batch script
  asks it whether the job finishes, requeues itself or stops;
- a notebook's launch (``notebook.launch``): a training function on several processes from one Python process.
"""
