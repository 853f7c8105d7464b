"""GGUF files: metadata -> ModelConfig, tensors -> float32 with HF names.

Three things about GGUF that are easy to get wrong:

- Shapes are stored innermost-first (ggml's ne[0] is the row length), the
  reverse of torch. gguf's reader already exposes the data in row-major
  order, so the torch shape is the stored shape reversed.
- llama.cpp's converter permutes the rows of attn_q and attn_k of Llama-family
  checkpoints so that each head's rotary pairs sit next to each other (its
  interleaved "GPT-J" rotary layout). HF's layout rotates the first half of a
  head against the second half. The permutation is undone here; without that
  the model runs and produces fluent-looking garbage. Qwen2/Qwen3 GGUFs use
  llama.cpp's NEOX rotary, which matches HF, and are stored unpermuted
  (transformers' GGUF loader permutes only for "llama").
- Llama-3.1 style rope scaling is not in the metadata; the converter bakes it
  into a `rope_freqs.weight` tensor of per-frequency factors, which is turned
  back into a RopeScaling here.

Each family says how llama.cpp's converter lays it out (a GGUFLayout, model/gguf_layout.py, in
its registry.Family entry; its metadata reader and tensor names sit in the family's own file):
the GGUF architecture string, whether q/k were permuted, the per-layer tensor names that differ
from the Llama ones, tensors stored fused (Phi-3's attn_qkv, and its ffn_up holding gate and up),
an offset the converter added to every norm weight (Gemma's 1), and the ModelConfig fields it
reads from the metadata. The permutation note above applies to the families the converter
handles as a Llama (Llama, Mistral, Granite, SmolLM3); the others keep HF's row order.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Iterator, Optional

import numpy as np
import torch

from rooflm.config import ModelConfig, RopeScaling
from rooflm.errors import load_error
from rooflm.model.gguf_layout import ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, GGUFLayout


# Tensor types gguf.quants.dequantize turns into float32 (F32/F16 are handled
# there directly, the rest by its numpy block decoders).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Tensors that are config, not weights.
CONFIG_TENSORS = (ROPE_FREQS_TENSOR, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)

GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# blk.N.<gguf module> -> model.layers.N.<HF module>; the .weight / .bias suffix carries over.
LAYER_MODULE_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# Mixture of experts (llama.cpp's names): the router, and each projection of every expert stacked
# into one [E, rows, cols] tensor, which is read as E per-expert HF tensors (the index is into the
# family's ModelSpec.expert_projs: gate, up, down).
ROUTER_TENSOR = "ffn_gate_inp"
EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# Qwen2-MoE's shared expert and its sigmoid gate ([1, H], as the converter writes HF's tensor)
SHARED_EXPERT_TENSORS = {"ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
                         "ffn_down_shexp": "shared_expert.down_proj", "ffn_gate_inp_shexp": "shared_expert_gate"}


def hf_tensor_names(gguf_name: str, layout: GGUFLayout,
                    config: ModelConfig) -> tuple[tuple[str, Optional[int]], ...]:
    """The HF parameter names a GGUF tensor holds, each with its rows (None: the whole tensor);
    empty if it has none."""
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return ((GLOBAL_TENSOR_NAMES[gguf_name], None),)
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None:
        return ()
    layer, module, suffix = match.groups()
    if module == ROUTER_TENSOR or module in EXPERT_TENSORS or module in SHARED_EXPERT_TENSORS:
        return _moe_tensor_names(int(layer), module, suffix, config)
    fused = layout.fused(config) if layout.fused is not None else {}
    if module in fused:
        return tuple((f"model.layers.{layer}.{part}.{suffix}", rows) for part, rows in fused[module])
    hf_module = layout.layer_tensors.get(module, LAYER_MODULE_NAMES.get(module))
    if hf_module is None:
        return ()
    return ((f"model.layers.{layer}.{hf_module}.{suffix}", None),)


def _moe_tensor_names(layer: int, module: str, suffix: str,
                      config: ModelConfig) -> tuple[tuple[str, Optional[int]], ...]:
    """The router's HF name, or the E per-expert names of a stacked expert tensor (one row
    of its dim 0 each); none in a dense model."""
    from rooflm.model.registry import model_spec

    if not config.num_experts:
        return ()
    spec = model_spec(config)
    block = f"model.layers.{layer}.{spec.moe_prefix}"
    if module == ROUTER_TENSOR:
        return ((f"{block}.gate.{suffix}", None),)
    if module in SHARED_EXPERT_TENSORS:
        return ((f"{block}.{SHARED_EXPERT_TENSORS[module]}.{suffix}", None),)
    proj = spec.expert_projs[EXPERT_TENSORS[module]]
    return tuple((f"{block}.experts.{e}.{proj}.{suffix}", 1) for e in range(config.num_experts))


def undo_rotary_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert_hf_to_gguf.py `permute` for q/k rows.

    The converter views each head's rows as (2, head_dim/2) -- HF's two
    rotary halves -- and transposes them to (head_dim/2, 2), interleaving the
    halves. Viewing as (head_dim/2, 2) and transposing back restores HF order.
    Works for a weight (rows, hidden) and for a bias (rows,).
    """
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    interleaved = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape).contiguous()


