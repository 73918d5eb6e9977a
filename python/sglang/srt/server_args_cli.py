"""launch_server's command line: the flags of every ServerArgs field, grouped as SGLang groups them
(model, memory and scheduling, tensor parallelism, LoRA, CUDA graphs, HTTP server)."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from sglang.srt.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from sglang.srt.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from sglang.srt.configs.cuda_graph_config import DECODE_BACKENDS, PREFILL_BACKENDS
from sglang.srt.constrained.base import GRAMMAR_BACKENDS

# The choices each flag offers; ServerArgs validates against the same tuples.
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("triton", "torch_native")
LORA_BACKENDS = ("csgmv", "triton", "torch_native")
LORA_EVICTION_POLICIES = ("lru", "fifo")
LORA_CHUNK_SIZES = (16, 32, 64, 128)
LORA_FOLD_MODES = ("auto", "on", "off")
# auto and on: the norms before every LoRA qkv_proj / gate_up_proj, folded or not (on warns when none can).
LORA_FUSE_NORM_MODES = ("auto", "on", "off")
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "all",
)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SCHEDULE_POLICIES = ("fcfs", "lpm")
LOG_REQUESTS_LEVELS = (0, 1, 2)


# Flags of `vllm serve` that users bring along, and what to do here instead. An unknown flag is
# refused either way; for these the refusal says what to use. They are not
# accepted as aliases: the meanings differ in details (e.g. --gpu-memory-utilization counts all of
# the GPU's memory, --mem-fraction-static what is left after other processes), and a silently
# reinterpreted flag is worse than a clear error. (vLLM flags that are a prefix of one of ours, such
# as --max-loras or --tokenizer, are taken by argparse as that flag.)
VLLM_FLAGS = {
    "--lora-modules": "use --lora-paths NAME=PATH ...",
    "--max-cpu-loras": "use --max-loaded-loras",
    "--max-model-len": "use --context-length",
    "--hf-overrides": "use --json-model-override-args '{...}'",
    "--gpu-memory-utilization": "use --mem-fraction-static",
    "--max-num-seqs": "use --max-running-requests",
    "--max-num-batched-tokens": "use --chunked-prefill-size (and --max-prefill-tokens)",
    "--enforce-eager": "use --disable-cuda-graph",
    "--seed": "use --random-seed",
    "--enable-prefix-caching": "leave it out: the prefix cache is on by default",
    "--no-enable-prefix-caching": "use --disable-radix-cache",
}


class ServerArgumentParser(argparse.ArgumentParser):
    """argparse, with the flag to use named where an unknown flag is one of vLLM's."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            given = {word.split("=", 1)[0] for word in message.split(":", 1)[1].split()}
            hints = [f"{flag} is vLLM's flag: here, {advice}" for flag, advice in VLLM_FLAGS.items() if flag in given]
            if hints:
                message = f"{message} ({'; '.join(hints)})"
        super().error(message)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows each flag's default where it has a value to show (not for unset flags,
    switches that are off, or a help text that already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.help is argparse.SUPPRESS or default in (None, False, argparse.SUPPRESS)
                or "default" in text.lower() or not action.option_strings):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})"


