"""`Req`: one request's life inside the scheduler.

KV bookkeeping in a few numbers, with the invariant `cache_len <= kv_len <= len(fill_ids) + decode_ahead`:
  * `fill_ids` = prompt + generated tokens: what the KV cache must eventually hold;
  * `kv_len`: tokens whose KV slots are allocated and written (row `req_pool_idx` of
    ReqToTokenPool, positions `0..kv_len-1`);
  * `cache_len`: the first positions of the row whose slots belong to the prefix cache (locked
    through `cache_node` while the request runs); the request owns the slots after them;
  * the last generated token has no KV yet: it is the input of the next decode step.
A retracted request gives back its row and slots (`kv_len = 0`) and is prefilled again later over
`fill_ids`, so it resumes exactly where it stopped.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.managers.io_struct import LogprobEntry, TokenizedGenerateReqInput, TopLogprobList
from sglang.srt.mem_cache.radix_cache import CacheNamespace, TreeNode
from sglang.srt.model_executor.batch_builder import prompt_logprob_targets
from sglang.srt.sampling.sampling_params import SamplingParams


class Req:
    def __init__(self, msg: TokenizedGenerateReqInput, arrival: int) -> None:
        self.rid = msg.rid
        self.origin_input_ids: list[int] = list(msg.input_ids)
        self.sampling_params: SamplingParams = msg.sampling_params
        self.return_logprob = msg.return_logprob
        self.top_logprobs_num = msg.top_logprobs_num if msg.return_logprob else 0
        start = msg.logprob_start_len if msg.return_logprob else -1
        # Clamp into the prompt; -1 stays "no prompt logprobs".
        self.logprob_start_len = -1 if start < 0 else min(start, len(self.origin_input_ids))
        self.lora_id: Optional[str] = msg.lora_id
        # KV is reused only between requests of the same adapter and the same salt.
        self.namespace = CacheNamespace(msg.lora_id, msg.cache_salt)
        self.stream = msg.stream
        self.arrival = arrival  # FCFS order; also decides who is retracted first (the newest)

        self.output_ids: list[int] = []
        self.req_pool_idx: Optional[int] = None
        self.kv_len = 0
        # KV slots at the end of kv_len for a decode step launched ahead of the one whose token it
        # feeds (the overlap schedule, scheduler_overlap.py): 1 while such a step is in flight.
        self.decode_ahead = 0
        self.cache_len = 0
        self.cache_node: Optional[TreeNode] = None
        self.cached_tokens = 0  # prompt tokens reused from the cache at its first admission
        self.first_token_time: Optional[float] = None  # time.time() of its first output token
        self.extend_len = 0  # tokens of the pass being built (prefill chunk size)
        self.finished_reason: Optional[dict[str, Any]] = None
        self.lora_wait_turns = 0  # turns spent waiting because its adapter did not fit a batch
        # Its row in the penalties' token-count table, and how many output_ids that row holds
        # (sampling/token_counts.py); None while it has no row.
        self.counts_row: Optional[int] = None
        self.counts_synced = 0
        # Its logit_bias and min_new_tokens' held-back tokens as (token ids, values) on the device,
        # built at its first batch (managers/schedule_batch.py).
        self.logit_bias_tensors: Optional[tuple[Any, Any]] = None
        self.held_back_tensors: Optional[tuple[Any, Any]] = None
        # Constrained decoding: its grammar matcher (constrained/base.py GrammarMatcher), given when
        # its grammar is compiled and dropped when it ends (managers/scheduler_grammar.py).
        self.grammar: Optional[Any] = None

        # Logprobs: prompt ones are gathered across chunks and sent once complete.
        self.prompt_logprobs_done = self.logprob_start_len < 0
        self.input_token_logprobs: list[LogprobEntry] = []
        self.input_top_logprobs: list[Optional[TopLogprobList]] = []
        self.output_token_logprobs: list[LogprobEntry] = []
        self.output_top_logprobs: list[TopLogprobList] = []
        if self.logprob_start_len == 0:
            # The first prompt token has nothing before it.
            self.input_token_logprobs.append((None, self.origin_input_ids[0]))
            self.input_top_logprobs.append(None)

        # What has been sent to the tokenizer manager.
        self.sent_output_len = 0
        self.sent_output_logprob_len = 0
        self.sent_input_logprobs = False

    # ------------------------------------------------------------------ lengths
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to prefill before the request can decode."""
        return self.fill_len - self.kv_len

    @property
    def cacheable_len(self) -> int:
        """How much of `fill_ids` a cache hit may cover: never the last token (its logits give the
        next token) and, while prompt logprobs are wanted, not the position of the first of them
        (the logprob of prompt token t is read at position t - 1), so they come out the same with
        the cache on or off."""
        limit = self.fill_len - 1
        if not self.prompt_logprobs_done:
            limit = min(limit, max(self.logprob_start_len, 1) - 1)
        return max(limit, 0)

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids), 0)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    # ------------------------------------------------------------------ prompt logprob targets
    def prompt_logprob_targets(self, start: int, length: int) -> tuple[int, list[int]]:
        """ForwardBatch's prompt-logprob options for a prefill pass over fill positions
        [start, start + length): the first wanted position relative to the pass, and the prompt
        tokens that follow the wanted positions. Nothing once the prompt logprobs are complete
        (a retracted request prefilling again)."""
        if self.prompt_logprobs_done:
            return length, []
        # The logprob of prompt token p is read at position p - 1 (token 0 has none).
        return prompt_logprob_targets(self.origin_input_ids, start, length, max(self.logprob_start_len, 1) - 1)

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
                f"kv={self.kv_len}, cached={self.cache_len}, row={self.req_pool_idx})")
