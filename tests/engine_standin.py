"""A stand-in for a vLLM engine, for testing the weight sync without vLLM (which cannot run on CPU).

``EngineStandIn`` is a plain transformers model loaded from the base's Hub-format checkpoint. Its ``load_weights``
takes ``(name, tensor)`` pairs as vLLM's model classes do, and its name lookup is the checkpoint's own key set: vLLM
loads that very checkpoint through ``load_weights`` at start-up, so every checkpoint name is one it accepts, and an
in-memory name (fused ``mlp.experts.gate_up_proj``, a PEFT prefix, ``.base_layer``) is refused loudly, as vLLM's
``params_dict[name]`` lookup fails. ``apply()`` then loads what was received through ``from_pretrained``, which
converts the checkpoint layout to the in-memory one as it does for any Hub checkpoint.

``fake_generation`` builds TRL's ``VLLMGeneration`` (ours by default) around the stand-in, in colocate mode, with a
fake ``LLM`` that records sleep-mode calls, so TRL's own ``sync_weights`` runs unchanged.
"""

import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class EngineStandIn:
    def __init__(self, model_class, path: str, log: list):
        self.path, self.log = Path(path), log
        self.model = model_class.from_pretrained(path, dtype=torch.float32).eval()
        self.shapes = {}
        for file in self.path.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                self.shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            if name not in self.shapes:
                raise KeyError(f"engine stand-in: no parameter named {name!r} in the checkpoint layout")
            if tuple(tensor.shape) != self.shapes[name]:
                raise ValueError(f"engine stand-in: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {self.shapes[name]}")
            self.log.append(("load_weights", name))
            self.received[name] = tensor.detach().clone()
        return set(self.received)

    def apply(self) -> None:
        """Load the received weights into the model, through the Hub-format loader."""
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(self.path / "config.json", tmp)
            save_file({k: v.contiguous() for k, v in self.received.items()}, f"{tmp}/model.safetensors")
            loaded = type(self.model).from_pretrained(tmp, dtype=torch.float32)
        self.model.load_state_dict(loaded.state_dict(), strict=True)


class FakeLLM:
    """What ``VLLMGeneration.sync_weights`` touches of ``vllm.LLM`` in colocate mode, calls recorded in ``log``."""

    def __init__(self, standin: EngineStandIn, dtype: torch.dtype):
        self.log = standin.log
        runner = SimpleNamespace(model=standin)
        executor = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        self.llm_engine = SimpleNamespace(model_executor=executor, model_config=SimpleNamespace(dtype=dtype))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags or ())))

    def sleep(self, level=1):
        self.log.append(("sleep", level))

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


def fake_generation(model, standin: EngineStandIn, generation_class=None, sleep_mode: bool = True,
                    dtype: torch.dtype = torch.float32):
    """A ``VLLMGeneration`` in colocate mode whose engine is ``standin``; vLLM itself is never imported."""
    from accelerate import Accelerator
    from trl.distributed import DistributedBackend

    from trl_ext.trainers.weight_sync import BoundedVLLMGeneration

    generation = (generation_class or BoundedVLLMGeneration).__new__(generation_class or BoundedVLLMGeneration)
    accelerator = Accelerator(cpu=True)
    generation.model, generation.accelerator, generation._dist = model, accelerator, DistributedBackend(accelerator)
    generation.mode, generation.enable_sleep_mode = "colocate", sleep_mode
    generation._llm_weights_sleeping = sleep_mode
    generation.llm = FakeLLM(standin, dtype)
    return generation


