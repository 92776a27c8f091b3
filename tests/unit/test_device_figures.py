"""The device check's self-checks on made-up figures (bench/_device_figures.py): a measured peak below the memory floor
(weights + gradients of the trainable parameters + optimizer states) fails, one above passes, the CPU's missing peak is
reported, not judged; TRL's and trl_ext's figures are equal or their difference is named. The tests do not import
bench/ (tests/unit/test_layout.py): the module answers one JSON request per run of its file.
"""


from tests.harness import ask_bench

GIB = 2**30
# The bench's 0.5B shape (494,005,120 parameters), bf16, full fine-tune, AdamW (two bf16 moments): 0.92 GiB each of
# weights and gradients, 1.84 GiB of optimizer states, a 3.68 GiB floor
PARAMS = 494_005_120
FULL = {"trainable_params": PARAMS, "weights_bytes": 2 * PARAMS, "ref_weights_bytes": 0, "gradient_bytes": 2 * PARAMS,
        "optimizer_state_bytes": 4 * PARAMS, "param_dtypes": ["bfloat16"],
        "gradient_checkpointing": "non-reentrant (24/24 layers)", "attn_implementation": "sdpa",
        "optimizer": "AdamW (fused=None, foreach=None)", "input_grad_hooks": 0}
FLOOR = 8 * PARAMS


def ask(request: dict) -> dict:
    return ask_bench("_device_figures.py", request)


def test_floor_and_comparison():
    lora = {**FULL, "trainable_params": 8_798_208, "gradient_bytes": 2 * 8_798_208,
            "optimizer_state_bytes": 8 * 8_798_208}  # fp32 adapter: two fp32 moments
    reentrant = {**FULL, "gradient_checkpointing": "reentrant (24/24 layers)"}
    answer = ask({
        "floor": [[2.35 * GIB, FULL],  # the 2026-11-28 table's trl_ext SFT full: below any possible floor
                  [FLOOR - 1, FULL], [FLOOR, FULL], [5.1 * GIB, FULL], [None, FULL],
                  [2.35 * GIB, lora]],  # LoRA: the frozen weights and a small adapter fit under 2.35 GiB
        "compare": [[FULL, FULL], [reentrant, FULL], [FULL, reentrant], [FULL, lora],
                    [FULL, {**FULL, "attn_implementation": "eager", "param_dtypes": ["bfloat16", "float32"]}],
                    [{**FULL, "input_grad_hooks": 1}, FULL], [FULL, {**FULL, "input_grad_hooks": 1}],
                    [FULL, {**FULL, "optimizer": "AdamW (fused=True, foreach=None)"}]],
    })
    below, just_below, at, above, cpu, lora_ok = answer["floor"]
    assert below["ok"] is False and below["floor_bytes"] == FLOOR
    assert below["reason"].startswith("peak 2.35 GiB is below its floor 3.68 GiB (weights 0.92 GiB + gradients "
                                      "0.92 GiB + optimizer states 1.84 GiB)"), below["reason"]
    assert "\n" not in below["reason"]
    assert just_below["ok"] is False
    assert at["ok"] is True and above["ok"] is True and lora_ok["ok"] is True
    assert cpu["ok"] is None and cpu["floor_bytes"] == FLOOR and "not checked" in cpu["reason"]

    same, ours_non_reentrant, ours_reentrant, lora_vs_full, other, hook_removed, hook_added, fused = answer["compare"]
    assert all(row["equal"] and row["verdict"] == "equal" for row in same["rows"]) and same["unexplained"] == []
    labels = [row["figure"] for row in same["rows"]]
    for label in ("trainable params", "optimizer state after step 1", "parameter dtypes", "gradient checkpointing",
                  "attention", "optimizer", "input-embedding forward hooks"):
        assert label in labels
    # trl_ext's non-reentrant checkpointing is its purpose: named, not unexplained
    (row,) = [r for r in ours_non_reentrant["rows"] if not r["equal"]]
    assert row["verdict"].startswith("gradient checkpointing: TRL reentrant (24/24 layers), trl_ext non-reentrant "
                                     "(24/24 layers) (trl_ext's purpose"), row["verdict"]
    assert ours_non_reentrant["unexplained"] == []
    # the other way round is no purpose of trl_ext's
    assert ours_reentrant["unexplained"] == ["gradient checkpointing: TRL non-reentrant (24/24 layers), trl_ext "
                                             "reentrant (24/24 layers) (UNEXPLAINED: not a difference trl_ext makes "
                                             "on purpose)"]
    assert lora_vs_full["unexplained"][:2] == [
        "trainable params: TRL 494,005,120, trl_ext 8,798,208 (UNEXPLAINED: not a difference trl_ext makes on "
        "purpose)",
        "optimizer state after step 1: TRL 1.84 GiB, trl_ext 67.1 MiB (UNEXPLAINED: not a difference trl_ext makes on "
        "purpose)"]
    assert [v.split(" (")[0] for v in other["unexplained"]] == [
        "parameter dtypes: TRL bfloat16, trl_ext bfloat16, float32", "attention: TRL sdpa, trl_ext eager"]
    # TRL's input-require-grads hook, removed by trl_ext on purpose: named; a hook trl_ext adds, or another optimizer,
    # is not a difference trl_ext makes
    (row,) = [r for r in hook_removed["rows"] if not r["equal"]]
    assert row["verdict"].startswith("input-embedding forward hooks: TRL 1, trl_ext 0 (trl_ext removes TRL's "
                                     "input-require-grads hook"), row["verdict"]
    assert hook_removed["unexplained"] == []
    assert [v.split(" (")[0] for v in hook_added["unexplained"]] == ["input-embedding forward hooks: TRL 0, trl_ext 1"]
    assert [v.split(" (U")[0] for v in fused["unexplained"]] == [
        "optimizer: TRL AdamW (fused=None, foreach=None), trl_ext AdamW (fused=True, foreach=None)"]
