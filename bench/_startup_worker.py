"""A recipe run that prints when each part of its start happens, for bench/startup.py: ``[timing] <event> <unix time>``
from the first rank, with the events ``start`` (the rank's Python is up, before the recipe's imports), ``trainer``
(the trainer's construction starts: imports done), ``data`` (TRL starts preparing the dataset: the model loaded),
``trainer_built``, ``train`` (``train()`` called), ``resumed`` (a checkpoint loaded, when resuming), ``step`` (the first
training step starts: the engine built) and ``first_step`` (it is done). ``TRL_EXT_BENCH_RECIPE`` names the recipe; the
process that re-launches the ranks (the recipe form) prints ``launch``.
"""

import os
import time


def _say(event: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[timing] {event} {time.time():.3f}", flush=True)


said = set()


def _once(event: str) -> None:
    if event not in said:
        said.add(event)
        _say(event)


def _install() -> None:
    """Time the trainer's construction, its dataset preparation, ``train()``, a checkpoint's load and the first step."""
    import transformers
    import transformers.trainer as trainer_module

    from trl_ext.trainers.mixin import TrlExtMixin

    init, train, training_step = TrlExtMixin.__init__, TrlExtMixin.train, transformers.Trainer.training_step
    prepare, load = TrlExtMixin._prepare_dataset, trainer_module.deepspeed_load_checkpoint

    def timed_init(self, *args, **kwargs):
        _once("trainer")
        init(self, *args, **kwargs)
        _once("trainer_built")

    def timed_prepare(self, *args, **kwargs):
        _once("data")
        return prepare(self, *args, **kwargs)

    def timed_train(self, *args, **kwargs):
        _once("train")
        return train(self, *args, **kwargs)

    def timed_load(*args, **kwargs):
        result = load(*args, **kwargs)
        _once("resumed")
        return result

    def timed_step(self, *args, **kwargs):
        _once("step")
        result = training_step(self, *args, **kwargs)
        _once("first_step")
        return result

    TrlExtMixin.__init__, TrlExtMixin.train, transformers.Trainer.training_step = timed_init, timed_train, timed_step
    TrlExtMixin._prepare_dataset, trainer_module.deepspeed_load_checkpoint = timed_prepare, timed_load


RANKED = os.environ.get("RANK") is not None
_say("start" if RANKED else "launch")
if RANKED:  # the process that only re-launches imports nothing here: what it costs is the recipe's own
    _install()

recipe = os.environ["TRL_EXT_BENCH_RECIPE"]  # run as __main__, sys.argv[0] left as this file: the ranks run it too
exec(compile(open(recipe).read(), recipe, "exec"), {"__name__": "__main__", "__file__": recipe})