# ---------------------------------------------------------------------------
# Opening a file
# ---------------------------------------------------------------------------

class GGUFFile:
    """A parsed GGUF header: the reader (tensor data stays memory-mapped), the
    tensors by name, the family's layout, and the ModelConfig derived from them."""

    def __init__(self, path: str, reader: Any):
        self.path = path
        self.reader = reader
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}
        self.gguf_architecture = self._string_field("general.architecture")
        self.architecture, self.layout = _family_layout(self)
        self.config = _config_from_metadata(self)

    def arch_field(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>`, e.g. arch_field("attention.sliding_window")."""
        return self.field(f"{self.gguf_architecture}.{key}", default)

    def required_arch_field(self, key: str) -> Any:
        return self.required_field(f"{self.gguf_architecture}.{key}")

    def float_tensor(self, name: str) -> np.ndarray:
        """A (small, config) tensor's values as float32, flattened."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)

    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        if key in self.reader.skipped_arrays:
            raise load_error(self.path, f"GGUF metadata {key!r} is a long array this reader skips "
                                        f"({self.reader.skipped_arrays[key]} items)")
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as exc:
            raise load_error(self.path, f"GGUF metadata {key!r} is unreadable: {exc}") from exc

    def required_field(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise load_error(self.path, f"GGUF metadata has no {key!r}")
        return value

    def _string_field(self, key: str) -> str:
        value = self.required_field(key)
        if not isinstance(value, str):
            raise load_error(self.path, f"GGUF metadata {key!r} is not a string")
        return value


# Arrays longer than this are metadata rooflm never reads (the tokenizer's tokens, scores, types
# and merges: transformers converts the tokenizer from its own reader, once, into a cache).
LONG_ARRAY = 1024


def _header_reader(base: type) -> type:
    """gguf-py's GGUFReader, except that long arrays are stepped over, not parsed: the stock
    reader makes a numpy view per element, ~7 CPU-s for SmolLM2's 49k tokens and 48k merges,
    paid by every process that opens the default model. Their names and lengths stay in
    `skipped_arrays`; every other field and every tensor is the stock reader's."""
    import struct

    from gguf.constants import GGUFValueType

    class HeaderReader(base):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            count = int(alen[0])
            if count <= LONG_ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            itype = GGUFValueType(int(raw_itype[0]))
            offs = orig_offs + 12
            if itype == GGUFValueType.STRING:
                buf, unpack = memoryview(self.data), struct.Struct("<Q").unpack_from
                for _ in range(count):
                    offs += 8 + unpack(buf, offs)[0]
            elif itype in self.gguf_scalar_to_np:
                offs += count * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            else:  # arrays of arrays: rare and short in practice; the stock walk handles them
                return super()._get_field_parts(orig_offs, raw_type)
            self._skipped_count = count
            return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]

        def __init__(self, path, mode="r"):
            self.skipped_arrays: dict[str, int] = {}
            self._skipped_count = None
            super().__init__(path, mode)

        def _push_field(self, field, skip_sum: bool = False) -> int:
            count = self._skipped_count
            if count is not None:
                self.skipped_arrays[field.name] = count
                self._skipped_count = None
            return super()._push_field(field, skip_sum)

    return HeaderReader


# Callers read the config and then the weights of the same file, so the last file parsed is
# kept (its tensors stay memory-mapped), keyed by its identity on disk so an edited or replaced
# file is read again.
_last_opened: Optional[tuple[tuple[str, int, int], GGUFFile]] = None


def _file_identity(path: str) -> tuple[str, int, int]:
    try:
        stat = os.stat(path)
    except FileNotFoundError as exc:
        raise load_error(path, "GGUF file not found") from exc
    except OSError as exc:
        raise load_error(path, f"cannot read GGUF file: {exc}") from exc
    if not os.path.isfile(path):
        raise load_error(path, "not a file; a GGUF model is a single .gguf file")
    return os.path.realpath(path), stat.st_size, stat.st_mtime_ns


def _open(path: str) -> GGUFFile:
    global _last_opened
    identity = _file_identity(path)
    if _last_opened is not None and _last_opened[0] == identity:
        return _last_opened[1]

    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise load_error(path, "reading GGUF files needs the `gguf` package "
                               "(pip install gguf); it is not installed") from exc
    try:
        reader = _header_reader(GGUFReader)(path)
    except Exception as exc:  # bad magic, short file, bad field types: all ValueError/IndexError inside gguf
        raise load_error(path, f"not a valid GGUF file (corrupt or truncated): "
                               f"{type(exc).__name__}: {exc}") from exc
    opened = GGUFFile(path, reader)
    _last_opened = (identity, opened)
    return opened


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------

def load_gguf_config(path: str) -> ModelConfig:
    return _open(path).config


def layer_weight_types(path: str) -> dict[str, int]:
    """GGML type name ("Q4_1", "Q6_K", "F16", ...) -> parameters of the decoder layers' matrices
    stored in it, read from the (cached) header: what the roofline and memory tools need to know
    the bytes a step reads."""
    counts: dict[str, int] = {}
    for name, tensor in _open(path).tensors.items():
        if name.startswith("blk.") and len(tensor.shape) >= 2:  # 3-D: the stacked experts
            kind = tensor.tensor_type.name
            counts[kind] = counts.get(kind, 0) + int(tensor.n_elements)
    return counts


def tensor_type(path: str, name: str) -> Optional[str]:
    """The GGML type name of one tensor ("Q8_0", "F16", ...) from the cached header, or None
    where the file has no such tensor (a second GGUFReader costs seconds on a 49k vocabulary)."""
    tensor = _open(path).tensors.get(name)
    return tensor.tensor_type.name if tensor is not None else None


def _family_layout(gguf_file: GGUFFile) -> tuple[str, GGUFLayout]:
    """(HF architecture, GGUFLayout) of the file's general.architecture."""
    from rooflm.model.registry import GGUF_ARCHITECTURES, GGUF_MOE_ARCHITECTURES, get_family

    gguf_arch = gguf_file.gguf_architecture
    experts = int(gguf_file.arch_field("expert_count", 0) or 0)
    if gguf_arch in GGUF_MOE_ARCHITECTURES and (experts or gguf_arch not in GGUF_ARCHITECTURES):
        architecture = GGUF_MOE_ARCHITECTURES[gguf_arch]
    elif gguf_arch in GGUF_ARCHITECTURES:
        if experts:
            raise load_error(gguf_file.path, f"GGUF architecture {gguf_arch!r} with {experts} experts: rooflm "
                                             f"runs mixture-of-experts GGUFs of "
                                             f"{', '.join(GGUF_MOE_ARCHITECTURES)} only")
        architecture = GGUF_ARCHITECTURES[gguf_arch]
    else:
        known = sorted(set(GGUF_ARCHITECTURES) | set(GGUF_MOE_ARCHITECTURES))
        raise load_error(
            gguf_file.path, f"unsupported GGUF architecture {gguf_arch!r}; rooflm runs {', '.join(known)}")
    return architecture, get_family(architecture).gguf


def _config_from_metadata(gguf_file: GGUFFile) -> ModelConfig:
    from rooflm.model.registry import model_spec

    path = gguf_file.path
    arch_field, required_arch_field = gguf_file.arch_field, gguf_file.required_arch_field

    tensors = gguf_file.tensors
    if "token_embd.weight" not in tensors:
        raise load_error(path, "GGUF has no token_embd.weight tensor")

    hidden_size = int(required_arch_field("embedding_length"))
    num_heads = int(required_arch_field("attention.head_count"))
    num_kv_heads = int(arch_field("attention.head_count_kv", num_heads))
    # The embedding's rows are the vocabulary the weights were trained with; the
    # token list can differ (padding), and the weights are what must line up.
    vocab_size = int(tensors["token_embd.weight"].shape[1])

    # head_dim is not always hidden/heads (Qwen3: 128 with hidden 1024 and 16 heads).
    head_dim = arch_field("attention.key_length")
    if head_dim is None and "blk.0.attn_q.weight" in tensors:
        head_dim = int(tensors["blk.0.attn_q.weight"].shape[1]) // num_heads
    if head_dim is None:
        head_dim = hidden_size // num_heads
    head_dim = int(head_dim)

    rope_theta = float(arch_field("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling_from_metadata(gguf_file)
    if ROPE_FREQS_TENSOR in tensors:
        rope_scaling = _rope_scaling_from_factors(gguf_file, head_dim, rope_theta)

    eos_token_id = gguf_file.field("tokenizer.ggml.eos_token_id")
    bos_token_id = gguf_file.field("tokenizer.ggml.bos_token_id")

    fields: dict[str, Any] = dict(
        architecture=gguf_file.architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(required_arch_field("feed_forward_length")),
        num_hidden_layers=int(required_arch_field("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        # Kept as the float32 stored in the file (1e-5 reads as 9.99999975e-06),
        # the value transformers' GGUF loader uses too.
        rms_norm_eps=float(required_arch_field("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(arch_field("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos_token_id is None else int(bos_token_id),
        eos_token_ids=() if eos_token_id is None else (int(eos_token_id),),
    )
    try:
        fields.update(gguf_file.layout.config_fields(gguf_file, fields))
        config = ModelConfig(**fields)
        model_spec(config)  # a config its family cannot map to parts fails here, named
        return config
    except (KeyError, TypeError, ValueError) as exc:
        raise load_error(path, f"invalid {gguf_file.gguf_architecture} model metadata: {exc}") from exc


def _rope_scaling_from_metadata(gguf_file: GGUFFile) -> Optional[RopeScaling]:
    """rope.scaling.type as convert_hf_to_gguf.py writes it for any family: "linear" with its
    factor (Gemma 3's global layers); LongRoPE's factors are tensors its family reads
    (phi3.gguf_config); any other scaling is not one rooflm runs."""
    kind = gguf_file.arch_field("rope.scaling.type")
    if kind in (None, "none", "longrope"):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(gguf_file.required_arch_field("rope.scaling.factor")))
    raise load_error(gguf_file.path, f"GGUF rope scaling {kind!r} is not supported; rooflm runs plain RoPE "
                                     f"and 'linear', 'llama3' and 'longrope' scaling")


def llama3_rope_factors(head_dim: int, rope_theta: float, scaling: RopeScaling) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight."""
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (rope_theta ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
                      / (scaling.high_freq_factor - scaling.low_freq_factor))
            factors.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(factors, dtype=np.float32)


def _rope_scaling_from_factors(gguf_file: GGUFFile, head_dim: int,
                               rope_theta: float) -> Optional[RopeScaling]:
    """Recover Llama-3.1 scaling from rope_freqs.weight.

    The tensor fixes the factor (its largest entry) but not the other three
    parameters uniquely, so the ones every Llama 3.x release uses (low 1,
    high 4, original context 8192, or the file's recorded original context)
    are tried and the result is accepted only if it reproduces the tensor.
    """
    factors = gguf_file.float_tensor(ROPE_FREQS_TENSOR)
    if factors.shape[0] != head_dim // 2:
        raise load_error(gguf_file.path, f"{ROPE_FREQS_TENSOR} has {factors.shape[0]} entries, "
                                         f"expected head_dim/2 = {head_dim // 2}")
    if np.allclose(factors, 1.0):
        return None
    original_contexts = [8192]
    recorded = gguf_file.field(f"{gguf_file.gguf_architecture}.rope.scaling.original_context_length")
    if recorded is not None:
        original_contexts.insert(0, int(recorded))
    for original_context in original_contexts:
        candidate = RopeScaling("llama3", float(factors.max()), 1.0, 4.0, original_context)
        if np.allclose(llama3_rope_factors(head_dim, rope_theta, candidate), factors, rtol=1e-4):
            return candidate
    raise load_error(gguf_file.path, f"{ROPE_FREQS_TENSOR} holds rope scaling factors that do not "
                                     f"match Llama-3.1 style scaling; not supported")


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

def open_gguf_weights(path: str, keep_quantized: bool = False
                      ) -> tuple[ModelConfig, Iterator[tuple[str, Any, str]]]:
    """The config, and a stream of (HF name, float32 tensor, path).

    With keep_quantized, 2-D tensors in a block format rooflm.quant multiplies directly
    (Q4_0, Q4_1, Q8_0, Q4_K) come as rooflm.quant.gguf_blocks.BlockTensor instead, un-permuted and
    cut the same way; the model decides what to do with them.

    Names and tensor types are checked up front so an unusable file fails
    before any weight is dequantized.
    """
    gguf_file = _open(path)
    for tensor in gguf_file.reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        if not hf_tensor_names(tensor.name, gguf_file.layout, gguf_file.config):
            raise load_error(path, f"unknown tensor {tensor.name!r} (no HF equivalent for a "
                                   f"{gguf_file.gguf_architecture} model)")
        if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise load_error(path, f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                                   f"which rooflm cannot dequantize (supported: "
                                   f"{', '.join(SUPPORTED_TENSOR_TYPES)})")
    return gguf_file.config, _iter_tensors(gguf_file, keep_quantized)


def _rotary_row_order(rows: int, num_heads: int) -> np.ndarray:
    """The row order undo_rotary_permutation applies, as indices (for block-quantized rows)."""
    return undo_rotary_permutation(torch.arange(rows), num_heads).numpy()


def _read(gguf_file: GGUFFile, tensor: Any, keep_quantized: bool) -> Any:
    """A GGUF tensor in torch's shape: float32, or a BlockTensor where kept quantized."""
    from gguf.quants import dequantize

    from rooflm.quant import gguf_blocks

    torch_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if keep_quantized and tensor.tensor_type.name in gguf_blocks.FORMATS and len(torch_shape) == 2:
        return gguf_blocks.decode(tensor.tensor_type.name, tensor.data, torch_shape)
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        raise load_error(gguf_file.path, f"cannot dequantize tensor {tensor.name!r} of type "
                                         f"{tensor.tensor_type.name}: {exc}") from exc
    # F32 comes back as a read-only view of the memory map; the model needs its own copy.
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values).reshape(torch_shape)


def _rows(tensor: Any, start: int, size: int) -> Any:
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(0, start, size)
    return tensor.rows(np.arange(start, start + size))  # a BlockTensor: whole rows of blocks


def _unpermute(tensor: Any, num_heads: int) -> Any:
    if isinstance(tensor, torch.Tensor):
        return undo_rotary_permutation(tensor, num_heads)
    return tensor.rows(_rotary_row_order(tensor.shape[0], num_heads))


def _iter_tensors(gguf_file: GGUFFile, keep_quantized: bool = False) -> Iterator[tuple[str, Any, str]]:
    config, layout = gguf_file.config, gguf_file.layout
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    for tensor in gguf_file.reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        # only 2-D weights stay in blocks (a bias or norm is dequantized whatever its type)
        whole = _read(gguf_file, tensor, keep_quantized and tensor.name.endswith(".weight"))
        start = 0
        for name, rows in hf_tensor_names(tensor.name, layout, config):
            weight = whole
            if rows is not None and len(whole.shape) == 3:  # stacked experts: one expert a name
                weight, start = whole[start], start + rows
            elif rows is not None:
                weight, start = _rows(whole, start, rows), start + rows
            module = name.rpartition(".")[0].split(".", 3)[-1]
            if layout.rotary_permuted and module in heads:
                weight = _unpermute(weight, heads[module])
            if layout.norm_offset and name.endswith("norm.weight"):
                weight = weight - layout.norm_offset
            yield name, weight, gguf_file.path
