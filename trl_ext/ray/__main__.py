"""``python -m trl_ext.ray RECIPE [options]``: a recipe's ranks as a Ray Train worker group (what a recipe started by
``ray job submit`` becomes, see ``trl_ext.launching.ray.recipe``)."""

import sys

from trl_ext.launching.ray.recipe import main

if __name__ == "__main__":
    sys.exit(main())
