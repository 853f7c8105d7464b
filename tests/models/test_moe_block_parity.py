"""rooflm's SparseMoeBlock (rooflm/layers/moe.py) against transformers' MoE blocks on tiny random
configs in fp32: Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE (shared expert) and gpt-oss. The weights
reach rooflm through load_weight under the names the Hub checkpoints use; tensor-parallel
shards sum to the whole block."""

from types import SimpleNamespace

import pytest
import torch

from rooflm.layers.moe import MoeConfig, Router, SparseMoeBlock

transformers = pytest.importorskip("transformers")

HIDDEN = 32


def _random_init(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def hf_block(family: str, **overrides):
    """(transformers block, its config) for a family, eager experts, random weights."""
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=2, experts_implementation="eager")
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock as B
        cfg = Qwen3MoeConfig(**common, moe_intermediate_size=48, num_experts=8, norm_topk_prob=True)
    elif family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock as B
        cfg = MixtralConfig(**common, intermediate_size=64, num_local_experts=4)
    elif family == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock as B
        cfg = OlmoeConfig(**common, intermediate_size=32, num_experts=8, norm_topk_prob=False)
    elif family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock as B
        cfg = Qwen2MoeConfig(**common, moe_intermediate_size=32, num_experts=6, norm_topk_prob=False,
                             shared_expert_intermediate_size=64)
    elif family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssMLP as B
        cfg = GptOssConfig(**common, intermediate_size=32, num_local_experts=4)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    block = B(cfg).eval()
    _random_init(block, seed=len(family))
    return block, cfg


def hub_checkpoint(family: str, block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's weights under the Hub checkpoints' names (per-expert for all but gpt-oss,
    whose checkpoints store the experts stacked, as transformers holds them)."""
    state = block.state_dict()
    if family == "gpt_oss":
        return state
    out = {"gate.weight": state["gate.weight"]}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    inter = gate_up.shape[1] // 2
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(gate_up.shape[0]):
        out[f"experts.{e}.{names[0]}.weight"] = gate_up[e, :inter].clone()
        out[f"experts.{e}.{names[1]}.weight"] = gate_up[e, inter:].clone()
        out[f"experts.{e}.{names[2]}.weight"] = down[e].clone()
    for key, value in state.items():
        if key.startswith("shared_expert"):
            out[key] = value
    return out


def rooflm_block(family, hf_cfg, checkpoint, tp=None, expert_parallel=False) -> SparseMoeBlock:
    block = SparseMoeBlock(MoeConfig.from_hf(hf_cfg), tp=tp, expert_parallel=expert_parallel)
    for p in block.parameters():  # poison: a weight the loader missed shows as NaN
        p.data.fill_(float("nan"))
    for name, tensor in checkpoint.items():
        block.load_weight(name, tensor)
    return block


def hf_forward(family, block, x):
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)


FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_block_matches_transformers(family, num_tokens):
    hf, cfg = hf_block(family)
    ours = rooflm_block(family, cfg, hub_checkpoint(family, hf))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        want = hf_forward(family, hf, x)
        got = ours(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_norm_topk_prob_follows_the_config(family):
    """Both settings of norm_topk_prob, and the router's choices equal HF's."""
    for norm in (True, False):
        hf, cfg = hf_block(family, norm_topk_prob=norm)
        ours = rooflm_block(family, cfg, hub_checkpoint(family, hf))
        x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            _, hf_weights, hf_ids = hf.gate(x)
            weights, ids = ours.router(x)
            torch.testing.assert_close(ours(x), hf_forward(family, hf, x), rtol=1e-5, atol=1e-5)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights.float())
        assert torch.allclose(weights.sum(-1), torch.ones(9)) == norm


def test_stacked_transformers_layout_loads_too():
    """transformers 5's in-memory names (experts.gate_up_proj [E, 2I, H]) as well as per-expert."""
    hf, cfg = hf_block("qwen3_moe")
    ours = rooflm_block("qwen3_moe", cfg, hf.state_dict())
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf_forward("qwen3_moe", hf, x), rtol=1e-5, atol=1e-5)


