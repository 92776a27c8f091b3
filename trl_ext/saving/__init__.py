"""Saving: the one save path, ``save(model, dir)`` (``pipeline``), on the files layer (``trl_ext.files``); and a
trainer's checkpoints, in the foreground or in the background, from ``take`` to retention (``checkpoints``). Nothing
else writes checkpoints.

One word, one meaning, in this package and in the files layer under it (``trl_ext.files``):

- **save**: one call of ``save()``: a model's weights and configuration files planned, written, checked, agreed on by
  every rank and committed (``pipeline``; one ``save_plan.Save``).
- **checkpoint**: a trainer's ``checkpoint-N``: a save of its weights plus the files Trainer, DeepSpeed and accelerate
  write (optimizer, scheduler, RNG and trainer states); ``Checkpoints.take`` takes one.
- **partial directory**: where a save or a checkpoint is written, hidden beside its target (``.NAME.trl_ext-partial``),
  until its commit (``trainer_files.PartialDir.path``, which Trainer is given as its output directory;
  ``Save.partial``; ``files.commit.PARTIAL_SUFFIX``). Never "staging": that word is the CPU copies'.
- **commit**: the complete, checked partial directory renamed into place: ``files.commit.commit``, the one function of
  that name; a save's (``Save.commit_save``) and a checkpoint's, with its ``after_commit`` hooks and retention
  (``trainer_files.commit_checkpoint``), call it. Only committed ``checkpoint-N`` folders match
  ``files.checkpoint_dirs``.
- **mode**: whether checkpoints are written in the foreground (before training goes on) or in the background (while
  it goes on), and why (``mode.Mode``).
- **background checkpoint**: one checkpoint written in the background (``executor.BackgroundCheckpoint``): collected
  while Trainer's ``_save_checkpoint`` runs, then written by the executor.
- **part**: one piece of a background checkpoint (its weights, or one file), written by one task of the executor.
- **stage**: give what a part writes CPU copies in the snapshot (``Snapshot.stage``): small tensors copied at once,
  the others queued.
- **copy**: a CPU copy in the snapshot, and nothing else (a save's set of files on disk is a replica). The copies
  are the queued ones, run beside the next forward and backward and complete before the next optimizer step
  (``wait_for_copies``).
- **snapshot**: the CPU buffers the copies go to, kept from one checkpoint to the next (the one buffer pool).
- **reserve**: at the end of the first step, every copy a checkpoint needs measured, checked against the machine's
  memory and allocated: ``Checkpoints.reserve``, the one function of that name, through ``reserve.reserve_copies``
  (the weights' part: ``pipeline.reserve_weights``).
- **executor**: the one thread, with a gloo process group of its own, that writes background checkpoints one at a time
  (``executor.Executor``); it and the copies each run on a ``call_thread.CallThread`` ("worker" is a Ray Train
  worker's word).
- **write**: files put on disk and synced; ``wait_for_writes`` waits for the background checkpoint in flight.
- **outcome**: a background checkpoint's success or failure, known on every rank (a failure is raised on all of them).
- **held**: how long a checkpoint held the training thread; with the write time and the bytes, its cost
  (``cost.Cost``, logged as ``checkpoint/*``).
- **replica**: one of a save's whole sets of files on disk: one written by all ranks on storage every node sees, or
  one per node (``save_on_each_node`` on node-local storage), each led by its first rank (``Layout.replicas``). Never
  a CPU copy.
- **layout**: who writes which file of which replica of a save (``save_plan.Layout``), planned once per model.
- **gathered**: a partitioned parameter's full contents on a rank (ZeRO-3's gather, ``gather``,
  ``engines.sharded.gathered``). Every rank's Python value on every rank is ``process.collectives.from_every_rank``.
- **run directory**: not a word of saving's: ``TRL_EXT_RUN_DIR`` is a machine's run folder (``placement``).
"""

from trl_ext.saving.pipeline import DEFAULT_MAX_SHARD_SIZE, save, supports

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "save", "supports"]
