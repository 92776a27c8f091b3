"""trl_ext on a Ray cluster (optional: ``pip install -e '.[ray]'`` in a checkout): the ranks of a run as a Ray Train
worker group. Importing this package does not import Ray; calling into it does.

From the command line, a recipe or ``trl-ext <command>`` started by ``ray job submit`` does it by itself::

    ray job submit -- python recipes/dpo.py --config accelerate_configs/zero3.yaml [--num_processes 2-4]

From Python (a notebook, a driver script), ``fit``::

    from trl_ext.ray import fit

    def train(output_dir):
        trainer = DPOTrainer(model=..., args=DPOConfig(output_dir=output_dir, save_strategy="steps", ...), ...)
        trainer.train()
        trainer.save_model()
        return trainer.state.global_step

    result = fit(train, "/shared/runs/dpo", accelerate_config="accelerate_configs/zero3.yaml", num_workers=(2, 4))
    result.return_value, result.checkpoint   # rank 0's value; the newest committed checkpoint, where it is

See docs/ray.md. The driver, the controller's verdict and the workers live in ``trl_ext.launching.ray``, beside
the other process roles; this package is their public face, as ``import trl_ext.ray`` and ``python -m trl_ext.ray``.
"""

from trl_ext.launching.ray import fit

__all__ = ["fit"]
