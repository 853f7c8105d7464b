"""Command-line flags for the engine and for sampling, shared by every command that runs one.

The engine flags are generated from the config dataclasses (rooflm/config.py): a new field
is a new flag. Its help text and, where the field takes a closed set of values, its choices
come from HELP and CHOICES below; tests/unit/test_engine_args.py fails on a field without
help, and on choices that the config's own validation does not accept exactly.

A bottom-layer module: it imports config, sampling_params and errors only, so a tool
(server, bench, sim, eval, perf) takes its flags from here, not from the `rooflm` entry point.
"""

from __future__ import annotations

import argparse
import dataclasses

from rooflm import config as cfg
from rooflm.sampling_params import SamplingParams

# One line per engine field: what it sets, in the words of the docs.
HELP: dict[str, str] = {
    # load
    "model": "an HF directory, a .gguf file, a Hugging Face Hub repo id (owner/name, or "
             "owner/name:file.gguf; downloaded once into the Hub cache), or a preset name (with "
             "--load-format dummy); unset: the embedded SmolLM2-135M-Instruct",
    "load_format": "where the weights come from; dummy: random weights of the model's shape",
    "tokenizer": "an HF tokenizer directory, a .gguf file or a Hub repo id (unset: the "
                 "model's own)",
    "revision": "a Hub model's branch, tag or commit (unset: main)",
    "download_dir": "the Hub cache Hub models are downloaded into (unset: HF_HUB_CACHE, or "
                    "HF_HOME/hub, default ~/.cache/huggingface/hub)",
    "seed": "the seed of --load-format dummy's random weights",
    "quantization": "auto: quantized checkpoints stay quantized where a kernel takes them; none: "
                    "dequantize every weight; gguf: GGUF blocks also on CUDA; int8 / int4-g*: "
                    "round-to-nearest weight-only at load; fp8: FP8 W8A8 at load",
    # device
    "device": "auto (CUDA when present, else the CPU), cpu, cuda or cuda:N",
    "dtype": "weights' and activations' dtype; auto: bfloat16 on CUDA, float32 on the CPU",
    # cache
    "block_size": "KV block size in tokens, a power of two; unset: 64 on CUDA (128 with FA4 "
                  "prefill), 16 on the CPU",
    "num_blocks": "KV blocks in the pool; unset: sized from free memory (CUDA) or --cpu-kv-cache-gb",
    "gpu_memory_utilization": "fraction of the GPU's memory the engine may use (weights, "
                              "activations, KV pool)",
    "cpu_kv_cache_gb": "the CPU KV pool's size in GB",
    "swap_space_gb": "host memory in GB for --preemption-mode swap",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes already computed",
    "kv_offload_gb": "host memory in GiB for the prefix cache's host tier: cached blocks evicted "
                     "from the GPU are copied there and copied back on a hit (unset: 0 on the "
                     "CPU; on CUDA a tenth of the available host memory, at most 16 GiB per GPU)",
    "kv_cache_dtype": "auto: K/V in the model's dtype; fp8 (fp8_e4m3): E4M3 codes with fp32 "
                      "scales, half the bytes",
    "kv_cache_scales": "FP8 caches' scales. auto: the checkpoint's static scales where it has "
                       "them, else per token; per-token: always per token; static: the "
                       "checkpoint's, else 1.0",
    "disable_hybrid_kv_cache_manager": "sliding-window layers keep their whole history in the "
                                       "block table all layers share, rather than only their window",
    # scheduler
    "max_num_seqs": "most sequences in a step; unset: 1024 on CUDA GPUs of 70 GB or more, 512 on "
                    "smaller ones, 256 on the CPU",
    "max_num_batched_tokens": "most tokens (prefill and decode) in a step",
    "max_model_len": "longest sequence, prompt and output (unset: the model's "
                     "max_position_embeddings)",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "preemption_mode": "what happens to a sequence evicted when the KV pool runs out: "
                       "recompute its KV later, or swap it to host memory",
    "reserve_new_tokens": "admission keeps KV room for the running requests' expected growth",
    "scheduling_policy": "fcfs: first come, first served; priority: by each request's priority "
                         "(lower value first, ties by arrival), and a waiting request may preempt "
                         "running ones of lower priority when the KV pool is full",
    # runtime
    "enforce_eager": "no CUDA graphs: every step launches its kernels one by one",
    "async_scheduling": "schedule step t+1 before step t's tokens are read back (unset: on with "
                        "CUDA, off on the CPU)",
    "cuda_graph_max_batch": "largest decode batch captured in a CUDA graph (unset: --max-num-seqs)",
    "piecewise_cuda_graphs": "steps with prefill chunks replay one CUDA graph per layer, "
                             "attention eager between them",
    "decode_gemv": "one-token steps run each layer as fused Triton GEMVs; off: cuBLAS and "
                   "separate kernels",
    "attention_backend": "auto: triton on CUDA, the torch reference on the CPU",
    "prefill_attention": "prefill kernel under the triton backend; auto: FlashAttention-4 on "
                         "compute capability 9.x when flash-attn-4 is installed, else triton",
    "tune_gc": "freeze the start-up heap and collect young objects less often (process-wide)",
    "deterministic": "batch-invariant kernels: a request's tokens do not depend on the rest of "
                     "the batch (slower; turns --decode-gemv off)",
    "count_expert_load": "count the tokens routed to each expert per MoE layer and step (on the "
                         "device, no host sync in the step); rooflm profile turns it on and "
                         "prints the load imbalance",
    "enable_sleep_mode": "the engine may sleep: free its KV pool and move its weights to host "
                         "memory (level 1) or drop them (level 2) until woken (the server's "
                         "POST /sleep, /wake_up)",
    # speculative
    "speculative_method": "speculative decoding's proposer (unset: off)",
    "num_speculative_tokens": "draft tokens per sequence and step, at most",
    "draft_model": "--speculative-method draft: the draft model, a path, .gguf, Hub repo id or "
                   "preset name (unset: none)",
    "draft_load_format": "where the draft model's weights come from",
    "ngram_prompt_lookup_max": "ngram: longest suffix of the sequence looked up earlier in it",
    "ngram_prompt_lookup_min": "ngram: shortest suffix looked up",
    "speculative_max_batch_tokens": "speculate only while decode rows x (1 + k) stay within this "
                                    "many tokens (unset: 256 on CUDA, 8 on the CPU)",
    "speculative_policy": "adaptive: speculate at a batch size only while it has measured faster "
                          "than plain steps there; budget: always within the token budget",
    "speculative_device_loop": "verify greedy sequences in a loop kept on the device (unset: where "
                               "CUDA graphs run it)",
    # parallel
    "tensor_parallel_size": "GPUs one model is split over (one worker process per rank)",
    "enable_expert_parallel": "MoE layers split whole experts across the tensor-parallel ranks "
                              "instead of sharding each expert (attention stays tensor-parallel)",
    "pipeline_parallel_size": "pipeline stages the layers are split over (each a TP group of "
                              "tensor_parallel_size worker processes; docs/parallelism.md)",
    "pipeline_micro_batches": "batches in flight through the pipeline at once, each of other requests "
                              "(unset: --pipeline-parallel-size; 1: one step at a time through the stages)",
    "distributed_executor_backend": "where the tensor/pipeline-parallel workers run: mp, processes "
                                    "of this host; ray, actors in a placement group of a Ray cluster "
                                    "(pip install 'rooflm[ray]'; docs/parallelism.md)",
    "tp_allreduce": "the row-parallel all-reduce on CUDA. symm: a one-shot kernel over symmetric "
                    "memory up to 4 MiB, NCCL above; nccl: always NCCL; auto: symm where every "
                    "GPU pair has peer access",
    # lora
    "enable_lora": "serve LoRA adapters beside the base model (docs/lora.md)",
    "max_loras": "LoRA adapters resident on the device at once: the most distinct adapters one step uses",
    "max_lora_rank": "the largest LoRA rank served (lower ranks are zero-padded to it)",
    "max_cpu_loras": "LoRA adapters kept in host memory (LRU); unset: --max-loras",
}