def assert_two_ranks_sum_to_the_block(family, check_rank, expert_parallel=False):
    """Two ranks' blocks (before the all-reduce) on the same input add up to HF's one-rank block;
    check_rank(block) asserts what each rank holds."""
    hf, cfg = hf_block(family)
    checkpoint = hub_checkpoint(family, hf)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    partials = []
    for rank in range(2):
        tp = SimpleNamespace(rank=rank, size=2, all_reduce=lambda t: t)
        block = rooflm_block(family, cfg, checkpoint, tp=tp, expert_parallel=expert_parallel)
        check_rank(block.experts)
        with torch.no_grad():
            partials.append(block(x))
    with torch.no_grad():
        want = hf_forward(family, hf, x)
    torch.testing.assert_close(partials[0] + partials[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_tensor_parallel_shards_sum_to_the_block(family):
    """The intermediate split of experts and shared expert, and gpt-oss's down bias added once."""
    def half_of_each_expert(experts):
        assert experts.w2.shape[-1] == experts.cfg.intermediate_size // 2
    assert_two_ranks_sum_to_the_block(family, half_of_each_expert)


def test_loader_names_what_it_does_not_know():
    hf, cfg = hf_block("mixtral")
    block = SparseMoeBlock(MoeConfig.from_hf(cfg))
    with pytest.raises(KeyError, match="experts.0.w4.weight"):
        block.load_weight("experts.0.w4.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="checkpoint shape"):
        block.load_weight("gate.weight", torch.zeros(3, HIDDEN))
    with pytest.raises(ValueError, match="expert 9 out of range"):
        block.load_weight("experts.9.w1.weight", torch.zeros(64, HIDDEN))


def test_config_checks_and_gpt_oss_router():
    with pytest.raises(ValueError, match="top_k"):
        MoeConfig(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8)
    cfg = MoeConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, scoring="softmax_topk", router_bias=True)
    router = Router(cfg)
    _random_init(router, 0)
    x = torch.randn(5, 8)
    logits = x @ router.weight.T + router.bias
    weights, ids = router(x)
    assert torch.equal(ids, logits.topk(2).indices)
    torch.testing.assert_close(weights, torch.softmax(logits.topk(2).values, -1))


def routed_output(block: SparseMoeBlock, x: torch.Tensor, weights, ids) -> torch.Tensor:
    """The block's output for a given routing: the experts (+ the shared expert)."""
    out = block.experts(x, weights, ids)
    return out if block.shared_expert is None else out + block.shared_expert(x)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_fused_path_matches_the_torch_path_bf16(family, num_tokens):
    """The block on CUDA with Kernels.fused_moe and the same block's torch experts loop, both
    bf16, each against an fp32 run of the torch path by relative error (DESIGN.md's method).
    All three take the bf16 router's choice: a near-tie that bf16 breaks the other way would
    move a whole token to another expert, which is not the kernels' error."""
    from rooflm.kernels.fused_moe import fused_moe
    from rooflm.layers.kernels import Kernels
    hf, cfg = hf_block(family)
    checkpoint = hub_checkpoint(family, hf)
    ref = rooflm_block(family, cfg, checkpoint).cuda()
    torch_bf16 = rooflm_block(family, cfg, checkpoint).cuda().to(torch.bfloat16)
    fused = SparseMoeBlock(MoeConfig.from_hf(cfg), kernels=Kernels(fused_moe=fused_moe))
    for name, tensor in checkpoint.items():
        fused.load_weight(name, tensor)
    fused = fused.cuda().to(torch.bfloat16)
    x = torch.randn(num_tokens, HIDDEN, device="cuda")
    xb = x.bfloat16()
    with torch.no_grad():
        weights, ids = fused.router(xb)
        want = routed_output(ref, x, weights, ids)
        results = {"torch bf16": routed_output(torch_bf16, xb, weights, ids),
                   "fused bf16": routed_output(fused, xb, weights, ids),
                   "fused block": fused(xb)}
    for what, got in results.items():
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 1e-2, f"{what}: relative error {err:.3e}"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_expert_parallel_ranks_sum_to_the_block(family):
    """--enable-expert-parallel: each of two ranks holds half the experts whole (their biases
    too) and the shared expert's half; the ranks' parts add up to the one-rank block."""
    def half_the_experts_whole(experts):
        assert experts.w13.shape[0] == experts.cfg.num_experts // 2
        assert experts.w2.shape[-1] == experts.cfg.intermediate_size
    assert_two_ranks_sum_to_the_block(family, half_the_experts_whole, expert_parallel=True)


def test_expert_parallel_needs_experts_that_split_evenly():
    cfg = MoeConfig(num_experts=6, top_k=2, hidden_size=HIDDEN, intermediate_size=16)
    with pytest.raises(ValueError, match="6 experts do not split evenly over 4 ranks"):
        SparseMoeBlock(cfg, tp=SimpleNamespace(rank=0, size=4, all_reduce=lambda t: t), expert_parallel=True)
