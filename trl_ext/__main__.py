"""``python -m trl_ext <command>``: the ``trl-ext`` command line, also as a module, the way torchrun runs one
(``torchrun --nnodes 2 --nproc-per-node 8 -m trl_ext sft ...``, as Kubeflow's TRL runtime runs TRL's scripts)."""

import sys

from trl_ext.cli import main

if __name__ == "__main__":
    sys.exit(main())