def add_cli_args(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """Every flag, grouped; `defaults`: ServerArgs' field defaults (server_args.field_defaults)."""

    def default(name: str) -> Any:
        return defaults[name]

    g = parser.add_argument_group("model")
    g.add_argument("--model-path", "--model", default=default("model_path"),
                   help="HF checkpoint folder; 'demo' (the default) serves a tiny built-in demo model.")
    g.add_argument("--tokenizer-path", default=None, help="Defaults to --model-path.")
    g.add_argument("--load-format", default=default("load_format"), choices=LOAD_FORMATS,
                   help="'dummy' builds random weights from config.json alone.")
    g.add_argument("--dtype", default=default("dtype"), choices=DTYPES,
                   help="Weight and activation dtype; auto: the checkpoint's (float32 on a CPU for float16).")
    g.add_argument("--context-length", type=int, default=None,
                   help="Longest prompt + output in tokens. Default: the model's max_position_embeddings; "
                        "more needs SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1. With YaRN RoPE scaling: "
                        "original_max_position_embeddings x factor.")
    g.add_argument("--json-model-override-args", default=default("json_model_override_args"),
                   help="A JSON object whose keys replace those of the checkpoint's config.json, e.g. "
                        "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}}' to turn on YaRN.")
    g.add_argument("--device", default=default("device"), choices=DEVICES,
                   help="auto: cuda when a CUDA device is available, else cpu.")
    g.add_argument("--random-seed", type=int, default=default("random_seed"),
                   help="Seed of the sampling of requests that give none (and of dummy weights).")
    g.add_argument("--served-model-name", default=None,
                   help="The model name the OpenAI API reports and accepts (no ':'). Default: --model-path.")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="Accept and return token ids only.")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Let the tokenizer run code shipped with the checkpoint.")
    g.add_argument("--chat-template", default=None,
                   help="Chat template for /v1/chat/completions: a Jinja file, or a built-in name "
                        "(chatml, llama-3-instruct, mistral). Default: the tokenizer's own.")
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="Read tool calls out of /v1/chat/completions replies in this model family's format "
                        "(qwen25/qwen/hermes: <tool_call> JSON, Qwen2.5 and Qwen3; qwen3_coder: <tool_call> "
                        "<function=...> XML, Qwen3-Coder; llama3/llama3_json: Llama 3.1/3.2 JSON; mistral: "
                        "[TOOL_CALLS] [...] or [TOOL_CALLS]name[ARGS]{...}). Without it, requests with tools "
                        "are refused.")
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="Return a reply's <think>...</think> block as message.reasoning_content (qwen3: when "
                        "the reply opens one; deepseek-r1, qwen3-thinking: the prompt opened it).")

    g = parser.add_argument_group("memory and scheduling")
    g.add_argument("--mem-fraction-static", type=float, default=default("mem_fraction_static"),
                   help="Fraction of GPU memory for weights + KV cache.")
    g.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens.")
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="Most requests decoding at once. Default: from the KV cache size.")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="Most requests waiting to run; one more gets a 503 at once, so that a load "
                        "balancer can send it elsewhere. Default: no limit.")
    g.add_argument("--max-prefill-tokens", type=int, default=default("max_prefill_tokens"),
                   help="Most new prompt tokens one prefill batch takes.")
    g.add_argument("--chunked-prefill-size", type=int, default=default("chunked_prefill_size"),
                   help="Split prompts longer than this into chunks; -1 turns chunking off.")
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="Turn the prefix cache off: every prompt is computed in full and no KV "
                        "is kept after a request ends.")
    g.add_argument("--schedule-policy", default=default("schedule_policy"), choices=SCHEDULE_POLICIES,
                   help="fcfs: arrival order; lpm: the longest cached prefix first (prefix-cache aware; "
                        "fcfs when the queue is long or the cache is off).")
    g.add_argument("--page-size", type=int, default=default("page_size"),
                   help="KV cache tokens per page; only 1 is supported (the pool allocates per token).")
    g.add_argument("--decode-log-interval", type=int, default=default("decode_log_interval"),
                   help="Log a decode batch line every this many decode steps.")
    g.add_argument("--enable-overlap-schedule", action="store_true", default=None,
                   help="Launch each decode step before the previous step's tokens reach the host, so the "
                        "scheduler's work between steps overlaps the GPU (one token of wasted work per "
                        "request that stops on EOS or a stop string). Single GPU. Default: on for a "
                        "single-GPU CUDA server, off on the CPU.")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="Decode step by step (SGLang's flag; wins over --enable-overlap-schedule).")
    g.add_argument("--enable-deterministic-inference", action="store_true",
                   help="Prefer reproducible numerics over speed (no reduced-precision "
                        "reductions in cuBLAS GEMMs, so results depend less on batch shape).")
    g.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                   help="Default: triton on CUDA, torch_native on CPU.")
    g.add_argument("--grammar-backend", default=None, choices=GRAMMAR_BACKENDS,
                   help="Constrained decoding (structured outputs: regex / json_schema / ebnf, OpenAI's "
                        "response_format, vLLM's guided_* and structured_outputs): xgrammar, or none to "
                        "refuse such requests with a 400. Default: xgrammar when it is installed, else none.")

    g = parser.add_argument_group("tensor parallelism")
    g.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=default("tp_size"),
                   help="Ranks (GPUs) the model is split over; NCCL on CUDA, gloo on CPU.")
    g.add_argument("--nnodes", type=int, default=default("nnodes"), help="Nodes the ranks span.")
    g.add_argument("--node-rank", type=int, default=default("node_rank"),
                   help="This node's index (node 0 serves HTTP; the others run their ranks only).")
    g.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT where the ranks meet (node 0's address); default: a free "
                        "local port. Required with --nnodes > 1.")
    g.add_argument("--dist-timeout", type=int, default=None,
                   help="Seconds a collective may wait before it fails (default: torch's).")
    g.add_argument("--watchdog-timeout", type=float, default=default("watchdog_timeout"),
                   help="Seconds one scheduler turn (a forward, a collective, an adapter load) may take "
                        "before its rank is declared hung: the rank exits with the stack it was stuck "
                        "in and the server stops (a supervisor restarts it). 0: never.")

    g = parser.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="Serve LoRA adapters (implied by --lora-paths).")
    g.add_argument("--lora-paths", nargs="*", default=None,
                   help="Adapters to load at start: PATH, NAME=PATH, or JSON "
                        '{"lora_name": ..., "lora_path": ..., "pinned": bool}.')
    g.add_argument("--max-loras-per-batch", type=int, default=default("max_loras_per_batch"),
                   help="GPU adapter slots: adapters one batch may use (the base model needs no slot). "
                        "Default: one per startup adapter, at least 8, within 5%% of the GPU memory.")
    g.add_argument("--max-lora-rank", type=int, default=None,
                   help="Pool rank; defaults to the largest rank of --lora-paths.")
    g.add_argument("--lora-target-modules", nargs="*", default=None, choices=LORA_TARGET_MODULES,
                   help="Modules the pool covers; defaults to the union of --lora-paths.")
    g.add_argument("--max-loaded-loras", type=int, default=None,
                   help="Adapters kept in host memory (default unlimited).")
    g.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                   help="Load adapters on first use: a request for adapter N that is not loaded loads "
                        "DIR/N (as vLLM's filesystem resolver); at --max-loaded-loras the least recently "
                        "used idle adapter loaded this way is unloaded first. Implies --enable-lora.")
    g.add_argument("--lora-eviction-policy", default=default("lora_eviction_policy"),
                   choices=LORA_EVICTION_POLICIES,
                   help="Which resident adapter leaves a GPU slot first when a new one needs it.")
    g.add_argument("--lora-backend", default=default("lora_backend"), choices=LORA_BACKENDS,
                   help="The LoRA kernels; csgmv and triton need a GPU (or TRITON_INTERPRET=1), else torch_native.")
    g.add_argument("--max-lora-chunk-size", type=int, default=default("max_lora_chunk_size"),
                   choices=LORA_CHUNK_SIZES, help="csgmv only.")
    g.add_argument("--lora-fold", default=default("lora_fold"), choices=LORA_FOLD_MODES,
                   help="triton/csgmv: fold each module's adapters into its base GEMM (one GEMM over "
                        "[x | shrink] and [W | B]); auto folds where the extra weight bytes are small.")
    g.add_argument("--lora-fuse-norm", nargs="?", const="on", default=default("lora_fuse_norm"),
                   choices=LORA_FUSE_NORM_MODES,
                   help="triton/csgmv, decode: the RMSNorm before qkv_proj / gate_up_proj also computes "
                        "their LoRA shrink, one kernel fewer per module. auto (default) and on (or the "
                        "bare flag): before folded and unfolded modules alike (on warns where nothing "
                        "can fuse); off: never.")
    g.add_argument("--lora-max-wait-turns", type=int, default=default("lora_max_wait_turns"),
                   help="Scheduler turns a request may wait for an adapter slot before requests "
                        "for other adapters are held back until it fits.")

    g = parser.add_argument_group("CUDA graphs")
    g.add_argument("--cuda-graph-config", default=None,
                   help='JSON, e.g. {"prefill": {"backend": "breakable", "max_bs": 1024}}.')
    g.add_argument("--cuda-graph-backend-prefill", default=None,
                   choices=[b.value for b in PREFILL_BACKENDS],
                   help="How prefills are captured: breakable (attention eager between segments), full, "
                        "tc_piecewise (base models), disabled.")
    g.add_argument("--cuda-graph-backend-decode", default=None,
                   choices=[b.value for b in DECODE_BACKENDS],
                   help="How decode steps are captured: full, breakable, disabled.")
    g.add_argument("--cuda-graph-max-bs-prefill", type=int, default=None,
                   help="Largest prefill capture bucket, in tokens.")
    g.add_argument("--cuda-graph-max-bs-decode", type=int, default=None,
                   help="Largest decode capture batch size.")
    g.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", default=None,
                   help="Explicit prefill buckets (tokens).")
    g.add_argument("--cuda-graph-bs-decode", type=int, nargs="+", default=None,
                   help="Explicit decode buckets (batch sizes).")
    g.add_argument("--disable-prefill-cuda-graph", action="store_true", help="Prefills run eagerly.")
    g.add_argument("--disable-decode-cuda-graph", action="store_true", help="Decode steps run eagerly.")
    g.add_argument("--disable-cuda-graph", action="store_true", help="Both phases.")

    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default=default("host"), help="Address the HTTP server listens on.")
    g.add_argument("--port", type=int, default=default("port"), help="Port the HTTP server listens on.")
    g.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer <key>'.")
    g.add_argument("--shutdown-timeout", type=float, default=default("shutdown_timeout"),
                   help="On SIGINT/SIGTERM, seconds the requests in flight get to finish (new ones get a "
                        "503 at once); those still running then end with a 503. The server exits as soon "
                        "as they are all done.")
    g.add_argument("--log-level", default=default("log_level"), choices=LOG_LEVELS, help="Logging level.")
    g.add_argument("--log-requests", action="store_true",
                   help="Log one line per finished request: id, adapter, token counts, finish reason, latency.")
    g.add_argument("--log-requests-level", type=int, default=default("log_requests_level"),
                   choices=LOG_REQUESTS_LEVELS,
                   help="With --log-requests: 0 metadata and counts, 1 also sampling parameters, 2 also "
                        "the first and last 64 characters of the prompt and output.")
    g.add_argument("--enable-metrics", action="store_true",
                   help="Serve Prometheus metrics at /metrics (SGLang's sglang: names; open without --api-key, as upstream).")
    g.add_argument("--enable-cache-report", action="store_true",
                   help="Report usage.prompt_tokens_details.cached_tokens on the OpenAI routes "
                        "(/generate always reports meta_info.cached_tokens).")
    g.add_argument("--max-top-logprobs", type=int, default=default("max_top_logprobs"),
                   help="Largest logprobs / top_logprobs / top_logprobs_num a request may ask for.")
    g.add_argument("--enable-test-hooks", action="store_true", help=argparse.SUPPRESS)
