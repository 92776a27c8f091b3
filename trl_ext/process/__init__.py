"""This process as the launcher started it, one module for each thing it holds:

- ``ranks``: its rank and the world size (readable before any process group), whether it runs in a process group;
- ``collectives``: every rank-wide decision (rank 0 decides for all: ``decided_on_rank0``; every rank's view:
  ``from_every_rank``; the largest of every rank's number: ``max_over_ranks``; an error agreed on every rank is
  ``errors.agree``);
- ``notices``: the one-line notices trl_ext prints, and its logger;
- ``clean_exit``: the ranks' end together, work to finish before the interpreter exits (``before_exit``), and a
  clean exit for the gloo process group;
- ``hosted``: Ray's flag, for a rank whose process its host ends;
- ``warning_filter``: the third-party warnings that say nothing to a user, filtered.

The names below are re-exported for ``from trl_ext.process import ...``; trl_ext's own modules import from the module
that holds them.
"""

from trl_ext.process.clean_exit import before_exit, destroy_gloo_group_at_exit, end_together, exit_now
from trl_ext.process.collectives import decided_on_rank0, from_every_rank, max_over_ranks
from trl_ext.process.hosted import HOSTED
from trl_ext.process.notices import logger, notice, speaks_here
from trl_ext.process.ranks import distributed, env_rank, env_world_size

__all__ = ["HOSTED", "before_exit", "decided_on_rank0", "destroy_gloo_group_at_exit", "distributed", "end_together",
           "env_rank", "env_world_size", "exit_now", "from_every_rank", "logger", "max_over_ranks", "notice",
           "speaks_here"]
