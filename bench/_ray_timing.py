"""A recipe run that prints when each part of its start happens, and when each training step ends, for bench/on_ray.py:
``[timing] <event> <unix time> restart <n>`` from rank 0 (and from the driver, before the ranks exist), with the events
``launch`` (the driver's Python is up), ``start`` (a rank's Python is up, before the recipe's imports), ``trainer`` and
``trainer_built`` (the trainer's construction, which loads the model), ``train`` (``train()`` called), ``resumed``
(DeepSpeed's checkpoint loaded), ``first_step`` and ``step`` (each training step done). The restart is the one the
orchestrator gives (``placement.orchestrators``). ``TRL_EXT_BENCH_RECIPE`` names the recipe;
``TRL_EXT_BENCH_STEP_SECONDS`` slows every step of the first run, so that it is still training when the bench kills a
node. Under ``accelerate launch`` and under Ray alike the ranks run this file (it stays ``sys.argv[0]``).
"""

import os
import time


def _restart() -> int:
    from trl_ext.placement import orchestrators

    job = orchestrators.current()
    return job.restart if job is not None else 0


def _say(event: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[timing] {event} {time.time():.3f} restart {_restart()}", flush=True)


rank = os.environ.get("RANK") is not None
_say("start" if rank else "launch")

if rank:  # only the ranks: the driver, or accelerate's launcher, imports nothing more than it would
    import transformers
    import transformers.trainer as trainer_module

    from trl_ext.trainers.mixin import TrlExtMixin

    init, train, training_step = TrlExtMixin.__init__, TrlExtMixin.train, transformers.Trainer.training_step
    load = trainer_module.deepspeed_load_checkpoint
    slow = float(os.environ.get("TRL_EXT_BENCH_STEP_SECONDS", 0)) if _restart() == 0 else 0.0
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
            _say("first_step")
        steps.append(1)
        if len(steps) % self.args.gradient_accumulation_steps == 0:
            _say("step")
        return result

    TrlExtMixin.__init__, TrlExtMixin.train, transformers.Trainer.training_step = timed_init, timed_train, timed_step
    trainer_module.deepspeed_load_checkpoint = timed_load

recipe = os.environ["TRL_EXT_BENCH_RECIPE"]  # run as __main__, sys.argv[0] left as this file (runpy would change it)
exec(compile(open(recipe).read(), recipe, "exec"), {"__name__": "__main__", "__file__": recipe})
