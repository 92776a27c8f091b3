"""How a launched test script ends once its work is done and written: without tearing down the interpreter.

A process that leaves a gloo process group can abort at interpreter shutdown, after everything it had to do
("terminate called without an active exception", SIGABRT; pytorch#190489): seen on about one launch in 50 with the
tiny models (a GRPO FSDP2 launch in CI) and more often with larger ones, and trl_ext's exit hook that destroys the
group does not prevent it. The launch then fails although the run passed. Test scripts leave through ``finish``, as
trl_ext's recipes do: the interpreter's exit steps, then ``os._exit`` with code 0. A script that fails raises before
it.

Before their work, test scripts call ``freeze_imports``.
"""

import gc

import torch.distributed as dist


def freeze_imports() -> None:
    """Keep what is loaded so far (torch, transformers, TRL, DeepSpeed: about 600,000 objects) out of the garbage
    collector's full collections: every ``Trainer.train()`` runs one (accelerate's ``free_memory``), and so does every
    ZeRO-3 engine, each about 0.3 s of CPU in a rank that has loaded them (measured 2026-11-27). What the run makes is
    collected as before."""
    gc.freeze()


def finish() -> None:
    """Leave as trl_ext's recipes do (``trl_ext.process.exit_now``): threading's exit hooks (a checkpoint mirror
    finishes its uploads within ``mirror_exit_grace_period``, thread pools stop), the non-daemon threads joined, the
    group destroyed, atexit's callbacks run, the streams flushed, and exit code 0 without interpreter teardown."""
    from trl_ext.process import exit_now

    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
        dist.destroy_process_group()  # exit_now destroys gloo's, after the threads
    exit_now()
