"""Shared test helpers: tiny checkpoints, a CPU ModelRunner, and a small driver that runs
prefill/decode passes for fixed requests (allocation, batch building, token bookkeeping).

Generic on purpose: other suites (LoRA, CUDA graphs, scheduler) may import it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from sglang.srt.model_executor.batch_builder import (
    DecodeRequest,
    ExtendRequest,
    build_decode_batch,
    build_extend_batch,
    prompt_logprob_targets,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.configs.runner_output import ModelRunnerOutput
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_configs import build_run_configs
from server_helpers import tiny_checkpoint  # one disk-cached implementation for every suite

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def make_runner(model_path: str, wait_for: Optional[Future] = None, **overrides: Any) -> ModelRunner:
    """A ModelRunner on the CPU in float32 with small pools (override any ServerArgs field);
    `wait_for`: ModelRunner's (work it waits for after the weights)."""
    args = dict(
        model_path=model_path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=2048,
        max_running_requests=16,
        disable_cuda_graph=True,
        random_seed=0,
    )
    args.update(overrides)
    return ModelRunner(build_run_configs(ServerArgs(**args)).scheduler.runner, wait_for=wait_for)


def hf_model(model_path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """logprob of prompt token t given tokens < t, for t = 1..len-1 (float32, [len-1])."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


@torch.no_grad()
def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy decode with its KV cache, without stopping at EOS (the engine driver never
    stops). A loop over the model's forward, not `generate`: transformers 5 fills an
    `eos_token_id=None` back in from the checkpoint's generation config and stops there."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


@dataclass
class Seq:
    """One request's state in the driver: its tokens and how many have KV in the cache."""

    row: int
    tokens: list[int]
    kv_len: int = 0
    slots: list[torch.Tensor] = field(default_factory=list)
    lora_id: Optional[str] = None


class EngineDriver:
    """Runs EXTEND/DECODE passes of fixed requests through a ModelRunner (a tiny scheduler)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def add(self, prompt: list[int], lora_id: Optional[str] = None) -> Seq:
        rows = self.runner.req_to_token_pool.alloc(1)
        assert rows is not None, "out of request rows"
        return Seq(row=rows[0], tokens=list(prompt), lora_id=lora_id)

    def release(self, seq: Seq) -> None:
        for s in seq.slots:
            self.runner.token_to_kv_pool_allocator.free(s)
        seq.slots.clear()
        self.runner.req_to_token_pool.free(seq.row)

    def _alloc(self, seq: Seq, n: int) -> torch.Tensor:
        slots = self.runner.token_to_kv_pool_allocator.alloc(n)
        assert slots is not None, "out of KV slots"
        seq.slots.append(slots)
        return slots

    def extend(
        self,
        seqs: list[Seq],
        num_tokens: Optional[list[int]] = None,
        logprob_start: Optional[int] = None,
        top_logprobs_num: int = 0,
        sampling_info: Optional[SamplingBatchInfo] = None,
    ) -> ModelRunnerOutput:
        """Feed each seq's next `num_tokens[i]` uncached tokens (default: all of them).

        With `logprob_start` (absolute prompt position), prompt logprobs from that position on
        are requested; each seq's tokens are its prompt here.
        """
        reqs = []
        for i, seq in enumerate(seqs):
            n = (num_tokens[i] if num_tokens else len(seq.tokens) - seq.kv_len)
            ids = seq.tokens[seq.kv_len : seq.kv_len + n]
            req = ExtendRequest(seq.row, ids, seq.kv_len, self._alloc(seq, n), lora_id=seq.lora_id)
            if logprob_start is not None:
                req.return_logprob = True
                req.top_logprobs_num = top_logprobs_num
                req.logprob_start_len, req.logprob_target_ids = prompt_logprob_targets(
                    seq.tokens, seq.kv_len, n, logprob_start
                )
            reqs.append(req)
        fb = build_extend_batch(
            reqs, self.runner.req_to_token_pool, self.runner.device, sampling_info,
            enable_lora=self.runner.lora_manager is not None,
        )
        out = self.runner.forward(fb)
        for seq, req in zip(seqs, reqs):
            seq.kv_len += len(req.input_ids)
        return out

    def decode(
        self,
        seqs: list[Seq],
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        sampling_info: Optional[SamplingBatchInfo] = None,
    ) -> ModelRunnerOutput:
        """Feed each seq's last token (which must be its only uncached one)."""
        reqs = []
        for seq in seqs:
            assert seq.kv_len == len(seq.tokens) - 1, "decode feeds exactly one new token"
            slot = int(self._alloc(seq, 1)[0])
            reqs.append(
                DecodeRequest(seq.row, seq.tokens[-1], len(seq.tokens), slot, return_logprob,
                              top_logprobs_num, seq.lora_id)
            )
        fb = build_decode_batch(
            reqs, self.runner.req_to_token_pool, self.runner.device, sampling_info,
            enable_lora=self.runner.lora_manager is not None,
        )
        out = self.runner.forward(fb)
        for seq in seqs:
            seq.kv_len += 1
        return out

    def continue_greedy(self, seqs: list[Seq], out: ModelRunnerOutput, steps: int,
                        after_step: Optional[Callable[[], None]] = None) -> list[list[int]]:
        """`steps` decode passes of `seqs` after `out` (their extend or last decode), each feeding the
        greedy token before it; `after_step` runs after each pass. Each seq's greedy tokens, `out`'s
        first."""
        tokens = [[t] for t in out.next_token_ids.tolist()]
        for _ in range(steps):
            for seq, t in zip(seqs, tokens):
                seq.tokens.append(t[-1])
            step = self.decode(seqs)
            if after_step is not None:
                after_step()
            for t, n in zip(tokens, step.next_token_ids.tolist()):
                t.append(n)
        return tokens

    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one batch, then decode them together; returns new tokens."""
        return self.greedy(prompts, max_new_tokens)[0]

    def greedy(
        self, prompts: list[list[int]], steps: int, lora_ids: Optional[list[Optional[str]]] = None
    ) -> tuple[list[list[int]], list[bool]]:
        """One prefill of all prompts, then `steps` decode passes of them together: the `steps`
        greedy tokens of each prompt, and per decode pass whether it replayed a CUDA graph."""
        seqs = [self.add(p, lid) for p, lid in zip(prompts, lora_ids or [None] * len(prompts))]
        used = []
        try:
            out = self.extend(seqs)
            for _ in range(steps):
                for seq, t in zip(seqs, out.next_token_ids.tolist()):
                    seq.tokens.append(t)
                out = self.decode(seqs)
                used.append(out.used_cuda_graph)
            return [seq.tokens[len(p):] for seq, p in zip(seqs, prompts)], used
        finally:
            for seq in seqs:
                self.release(seq)


def greedy_decode_one(driver: EngineDriver, seq: Seq, out, steps: int,
                      calls: Optional[list[int]] = None) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy decode steps of one sequence after the forward whose output is `out` (its
    prefill): the tokens and their logprobs (float64). `calls`, when given, gets a new counter (0)
    before each step, for a wrapped kernel to count into."""
    tokens, logprobs = [], []
    for _ in range(steps):
        seq.tokens.append(out.next_token_ids.tolist()[0])
        if calls is not None:
            calls.append(0)
        out = driver.decode([seq], return_logprob=True)
        tokens.append(out.next_token_ids.tolist()[0])
        logprobs.append(out.next_token_logprobs[0])
    return tokens, torch.tensor(logprobs, dtype=torch.float64)


def count_calls(monkeypatch, module: Any, name: str) -> list[int]:
    """Wrap `module.name` (through monkeypatch, undone at the test's end) so that every call adds 1
    to the last entry of the returned list, which starts as [0]: append a 0 to count a new phase."""
    calls = [0]
    real = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[-1] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls
