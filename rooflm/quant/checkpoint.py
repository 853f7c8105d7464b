"""Quantized HF checkpoints: which scheme config.json names, and their tensors grouped per linear.

config.json's `quantization_config` names the scheme (quant_method). rooflm reads:

  gptq  bits 4 (any group size, desc_act/g_idx, sym or asym) and bits 8 with group_size -1,
        checkpoint_format "gptq" (the v1 layout: zeros stored minus one; see formats.py)
  awq   bits 4, version "gemm", zero_point true (AutoAWQ's packing order)
  fp8   (vLLM/HF) per-tensor or per-channel weight_scale, activation_scheme dynamic or static
        (input_scale); weight_block_size is not supported
  compressed-tensors  format "float-quantized" with 8-bit float weights (channel or tensor
        strategy) and 8-bit float input activations (token/dynamic, tensor/static) or none;
        format "pack-quantized" (W4A16 / W8A16: int4 or int8 weights, group or channel strategy,
        symmetric or not, actorder with weight_g_idx; no input activations), see formats.py;
        other compressed-tensors formats (int-quantized W8A8, sparse) fail naming the format

  kv_cache_scheme (compressed-tensors, llm-compressor's FP8 K/V calibration): 8-bit float,
        strategy "tensor", static: one `self_attn.k_scale` / `v_scale` a layer, the FP8 cache's
        static scales under --kv-cache-dtype fp8 (layers/kv_cache.py); ignored by other caches

Anything else fails at load with the scheme named. A quantized linear's tensors
(`<prefix>.qweight`, `.qzeros`, `.scales`, `.g_idx`) are collected and yielded as one
`<prefix>.weight` in rooflm's runtime form (formats.GroupWeight / ChannelWeight), so the model's
loader sees the same names as for a float checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from rooflm.errors import load_error
from rooflm.quant import formats

_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
_OPTIONAL = {"g_idx"}


@dataclass(frozen=True)
class QuantScheme:
    method: str  # gptq | awq | fp8 | ct-packed (compressed-tensors pack-quantized)
    bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool = False
    sym: bool = True
    activations: str = ""  # fp8: dynamic | static | none (how the activations are quantized)

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 W8A8 ({self.activations} activations)" if self.activations != "none" else "fp8 weight-only"
        g = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        method = "compressed-tensors pack-quantized" if self.method == "ct-packed" else self.method
        return (f"{method} int{self.bits} {g}" + (" act-order" if self.desc_act else "")
                + ("" if self.sym or self.method != "ct-packed" else " asymmetric"))


def parse_kv_cache_scheme(cfg: dict[str, Any], config_path: str) -> bool:
    """Whether the checkpoint carries static per-tensor FP8 K/V scales (quantization_config's
    kv_cache_scheme); another K/V scheme raises, naming it."""
    scheme = (cfg.get("quantization_config") or {}).get("kv_cache_scheme")
    if not scheme:
        return False
    if not (isinstance(scheme, dict) and scheme.get("type") == "float" and int(scheme.get("num_bits") or 0) == 8
            and scheme.get("strategy") == "tensor" and not scheme.get("dynamic")):
        raise load_error(config_path, f"kv_cache_scheme {scheme} is not supported; rooflm reads static "
                                      f"per-tensor 8-bit float K/V scales (type float, num_bits 8, "
                                      f"strategy tensor, dynamic false)")
    return True


def parse_quant_config(cfg: dict[str, Any], config_path: str) -> Optional[QuantScheme]:
    """The scheme config.json declares, or None for a float checkpoint; unsupported ones raise."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "?")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 0)) or 0)
    group = int(qc.get("group_size", qc.get("q_group_size", -1)) or -1)
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise load_error(config_path, f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq', v1)")
        if bits == 4 or (bits == 8 and group == -1):
            return QuantScheme("gptq", bits, group, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)))
        raise load_error(config_path, f"GPTQ bits={bits} group_size={group} is not supported: rooflm runs "
                                      f"4-bit (any group size) and 8-bit per-channel (group_size -1)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise load_error(config_path, f"AWQ bits={bits} version={version!r} zero_point="
                                          f"{qc.get('zero_point')} is not supported (4-bit GEMM with zero points)")
        return QuantScheme("awq", 4, group)
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise load_error(config_path, f"fp8 weight_block_size {qc['weight_block_size']} (block-wise scales) "
                                          f"is not supported; rooflm reads per-tensor and per-channel fp8")
        act = str(qc.get("activation_scheme", "dynamic")).lower()
        if act not in ("dynamic", "static"):
            raise load_error(config_path, f"fp8 activation_scheme {act!r} is not supported (dynamic or static)")
        return QuantScheme("fp8", 8, -1, activations=act)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, config_path)
    if method == "mxfp4":  # gpt-oss's experts: dequantized to bf16 as they are read (model/mxfp4.py)
        return None
    raise load_error(config_path, f"quantization scheme {method!r} is not supported; rooflm loads "
                                  f"'gptq', 'awq', 'fp8' and compressed-tensors (fp8, pack-quantized "
                                  f"int4/int8) checkpoints (and GGUF Q4_0/Q4_1/Q8_0/Q4_K)")


