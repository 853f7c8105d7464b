"""The fast paths belong to the parts: for every family's choice of parts, one token through the
GEMV chain and through quantized linears that fold gives the plain layer's residual stream, the
parts without a fused form (post-norms, GELU-tanh, no pre-norm, (1 + w) norms) run apart.

The GEMV kernel's torch reference (kernels/gemv.py gemv_ref, same contract) stands in for the
Triton GEMV, and a torch method with W4A16Linear's folding contract for the quantized kernel;
tests/models/test_gpu_e2e.py runs the real kernels on the GPU."""

import pytest
import torch

from rooflm.config import ModelConfig
from rooflm.kernels.gemv import gemv_ref
from rooflm.kernels.rmsnorm import rmsnorm_ref
from rooflm.layers.activation import silu_and_mul_torch
from rooflm.layers.kernels import Kernels
from rooflm.model.decoder import DecoderLayer
from rooflm.model.spec import GELU_TANH, QK_NORM_HEAD, QK_NORM_PROJ, RMS_ONE_PLUS, ModelSpec
from rooflm.quant.linear_method import QuantizedLinearMethod

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=120, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)

SPECS = {
    "llama": ModelSpec(),
    "qwen3": ModelSpec(qk_norm=QK_NORM_HEAD),
    "olmo2": ModelSpec(pre_attn_norm=None, post_attn_norm="post_attention_layernorm", pre_mlp_norm=None,
                       post_mlp_norm="post_feedforward_layernorm", qk_norm=QK_NORM_PROJ),
    "gemma2": ModelSpec(post_attn_norm="post_attention_layernorm", pre_mlp_norm="pre_feedforward_layernorm",
                        post_mlp_norm="post_feedforward_layernorm", norm=RMS_ONE_PLUS, mlp_act=GELU_TANH),
    "gemma-silu": ModelSpec(post_attn_norm="post_attention_layernorm", pre_mlp_norm="pre_feedforward_layernorm",
                            post_mlp_norm="post_feedforward_layernorm", norm=RMS_ONE_PLUS),
}


def _layer(spec: ModelSpec, gemv=None, rmsnorm=None) -> DecoderLayer:
    torch.manual_seed(0)
    layer = DecoderLayer(CFG, spec, None, None, None, Kernels(gemv=gemv, rmsnorm=rmsnorm))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    for module in layer.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    # attention's stand-in: the K/V cache plays no part in what these paths fuse
    layer.self_attn.attend = lambda positions, qkv, kv_cache, meta: torch.tanh(qkv[:, :16])
    return layer


def _stream(out):
    h, residual = out
    return h if residual is None else h + residual


@pytest.mark.parametrize("name", sorted(SPECS))
def test_gemv_chain_gives_the_plain_layer(name):
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    plain = _stream(_layer(SPECS[name])(None, x, residual, None, None))
    h, none = _layer(SPECS[name], gemv_ref)(None, x, residual, None, None)
    assert none is None
    torch.testing.assert_close(h, plain, rtol=1e-5, atol=1e-5)
    # with the norm kernel's contract too: post-norms add in it (RMSNorm.add_to's post_add)
    h, _ = _layer(SPECS[name], gemv_ref, rmsnorm_ref)(None, x, residual, None, None)
    torch.testing.assert_close(h, plain, rtol=1e-5, atol=1e-5)


class Folding(QuantizedLinearMethod):
    """W4A16Linear's folding contract, in torch; records what each call folded."""

    can_fold = True

    def __init__(self, weight):
        super().__init__()
        self.weight = weight
        self.calls = []

    def forward(self, x):
        return x @ self.weight.T

    def gate_up_silu_mul(self, x):
        return silu_and_mul_torch(self.forward(x))

    def folded(self, x, *, norm_weight=None, eps=1e-6, residual=None, gated=False):
        self.calls.append((norm_weight is not None, residual is not None, gated))
        y = (rmsnorm_ref(x, norm_weight, eps) if norm_weight is not None else x) @ self.weight.T
        y = silu_and_mul_torch(y) if gated else y
        return y + residual if residual is not None else y


# What each linear folds, (norm, residual, gated), per family: Llama folds everything; a
# post-norm keeps the residual add apart (o_proj and down then run unfolded); a sublayer without
# a pre-norm folds no norm; GELU-tanh keeps gate_up unfused. A (1 + w) norm's fp32 weight folds
# here because the activations are fp32 too (under bf16 the kernel, which takes x's dtype, does not).
FOLDS = {
    "llama": [[(True, False, False)], [(False, True, False)], [(True, False, True)], [(False, True, False)]],
    "qwen3": [[(True, False, False)], [(False, True, False)], [(True, False, True)], [(False, True, False)]],
    "olmo2": [[(False, False, False)], [], [], []],
    "gemma2": [[(True, False, False)], [], [], []],
    "gemma-silu": [[(True, False, False)], [], [(True, False, True)], []],
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_folded_quantized_linears_give_the_plain_layer(name):
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    layer = _layer(SPECS[name])
    plain = _stream(layer(None, x, residual, None, None))
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    for lin in linears:
        lin.quant = Folding(lin.weight.detach().clone())
    h, none = layer(None, x, residual, None, None)
    assert none is None
    torch.testing.assert_close(h, plain, rtol=1e-5, atol=1e-5)
    assert [lin.quant.calls for lin in linears] == FOLDS[name]


def test_one_plus_norm_fused_weight_follows_the_loaded_weight():
    layer = _layer(SPECS["gemma2"])
    norm = layer.pre_attn
    assert torch.equal(norm.fused_weight, 1.0 + norm.weight.float())
    with torch.no_grad():
        norm.weight.fill_(0.25)
    pointer = norm.fused_weight.data_ptr()
    norm.finish_loading()
    assert norm.fused_weight.data_ptr() == pointer  # in place: captured CUDA graphs read it
    assert torch.all(norm.fused_weight == 1.25)
