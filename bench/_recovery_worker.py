"""A recipe run that prints when each part of its start happens, for bench/slurm_recovery.py and
bench/elastic_recovery.py: ``[timing] <event> <unix time> restart <N>`` from the first rank (and from the process that
re-launches the ranks), with the events ``start`` (Python is up, before the recipe's imports), ``trainer`` and
``trainer_built`` (the trainer's construction, which loads the model), ``train`` (``train()`` called: resume chosen,
engine built), ``resumed`` (DeepSpeed's checkpoint loaded) and ``first_step`` (the first training step done); N is the
run's restart (Slurm's requeues, torchrun's restarts); and in the first run, ``[step] <global step> <unix time>`` as
each step's forward and backward end (bench/memory_recovery.py). ``TRL_EXT_BENCH_RECIPE`` names the recipe;
``TRL_EXT_BENCH_STEP_SECONDS`` slows every step of the first run, so that it is still training when the bench kills a
node.
"""

import os
import time

RESTART = os.environ.get("SLURM_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"


def _say(event: str) -> None:
    if os.environ.get("RANK", "0") == "0" and os.environ.get("SLURM_NODEID", "0") == "0":
        print(f"[timing] {event} {time.time():.3f} restart {RESTART}", flush=True)


_say("start" if os.environ.get("RANK") is not None else "launch")

import transformers  # noqa: E402
import transformers.trainer as trainer_module  # noqa: E402

from trl_ext.trainers.mixin import TrlExtMixin  # noqa: E402

init, train, training_step = TrlExtMixin.__init__, TrlExtMixin.train, transformers.Trainer.training_step
load = trainer_module.deepspeed_load_checkpoint
slow = float(os.environ.get("TRL_EXT_BENCH_STEP_SECONDS", 0)) if RESTART == "0" else 0.0
steps = []


def timed_init(self, *args, **kwargs):
    _say("trainer")
    init(self, *args, **kwargs)
    _say("trainer_built")


def timed_train(self, *args, **kwargs):
    _say("train")
    return train(self, *args, **kwargs)


def timed_load(*args, **kwargs):
    result = load(*args, **kwargs)
    _say("resumed")
    return result


def timed_step(self, *args, **kwargs):
    time.sleep(slow)
    result = training_step(self, *args, **kwargs)
    if not steps:
        steps.append(1)
        _say("first_step")
    if os.environ.get("RANK", "0") == "0" and RESTART == "0":  # the step whose forward and backward are done
        print(f"[step] {self.state.global_step + 1} {time.time():.3f}", flush=True)
    return result


TrlExtMixin.__init__, TrlExtMixin.train, transformers.Trainer.training_step = timed_init, timed_train, timed_step
trainer_module.deepspeed_load_checkpoint = timed_load

recipe = os.environ["TRL_EXT_BENCH_RECIPE"]  # run as __main__, sys.argv[0] left as this file: the ranks run it too
exec(compile(open(recipe).read(), recipe, "exec"), {"__name__": "__main__", "__file__": recipe})