_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# Fields that take a closed set of values: the same sets the configs' __post_init__ accept.
CHOICES: dict[str, tuple[str, ...]] = {
    "load_format": _LOAD_FORMATS,
    "quantization": ("auto", "none", "gguf", "int8", "int4-g32", "int4-g64", "int4-g128", "fp8"),
    "dtype": ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
    "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3"),
    "kv_cache_scales": ("auto", "per-token", "static"),
    "preemption_mode": ("recompute", "swap"),
    "scheduling_policy": cfg.SCHEDULING_POLICIES,
    "attention_backend": ("auto", "triton", "reference"),
    "prefill_attention": cfg.PREFILL_ATTENTION_CHOICES,
    "speculative_method": ("ngram", "draft"),
    "draft_load_format": _LOAD_FORMATS,
    "speculative_policy": ("adaptive", "budget"),
    "tp_allreduce": ("auto", "nccl", "symm"),
    "distributed_executor_backend": cfg.PLACEMENT_BACKENDS,
}

# Short forms vLLM's flags have too.
_ALIASES = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",)}


def engine_fields() -> list[dataclasses.Field]:
    return [f for cls in cfg._SECTIONS.values() for f in dataclasses.fields(cls)]


def flag_of(field: dataclasses.Field) -> str:
    # LoadConfig.seed (dummy weights) would clash with the sampling --seed.
    return "--weights-seed" if field.name == "seed" else "--" + field.name.replace("_", "-")


def _flag_type(field: dataclasses.Field):
    hint = str(field.type)
    if "bool" in hint:
        return None
    if "int" in hint:
        return int
    if "float" in hint:
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for section, cls in cfg._SECTIONS.items():
        group = parser.add_argument_group(f"{section} options")
        for field in dataclasses.fields(cls):
            names = (flag_of(field), *_ALIASES.get(field.name, ()))
            # A field without a default says in its text what "unset" means.
            text = HELP[field.name] if field.default is None else f"{HELP[field.name]} (default: {field.default})"
            if _flag_type(field) is None:
                group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction,
                                   default=field.default, help=text)
            else:
                group.add_argument(*names, dest=field.name, type=_flag_type(field), default=field.default,
                                   choices=CHOICES.get(field.name), help=text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for f in engine_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens generated per output")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="the sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--n", type=int, default=1, help="outputs per prompt")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens past end-of-sequence")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)