def _compressed_tensors_scheme(qc: dict[str, Any], config_path: str) -> QuantScheme:
    """llm-compressor's FP8 / FP8_DYNAMIC (format float-quantized): one config group of 8-bit float
    weights, with 8-bit float activations per token (dynamic) or per tensor (static), or none."""
    fmt = str(qc.get("format", "?"))
    groups = list((qc.get("config_groups") or {}).values())
    if fmt == "pack-quantized" and groups:
        return _pack_quantized_scheme(groups, config_path)
    if fmt not in ("float-quantized", "naive-quantized") or not groups:
        raise load_error(config_path, f"compressed-tensors format {fmt!r} is not supported; rooflm reads "
                                      f"'float-quantized' fp8 (W8A8 or weight-only) and 'pack-quantized' "
                                      f"int4/int8 weight-only")
    acts = set()
    for group in groups:
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8 or w.get("strategy") not in ("channel", "tensor"):
            raise load_error(config_path, f"compressed-tensors weights {w.get('type')} {w.get('num_bits')}-bit "
                                          f"strategy {w.get('strategy')!r} are not supported (8-bit float, "
                                          f"channel or tensor)")
        a = group.get("input_activations")
        if a is None:
            acts.add("none")
        elif a.get("type") == "float" and int(a.get("num_bits", 0)) == 8 and a.get("strategy") in ("token", "tensor"):
            acts.add("dynamic" if a.get("dynamic") else "static")
        else:
            raise load_error(config_path, f"compressed-tensors input activations {a} are not supported "
                                          f"(8-bit float per token or per tensor, or none)")
    if len(acts) != 1:
        raise load_error(config_path, f"compressed-tensors groups mix activation schemes {sorted(acts)}")
    return QuantScheme("fp8", 8, -1, activations=acts.pop())


def _pack_quantized_scheme(groups: list[dict], config_path: str) -> QuantScheme:
    """llm-compressor's W4A16 / W8A16 (format pack-quantized): one weight scheme for every config
    group (several groups must agree: rooflm keeps one scheme a model), integer weights, no
    quantized activations."""
    schemes = set()
    for group in groups:
        w = group.get("weights") or {}
        strategy = w.get("strategy")
        bits = int(w.get("num_bits", 0))
        if w.get("type") != "int" or bits not in (4, 8) or strategy not in ("group", "channel"):
            raise load_error(config_path, f"compressed-tensors pack-quantized weights {w.get('type')} {bits}-bit "
                                          f"strategy {strategy!r} are not supported (int 4- or 8-bit, group or "
                                          f"channel)")
        if group.get("input_activations") is not None:
            raise load_error(config_path, f"compressed-tensors pack-quantized with input activations "
                                          f"{group['input_activations']} is not supported (weight-only)")
        size = int(w.get("group_size") or -1) if strategy == "group" else -1
        if strategy == "group" and size <= 0:
            raise load_error(config_path, "compressed-tensors group strategy without a group_size")
        actorder = w.get("actorder")
        if actorder not in (None, False, "group", "weight", "static", "dynamic"):
            raise load_error(config_path, f"compressed-tensors actorder {actorder!r} is not supported")
        # actorder "group" stores weight_g_idx (inputs assigned to groups out of order); "weight"
        # only ordered the quantization, and the groups stay contiguous
        schemes.add(QuantScheme("ct-packed", bits, size, actorder == "group", bool(w.get("symmetric", True))))
    if len(schemes) != 1:
        raise load_error(config_path, f"compressed-tensors config groups with different weight schemes "
                                      f"{sorted(s.describe() for s in schemes)} are not supported")
    return schemes.pop()


def group_quantized(stream: Iterator[tuple[str, torch.Tensor, str]], scheme: QuantScheme,
                    act_dtype: torch.dtype = torch.float16) -> Iterator[tuple[str, Any, str]]:
    """Pass float tensors through; collect each quantized linear's parts into `<prefix>.weight`."""
    if scheme.method == "fp8":
        yield from _group_fp8(stream, scheme)
        return
    if scheme.method == "ct-packed":
        yield from _group_packed(stream, scheme)
        return
    parts = _PARTS[scheme.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    sources: dict[str, str] = {}
    for name, tensor, source in stream:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in parts:
            yield name, tensor, source
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = tensor
        sources[prefix] = source
        if all(p in got for p in parts if p not in _OPTIONAL) and (
                scheme.method != "gptq" or "g_idx" in got):
            yield prefix + ".weight", _decode(scheme, pending.pop(prefix), act_dtype, source, prefix), source
    # GPTQ checkpoints without g_idx (older exports): decode what is complete.
    for prefix, got in pending.items():
        missing = [p for p in parts if p not in got and p not in _OPTIONAL]
        if missing:
            raise load_error(sources[prefix], f"quantized linear {prefix!r} lacks {', '.join(missing)}")
        yield prefix + ".weight", _decode(scheme, got, act_dtype, sources[prefix], prefix), sources[prefix]


def _decode(scheme: QuantScheme, t: dict[str, torch.Tensor], act_dtype, source: str, prefix: str):
    try:
        if scheme.method == "gptq":
            return formats.from_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), scheme.bits,
                                     scheme.group_size, act_dtype)
        return formats.from_awq(t["qweight"], t["qzeros"], t["scales"], scheme.group_size, act_dtype)
    except (ValueError, RuntimeError) as exc:
        raise load_error(source, f"cannot decode {scheme.describe()} linear {prefix!r}: {exc}") from exc


