"""The proof that a weight sync landed in a colocated vLLM engine (GRPO, RLOO with ``vllm_mode="colocate"``).

A sync that silently keeps old weights (trl#5312: sleep mode kept them, the importance ratio fell to about 1e-7) trains
on stale rollouts with no error. After the first sync and every ``vllm_check_sync_every``-th, vLLM's prompt
log-probabilities of a fixed token sequence are compared with the trainer's own forward pass on the same tokens. vLLM's
CPU layers repack their weights after loading (a linear weight reads as ``torch.Size([0])``), so its parameters cannot
be read back and checksummed; the log-probabilities see every weight through the same forward the rollouts use.

A check that fails raises ``SyncError`` naming the tensors: those whose values sent differ from the trainer's
(a broken walk), otherwise those that changed since the last sync that passed (what vLLM should have taken).
"""

import time

import torch

from trl_ext.errors import SyncError

CHECK_LENGTH = 16  # tokens in the check's sequence: a few, so that one prefill costs milliseconds


def check_tokens(vocab_size: int, length: int = CHECK_LENGTH) -> list[int]:
    """A fixed token sequence spread over the vocabulary (the same on every rank and every run).

    Args:
        vocab_size: the tokenizer's size.
        length: how many tokens.

    Returns:
        Token ids, all below ``vocab_size``.
    """
    return [(7919 * i + 13) % vocab_size for i in range(1, length + 1)]


def engine_logprobs(llm, tokens: list[int]) -> torch.Tensor:
    """vLLM's log-probability of each token of ``tokens`` after the ones before it (a prompt-only request)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    output = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
    # prompt_logprobs[0] is None (the first token has no context); each later entry holds the token's own logprob
    return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], tokens[1:])],
                        dtype=torch.float64)


def trainer_logprobs(model, tokens: list[int], device) -> torch.Tensor:
    """The trainer's log-probability of each token after the ones before it (eval mode, no gradient).

    Under ZeRO-3 and FSDP2 the forward pass gathers parameters: call it on every rank.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0, :-1].double()
    finally:
        model.train(was_training)
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:], device=device)[:, None])[:, 0].cpu()


def checksums(named_tensors) -> dict[str, tuple[float, float]]:
    """Per-tensor (sum, sum of squares) in float64: a cheap fingerprint of what a sync sent."""
    return {name: (float(t.double().sum()), float(t.double().square().sum())) for name, t in named_tensors}


def _differ(a: tuple[float, float], b: tuple[float, float] | None) -> bool:
    return b is None or any(abs(x - y) > 1e-9 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))


def _largest_on_any_rank(value: float) -> float:
    """The largest ``value`` over the ranks (each checks its own engine): every rank passes or fails together, so the
    naming walk, a collective under ZeRO-3 and FSDP2, runs on all of them."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor[0])


class SyncCheck:
    """Decides which syncs are checked, checks them, and remembers the last sync that passed.

    Args:
        every: check the first sync and every ``every``-th after it; 0 checks none.
        atol: the largest difference allowed between the two log-probabilities.
        vocab_size: the tokenizer's size (the check's tokens lie below it).
    """

    def __init__(self, every: int, atol: float, vocab_size: int):
        self.every, self.atol = every, atol
        self.tokens = check_tokens(vocab_size)
        self.syncs = 0
        self.landed: dict[str, tuple[float, float]] | None = None  # checksums of the last sync that passed
        self.seconds: list[float] = []  # what each check cost (the log-probabilities on both sides)

    def due(self) -> bool:
        """Count a sync; True if this one is checked (the same answer on every rank)."""
        self.syncs += 1
        return self.every > 0 and (self.syncs - 1) % self.every == 0

    def verify(self, llm, model, device, sent: dict[str, tuple[float, float]], walk, where: str) -> float:
        """Compare vLLM's and the trainer's log-probabilities after a sync; raise ``SyncError`` if they differ.

        Args:
            llm: the colocated ``vllm.LLM``.
            model: the trainer's policy (PEFT or plain; its forward runs on every rank).
            device: the trainer's device.
            sent: ``checksums`` of what the sync sent.
            walk: a callable giving the trainer's current ``(name, tensor)`` stream again (only on a failure, to name
                the tensors; a collective under ZeRO-3, as every rank fails together).
            where: the step, in words, for the message.

        Returns:
            The largest difference found.

        Raises:
            SyncError: the difference exceeds ``atol``.
        """
        start = time.perf_counter()
        ours = trainer_logprobs(model, self.tokens, device)
        theirs = engine_logprobs(llm, self.tokens)
        self.seconds.append(time.perf_counter() - start)
        diff = _largest_on_any_rank(float((ours - theirs).abs().max()))
        if diff <= self.atol:
            self.landed = sent
            return diff
        now = checksums(walk())
        broken = sorted(n for n in now if _differ(now[n], sent.get(n)))
        unsent = sorted(set(sent) - set(now))
        if broken or unsent:
            names = broken + [f"{n} (not the trainer's)" for n in unsent]
            why = "the values sent differ from the trainer's weights"
        else:
            names = sorted(n for n in sent if self.landed is None or _differ(sent[n], self.landed.get(n)))
            why = ("vLLM did not apply them; these changed since the last sync that passed" if self.landed
                   else "vLLM did not apply them (no earlier sync passed a check: every tensor sent)")
        shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        raise SyncError(f"The weight sync into vLLM did not land {where}: vLLM's prompt log-probabilities differ from "
                        f"the trainer's by {diff:.3g} (vllm_check_sync_atol={self.atol:g}); {why}: {shown}. Training "
                        "stopped so as not to learn from rollouts of other weights.",
                        detail=names[0] if names else None)
