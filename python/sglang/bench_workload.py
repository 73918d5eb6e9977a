"""bench_serving's workload: the requests it sends (random prompts of given lengths as token ids or
text, a JSONL file, or groups sharing a system prompt), the adapter each one names, and when each
is sent (a Poisson process)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any, Sequence

WORDS = ("the engine reads a prompt splits it into tokens and runs the model one step at a time each "
         "step looks at every token that came before it and writes a little more of the answer").split()


@dataclass
class RequestSpec:
    body: dict[str, Any]
    output_len: int


def lora_weights(num_adapters: int, distribution: str, alpha: float) -> list[float]:
    """Relative popularity of the adapters, in the order given (zipf: the first is the hottest)."""
    if distribution == "uniform":
        return [1.0] * num_adapters
    if distribution == "zipf":
        return [1.0 / (rank ** alpha) for rank in range(1, num_adapters + 1)]
    raise ValueError(f"unknown LoRA distribution {distribution!r}")


def pick_adapters(names: Sequence[str], n: int, distribution: str, alpha: float, seed: int) -> list[str]:
    """One adapter per request, from its own random stream, so the picks depend on the seed alone."""
    rng = random.Random(seed + 2)
    return rng.choices(list(names), weights=lora_weights(len(names), distribution, alpha), k=n)


def _length(rng: random.Random, n: int, ratio: float) -> int:
    return rng.randint(max(1, int(n * ratio)), n)


def generated_shared_prefix_requests(args: argparse.Namespace, vocab_size: int,
                                     rng: random.Random) -> list[RequestSpec]:
    """G groups x Q requests: each group has its own system prompt of S token ids, each request
    its own question (about L ids) and output length (about O); order shuffled, so the groups
    interleave as independent users would. With `--gsp-lora-per-group`, group g is served by
    adapter `--lora-name[g % len]`."""
    specs = []
    for g in range(args.gsp_num_groups):
        system = [rng.randrange(10, vocab_size) for _ in range(args.gsp_system_prompt_len)]
        lora = args.lora_name[g % len(args.lora_name)] if args.gsp_lora_per_group else None
        for _ in range(args.gsp_prompts_per_group):
            question = [rng.randrange(10, vocab_size)
                        for _ in range(_length(rng, args.gsp_question_len, args.gsp_range_ratio))]
            body: dict[str, Any] = {"input_ids": system + question}
            if lora is not None:
                body["lora_path"] = lora
            specs.append(RequestSpec(body, _length(rng, args.gsp_output_len, args.gsp_range_ratio)))
    rng.shuffle(specs)
    return specs


def build_requests(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    specs: list[RequestSpec] = []
    if args.dataset_name == "generated-shared-prefix":
        specs = generated_shared_prefix_requests(args, vocab_size, rng)
    elif args.dataset_path:
        with open(args.dataset_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for row in rows[: args.num_prompts]:
            out_len = int(row.get("output_len") or row.get("max_new_tokens") or args.random_output_len)
            body: dict[str, Any] = {"input_ids": row["input_ids"]} if "input_ids" in row else {
                "text": row.get("prompt") or row.get("text")}
            specs.append(RequestSpec(body, out_len))
    else:
        for _ in range(args.num_prompts):
            in_len = _length(rng, args.random_input_len, args.random_range_ratio)
            out_len = _length(rng, args.random_output_len, args.random_range_ratio)
            if args.prompt_format == "ids":
                body = {"input_ids": [rng.randrange(10, vocab_size) for _ in range(in_len)]}
            else:
                body = {"text": " ".join(rng.choice(WORDS) for _ in range(in_len))}
            specs.append(RequestSpec(body, out_len))
    for spec in specs:
        spec.body["sampling_params"] = {"max_new_tokens": spec.output_len, "ignore_eos": True,
                                        "temperature": args.temperature}
        spec.body["stream"] = True
    if args.lora_name:
        # Requests that already name an adapter (the shared-prefix dataset's per-group adapters)
        # keep it; the others get one picked by --lora-distribution.
        unassigned = [spec for spec in specs if "lora_path" not in spec.body]
        picks = pick_adapters(args.lora_name, len(unassigned), args.lora_distribution, args.lora_zipf_alpha, args.seed)
        for spec, name in zip(unassigned, picks):
            spec.body["lora_path"] = name
    return specs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson process; all at 0 if inf)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
