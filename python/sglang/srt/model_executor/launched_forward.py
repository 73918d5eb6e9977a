"""A forward whose kernels are queued and whose results are on their way to the host.

`ModelRunner.launch_forward` queues a whole decode step (body, logits, sampling) and the
non-blocking device->host copies of what the scheduler reads (the sampled tokens, their logprobs),
then returns at once; `ModelRunner.finish_forward` waits for those copies only. Between the two
the host is free: the overlap schedule (managers/scheduler_overlap.py) builds and launches the next
step there, feeding it `sample.next_token_ids`, still on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.configs.forward_batch_info import ForwardBatch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import SamplerOutput


def _copy_to_host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # A CUDA -> CPU copy with non_blocking lands in pinned memory and does not wait for the GPU.
    return None if t is None else t.to("cpu", non_blocking=True)


@dataclass
class LaunchedForward:
    fb: ForwardBatch
    logits_out: LogitsProcessorOutput
    sample: SamplerOutput  # on the device: the next step's input tokens come from here
    used_cuda_graph: bool
    host_sample: SamplerOutput  # the same tensors, being copied to the host
    copied: Optional[torch.cuda.Event]  # recorded after the copies (None on a CPU device)
    timed: tuple = (None, None)  # the forward clock's marks at its launch and after its copies

    @classmethod
    def start(cls, fb: ForwardBatch, logits_out: LogitsProcessorOutput, sample: SamplerOutput,
              used_cuda_graph: bool) -> "LaunchedForward":
        if not sample.next_token_ids.is_cuda:  # a CPU device: the sample is on the host already
            return cls(fb, logits_out, sample, used_cuda_graph, sample, None)
        host = dataclasses.replace(
            sample, next_token_ids=_copy_to_host(sample.next_token_ids), logprobs=_copy_to_host(sample.logprobs),
            top_logprobs_val=_copy_to_host(sample.top_logprobs_val),
            top_logprobs_idx=_copy_to_host(sample.top_logprobs_idx),
        )
        copied = torch.cuda.Event()
        copied.record()
        return cls(fb, logits_out, sample, used_cuda_graph, host, copied)

    def wait(self) -> SamplerOutput:
        """The host copies of the sample, once they have landed (the GPU may run later work)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_sample