def _group_fp8(stream: Iterator[tuple[str, torch.Tensor, str]], scheme: QuantScheme) -> Iterator[tuple[str, Any, str]]:
    """fp8 linears keep the float name `<prefix>.weight` (an e4m3 tensor) beside `.weight_scale`
    and `.input_scale`: an e4m3 weight waits for its scales; float tensors pass through."""
    from rooflm.quant import fp8
    pending: dict[str, dict[str, torch.Tensor]] = {}
    sources: dict[str, str] = {}
    needs_input = scheme.activations == "static"

    def ready(got: dict) -> bool:
        return "weight" in got and "weight_scale" in got and (not needs_input or "input_scale" in got)

    for name, tensor, source in stream:
        prefix, _, leaf = name.rpartition(".")
        is_fp8_weight = leaf == "weight" and tensor.dtype == fp8.FP8_DTYPE
        if not (is_fp8_weight or leaf in ("weight_scale", "input_scale", "weight_zero_point", "input_zero_point")):
            yield name, tensor, source
            continue
        if leaf.endswith("zero_point"):
            if torch.count_nonzero(tensor):
                raise load_error(source, f"{name}: asymmetric fp8 (non-zero zero points) is not supported")
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = tensor
        sources[prefix] = source
        if ready(got):
            yield prefix + ".weight", _decode_fp8(scheme, pending.pop(prefix), source, prefix), source
    for prefix, got in pending.items():
        if not ready(got):
            missing = [p for p in ("weight", "weight_scale") + (("input_scale",) if needs_input else ()) if p not in got]
            raise load_error(sources[prefix], f"fp8 linear {prefix!r} lacks {', '.join(missing)}")


def _decode_fp8(scheme: QuantScheme, t: dict[str, torch.Tensor], source: str, prefix: str):
    from rooflm.quant import fp8
    try:
        return fp8.from_checkpoint(t["weight"], t["weight_scale"], t.get("input_scale"), scheme.activations)
    except ValueError as exc:
        raise load_error(source, f"cannot decode {scheme.describe()} linear {prefix!r}: {exc}") from exc


_CT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def _group_packed(stream: Iterator[tuple[str, torch.Tensor, str]],
                  scheme: QuantScheme) -> Iterator[tuple[str, Any, str]]:
    """compressed-tensors pack-quantized linears: `<prefix>.weight_packed`, `.weight_scale`,
    `.weight_shape`, `.weight_zero_point` (asymmetric), `.weight_g_idx` (actorder group) ->
    `<prefix>.weight`, scales in the checkpoint's own dtype (bf16 ones are not squeezed through
    fp16's range). A symmetric file's zero points (older writers kept them) must be zero."""
    needed = ["weight_packed", "weight_scale", "weight_shape"]
    if not scheme.sym:
        needed.append("weight_zero_point")
    if scheme.desc_act:
        needed.append("weight_g_idx")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    sources: dict[str, str] = {}
    for name, tensor, source in stream:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _CT_PARTS:
            yield name, tensor, source
            continue
        if leaf == "weight_zero_point" and scheme.sym:
            zero = (formats.unpack_rows(tensor.reshape(tensor.shape[0], -1), scheme.bits) - (1 << (scheme.bits - 1))
                    if tensor.dtype == torch.int32 else tensor)
            if torch.count_nonzero(zero):
                raise load_error(source, f"{name}: non-zero zero points in a checkpoint whose config says "
                                         f"symmetric")
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = tensor
        sources[prefix] = source
        if all(p in got for p in needed):
            t = pending.pop(prefix)
            try:
                weight = formats.from_compressed_tensors(
                    t["weight_packed"], t["weight_scale"], t["weight_shape"], t.get("weight_zero_point"),
                    t.get("weight_g_idx"), scheme.bits, scheme.group_size, t["weight_scale"].dtype)
            except (ValueError, RuntimeError) as exc:
                raise load_error(source, f"cannot decode compressed-tensors {scheme.describe()} linear "
                                         f"{prefix!r}: {exc}") from exc
            yield prefix + ".weight", weight, source
    for prefix, got in pending.items():
        missing = [p for p in needed if p not in got]
        raise load_error(sources[prefix], f"compressed-tensors linear {prefix!r} lacks {', '.join(missing)}")
