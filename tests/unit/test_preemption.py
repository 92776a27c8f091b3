"""Preemption in one process: a signal is only recorded; the step boundary turns it into a save, a stop and the exit
code 128 + signal; the handlers are given back; transformers' JIT checkpoint is replaced, never run beside it."""

import os
import signal
from types import SimpleNamespace

import pytest
from transformers import TrainerControl

from trl_ext.trainers import preemption


def _run_until_exit(signum: int, tmp_path) -> tuple[TrainerControl, int]:
    callback = preemption.Preemption()
    args, state, control = SimpleNamespace(device="cpu", output_dir=str(tmp_path)), SimpleNamespace(global_step=3), \
        TrainerControl()
    callback.on_train_begin(args, state, control)
    try:
        callback.on_step_end(args, state, control)
        assert not (control.should_save or control.should_training_stop)  # nothing received yet
        os.kill(os.getpid(), signum)  # recorded by the handler; the process carries on
        callback.on_step_end(args, state, control)
        with pytest.raises(SystemExit) as exited:
            callback.on_save(args, state, control)  # after the step's checkpoint is committed
        return control, exited.value.code
    finally:
        callback.restore()


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_a_signal_saves_the_step_stops_and_exits_with_128_plus_its_number(tmp_path, capsys, signum, code):
    before = signal.getsignal(signum)
    control, exit_code = _run_until_exit(signum, tmp_path)
    assert control.should_save and control.should_training_stop
    assert exit_code == code == preemption.exit_code(signum)
    assert signal.getsignal(signum) is before  # handlers given back (here by restore(); a real exit keeps them)


def test_a_signal_during_a_save_stops_after_it_without_another_save(tmp_path):
    callback = preemption.Preemption()
    args, state, control = SimpleNamespace(device="cpu", output_dir=str(tmp_path)), SimpleNamespace(global_step=2), \
        TrainerControl()
    callback.on_train_begin(args, state, control)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while checkpoint-2 is written, after step 2's boundary
        with pytest.raises(SystemExit):
            callback.on_save(args, state, control)
    finally:
        callback.restore()


def test_transformers_jit_checkpoint_is_replaced_and_its_handler_given_back():
    class JITCheckpointCallback:  # transformers' class, as far as the replacement looks at it
        jit_manager = SimpleNamespace(_original_sigterm_handler=signal.SIG_DFL)

    jit, other = JITCheckpointCallback(), object()
    removed = []
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[other, jit]), remove_callback=removed.append)
    before = signal.signal(signal.SIGTERM, lambda *a: None)  # what transformers' manager installed
    try:
        preemption.replace_jit_checkpoint(trainer)
        assert removed == [jit] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_on_by_default_and_off_when_asked():
    assert preemption.wanted(SimpleNamespace())
    assert not preemption.wanted(SimpleNamespace(save_on_preemption=False))
    assert preemption.wanted(SimpleNamespace(save_on_preemption=False, enable_jit_checkpoint=True))
