"""The one-line notices trl_ext prints (``notice``: once per run, from rank 0) and its logger."""

import logging

from trl_ext import patches
from trl_ext.process.ranks import env_rank

logger = logging.getLogger("trl_ext")

_speaks = [True]  # whether this machine prints notices (see ``speaks_here``)


def speaks_here(speaks: bool) -> None:
    """Say whether this process prints notices when it is not one of a launch's ranks: a job's launcher on each of
    several machines reads the same input and would say the same; only the first machine's speaks."""
    _speaks[0] = speaks


def _says_notices() -> bool:
    """Whether this process prints notices: rank 0 when distributed; before the ranks exist, the first machine's
    launcher process."""
    return env_rank() == 0 and _speaks[0]


def notice(message: str) -> None:
    """One-line notice, printed once per run (rank 0 only when distributed; before the ranks exist, the first
    machine's launcher process)."""
    if _says_notices():
        logger.warning(f"[trl_ext] {message}")


# The patch registry sits below this room and logs a failed guard's notice itself: the same process says it.
patches.logger.addFilter(lambda record: _says_notices())
