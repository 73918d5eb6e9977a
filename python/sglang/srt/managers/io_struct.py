"""Messages between the main process (TokenizerManager) and the scheduler child process.

Every message is a plain dataclass pickled over a multiprocessing connection:

  main -> scheduler: TokenizedGenerateReqInput, AbortReq, LoadLoRAAdapterReq, UnloadLoRAAdapterReq,
                     GetServerInfoReq, FlushCacheReq, FaultInjectionReq (test hooks only), ShutdownReq
  scheduler -> main: BatchTokenIDOut (per turn, incremental), LoRAUpdateOutput, GetServerInfoOut,
                     FlushCacheOut, SchedulerReady (once, after start-up), SchedulerFailed (start-up error)

Requests are identified by `rid` (unique string). Adapter ids (`lora_id`) are unique per *load*, so
an adapter unloaded and loaded again under the same name never reuses stale pool contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sglang.srt.configs.lora_ref import LoRARef
from sglang.srt.sampling.sampling_params import SamplingParams

# (logprob, token_id); logprob is None for the first prompt token.
LogprobEntry = tuple[Optional[float], int]
# One top-k list: [(logprob, token_id), ...]
TopLogprobList = list[tuple[float, int]]


# ---------------------------------------------------------------------------- main -> scheduler
@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # validated and normalised by the tokenizer manager
    return_logprob: bool = False
    # Absolute prompt position of the first token whose logprob is returned; -1 = no prompt
    # logprobs. Position 0 has no logprob (nothing precedes it) and is reported as None.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    lora_id: Optional[str] = None  # resolved adapter id, None = base model
    stream: bool = False
    cache_salt: Optional[str] = None  # KV is shared only between requests with the same salt


@dataclass
class TokenizedBatchReqInput:
    """The requests of one call (a batch's prompts, `n` > 1 samples) in one message: the scheduler
    receives them at the same turn, so a batch's rows are scheduled together whatever the timing
    (sent one by one, a turn could start between them, and the batch's shape, with its rows' float
    sums, would depend on the timing)."""

    reqs: list[TokenizedGenerateReqInput]


@dataclass
class AbortReq:
    rid: str


@dataclass
class LoadLoRAAdapterReq:
    lora_ref: LoRARef


@dataclass
class UnloadLoRAAdapterReq:
    lora_ref: LoRARef


@dataclass
class GetServerInfoReq:
    pass


@dataclass
class FlushCacheReq:
    """Empty the prefix cache; refused while any request runs or waits."""


@dataclass
class FaultInjectionReq:
    """Test-only (--enable-test-hooks): make the next forward containing `rid_substring` raise
    ("forward"; "decode": a decode step of such a request once it has `after_tokens` output
    tokens; "hang": the forward never returns). The tokenizer manager keeps "tokenize" / "detokenize" faults to itself. `tp_rank`:
    only that tensor-parallel rank fails (None: every rank)."""

    rid_substring: str
    where: str = "forward"
    after_tokens: int = 0
    tp_rank: Optional[int] = None


@dataclass
class ShutdownReq:
    pass


# ---------------------------------------------------------------------------- scheduler -> main
@dataclass
class BatchTokenIDOut:
    """One scheduler turn's news for a set of requests; every list is aligned with `rids`."""

    rids: list[str]
    # None while running; else {"type": "stop"|"length"|"abort", "matched": int|str|None,
    # "message": str (abort only), "status_code": int (abort only)}.
    finished_reasons: list[Optional[dict[str, Any]]]
    output_ids: list[list[int]]  # tokens generated since the previous message for this rid
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # time.time() when the scheduler produced each request's first output token (None before):
    # non-streaming requests report only when they finish, so the TTFT metric needs it.
    first_token_times: list[Optional[float]] = field(default_factory=list)
    # Sent once, in the message that carries the first output token (None otherwise / not asked).
    input_token_logprobs: list[Optional[list[LogprobEntry]]] = field(default_factory=list)
    input_top_logprobs: list[Optional[list[Optional[TopLogprobList]]]] = field(default_factory=list)
    # Incremental, aligned with output_ids (None when not asked).
    output_token_logprobs: list[Optional[list[LogprobEntry]]] = field(default_factory=list)
    output_top_logprobs: list[Optional[list[TopLogprobList]]] = field(default_factory=list)


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class GetServerInfoOut:
    info: dict[str, Any]


@dataclass
class SchedulerReady:
    info: dict[str, Any]  # max_total_num_tokens, context_len, vocab_size, eos ids, ...


@dataclass
class SchedulerFailed:
    error: str
    # True for a configuration error the user can fix (the message says how); False for a crash.
    user_error: bool = False
    # time.time() of the failure: when several ranks fail, the first is the cause.
    failed_at: float = 0.0
