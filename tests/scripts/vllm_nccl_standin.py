"""What a CPU machine lacks for TRL's vLLM server mode, stood in for in a training process.

- vLLM is not installed: TRL's checks for it answer yes.
- The weight transfer runs on NCCL, which needs CUDA: joining the transfer group posts TRL's
  ``/init_weight_transfer_engine`` request only, and each tensor of a sync is sent to the stand-in server's
  ``/standin/weights`` with no timeout, as NCCL's broadcast waits for as long as the receiver does not receive.

Everything else (TRL's client, its HTTP requests, TRL's ``VLLMGeneration`` and trainers, trl_ext's bounds) runs
unchanged against ``tests/vllm_server_standin.py``.
"""

from types import SimpleNamespace

import requests
import trl.generation.vllm_client as vllm_client
import trl.generation.vllm_generation as vllm_generation


def _init_communicator(self, device=0):
    self._post(f"{self.base_url}/init_weight_transfer_engine",
               json={"init_info": {"world_size": self.get_world_size() + 1, "rank_offset": 1}})
    self.communicator = SimpleNamespace(base_url=self.base_url, group=SimpleNamespace(store=None, socket=None))


def _send(iterator, group, src=0, post_iter_func=None):
    for name, tensor in iterator:
        data = tensor.detach().cpu().contiguous().view(-1).numpy().tobytes()
        requests.post(f"{group.base_url}/standin/weights", data=data, headers={"X-Name": name})  # no timeout: NCCL's


def install() -> None:
    """Stand in for vLLM's presence and its NCCL transfer in this process (see the module docstring)."""
    vllm_client.is_vllm_available = vllm_generation.is_vllm_available = lambda *args, **kwargs: True
    vllm_client.VLLMClient.init_communicator = _init_communicator
    vllm_client._HAS_STATEFUL_TRAINER_ENGINE = True
    vllm_client.packed_nccl_broadcast_producer = _send
