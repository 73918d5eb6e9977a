"""A test checkpoint whose model deterministically writes what the test asks for: a "delay line".

Tool-call and reasoning parsing need a model that emits real markup (`<tool_call>`, `<think>`,
`[TOOL_CALLS]`, ...) through the real tokenizer, detokenizer and streaming path; a random model
never does. This one is a real one-layer Llama checkpoint whose weights are set by hand so that
the token it predicts at position p is the token the prompt holds at position p - DELAY + 1:

* embeddings are one-hot: token t is e_t, plus a constant 1 in a "bias" dimension;
* q and k read only that bias dimension, so they are the same at every position, and RoPE makes
  the attention score a function of the distance alone: A * sum_i cos(w_i * (d - DELAY + 1)),
  which peaks sharply at d = DELAY - 1 (every head alike);
* v copies the one-hot token into the heads' value dimensions, o_proj into a "copy" subspace of
  the residual, and the LM head reads that subspace: the logit of the copied token is ~40, every
  other one ~0. The MLP is zero.

So a chat whose last message holds `text`, then `<|im_end|>` (an end-of-turn id), padded so that
the text starts DELAY - 1 tokens before the end of the prompt, is answered with exactly `text`,
token for token as the tokenizer split it, and then stops (`echo_messages` builds it). Greedy
decoding only. The tokenizer is make_checkpoint's, plus the markup tokens of the formats the
parsers read (non-special like Qwen's and DeepSeek's; `<|python_tag|>` and `[TOOL_CALLS]`
special, as in Llama 3.1 and Mistral), and its chat template is a Qwen2.5-style one with tools
(written for this project).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

DELAY = 400  # the model copies the token DELAY - 1 positions back
MAX_POSITIONS = 2048
HEAD_DIM = 64
ROPE_THETA = 10000.0
ATTENTION_AMP = 40.0  # per RoPE pair, after the 1/sqrt(head_dim) scaling: see distance_scores
COPY_LOGIT = 40.0  # the copied token's logit (every other token's is 0)
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tools>", "</tools>",
                "<tool_response>", "</tool_response>"]
FILL_TOKEN = "<|fill|>"  # what pads a message (not the pad token: HF generate would mask it out)
ADDED_SPECIAL_TOKENS = ["<|python_tag|>", "[TOOL_CALLS]", FILL_TOKEN]
END_OF_TURN = "<|im_end|>"

# A Qwen2.5-style template (its conventions, our text): tools as JSON lines in the system turn,
# assistant tool calls as <tool_call> JSON, tool results as a user turn of <tool_response>s.
# `enable_thinking=false` closes an empty think block (Qwen3); `open_think=true` opens one in the
# generation prompt, as DeepSeek-R1's template does.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0].role in ['system', 'developer'] -%}{%- set ns.system = messages[0].content -%}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' + (ns.system if ns.system else 'You are a helpful assistant.') -}}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif ns.system -%}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role in ['system', 'developer'] and loop.first -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' + (fn.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- if open_think is defined and open_think -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def build_echo_tokenizer():
    """make_checkpoint's byte-level BPE, with the markup tokens and the tools chat template."""
    from tokenizers import AddedToken

    from sglang.srt.tools.make_checkpoint import build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED_SPECIAL_TOKENS], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _echo_weights(model, vocab: int, hidden: int, bias_dim: int) -> None:
    """Set the delay line's weights in place (see the module docstring)."""
    import torch

    cfg = model.config
    heads = cfg.num_attention_heads
    half = HEAD_DIM // 2
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.model.embed_tokens.weight  # [vocab, hidden]
        emb[torch.arange(vocab), torch.arange(vocab)] = 1.0
        emb[:, bias_dim] = 1.0
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        # After the input norm the bias dimension reads sqrt(hidden / 2) (two ones per row).
        unit = math.sqrt(hidden / 2)
        # Pair i of a head rotates at w_i; k = (1, 0) and q = A * exp(-i w_i (DELAY - 1)) per pair
        # make the score A * sum_i cos(w_i * (distance - DELAY + 1)).
        inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD_DIM)
        angle = inv_freq * (DELAY - 1)
        q_head = torch.cat([torch.cos(angle), -torch.sin(angle)]) * ATTENTION_AMP * math.sqrt(HEAD_DIM) / unit
        k_head = torch.cat([torch.ones(half, dtype=torch.float64), torch.zeros(half, dtype=torch.float64)]) / unit
        attn = layer.self_attn
        for h in range(heads):
            attn.q_proj.weight[h * HEAD_DIM:(h + 1) * HEAD_DIM, bias_dim] = q_head.float()
            attn.k_proj.weight[h * HEAD_DIM:(h + 1) * HEAD_DIM, bias_dim] = k_head.float()
        # v: token t's one-hot into value dimension t (heads side by side); o: into the copy subspace.
        attn.v_proj.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0 / unit
        attn.o_proj.weight[vocab + torch.arange(vocab), torch.arange(vocab)] = 1.0
        model.model.norm.weight[vocab:2 * vocab] = 1.0
        # The residual is e_t + e_bias + e_copy(s): the final norm divides by sqrt(3 / hidden).
        model.lm_head.weight[torch.arange(vocab), vocab + torch.arange(vocab)] = COPY_LOGIT / math.sqrt(hidden / 3)


def distance_scores() -> Any:
    """The attention score (after scaling) at every distance 0..MAX_POSITIONS-1, as the weights
    above make it (the delay line is sharp if DELAY - 1 beats every other distance by a wide margin)."""
    import torch

    half = HEAD_DIM // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD_DIM)
    d = torch.arange(MAX_POSITIONS, dtype=torch.float64)
    return ATTENTION_AMP * torch.cos((d[:, None] - (DELAY - 1)) * inv_freq[None, :]).sum(-1)


def make_echo_checkpoint(out_dir: str) -> str:
    """Write the checkpoint (config, weights, tokenizer, generation config) and return its path."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = build_echo_tokenizer()
    vocab = 64 * math.ceil(len(tok) / 64)
    bias_dim = 2 * vocab
    hidden = HEAD_DIM * math.ceil((bias_dim + 1) / HEAD_DIM)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=hidden // HEAD_DIM, num_key_value_heads=hidden // HEAD_DIM, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_theta": ROPE_THETA, "rope_type": "default"},
        bos_token_id=tok.convert_tokens_to_ids("<|begin_of_text|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, architectures=["LlamaForCausalLM"],
    )
    config.dtype = "float32"
    model = LlamaForCausalLM(config).eval()
    _echo_weights(model, vocab, hidden, bias_dim)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(END_OF_TURN)],
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def echo_checkpoint() -> str:
    """The checkpoint in the shared test cache, built once per machine."""
    from server_helpers import cache_dir_for_tests

    from sglang.srt.tools.demo import materialize_once

    path = os.path.join(cache_dir_for_tests(), f"echo-llama-d{DELAY}-v1")
    materialize_once(path, make_echo_checkpoint)
    return path


def echo_messages(prompt_ids: Callable[[list[dict[str, Any]]], list[int]], text_ids: list[int],
                  messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` whose last message's content (which must end with the text of `text_ids`, then
    END_OF_TURN) is padded so that the echo model answers with `text_ids`. `prompt_ids(messages)`
    gives the ids the server will prefill for `messages` (e.g. through /tokenize)."""
    ids = prompt_ids(messages)
    n = len(text_ids)
    start = next((i for i in range(len(ids) - n, -1, -1) if ids[i:i + n] == text_ids), None)
    assert start is not None, "the text is not in the prompt as tokenised alone"
    pads = DELAY - 1 - (len(ids) - 1 - start)
    assert pads >= 0, f"the text and what follows it are {-pads} tokens too long for DELAY={DELAY}"
    out = [dict(m) for m in messages]
    out[-1]["content"] = out[-1]["content"] + FILL_TOKEN * pads
    padded = prompt_ids(out)
    assert len(padded) == len(ids) + pads and padded[start:start + n] == text_ids, "padding changed the prompt"
    return out


def echo_body(url: str, text: str, messages: Optional[list[dict[str, Any]]] = None,
              tools: Optional[list[dict[str, Any]]] = None, **fields: Any) -> dict[str, Any]:
    """A /v1/chat/completions body (greedy) that the server of the echo checkpoint at `url`
    answers with exactly `text`. The text goes at the end of the last message (a user message by
    default); `tools` and `fields` (tool_choice, chat_template_kwargs, ...) are the request's own."""
    import requests

    def post(path: str, body: dict[str, Any]) -> list[int]:
        r = requests.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    # The prompt as the server renders it: tools only where the template gets them.
    rendered = tools if tools and fields.get("tool_choice") != "none" else None
    kwargs = fields.get("chat_template_kwargs")

    def prompt_ids(msgs: list[dict[str, Any]]) -> list[int]:
        body: dict[str, Any] = {"messages": msgs, "tools": rendered, "chat_template_kwargs": kwargs}
        return post("/tokenize", {k: v for k, v in body.items() if v is not None})

    messages = [dict(m) for m in (messages or [{"role": "user", "content": ""}])]
    messages[-1]["content"] += text + END_OF_TURN
    text_ids = post("/tokenize", {"prompt": text, "add_special_tokens": False})
    body = {"model": "default", "messages": echo_messages(prompt_ids, text_ids, messages),
            "temperature": 0, "max_tokens": len(text_ids) + 8, **fields}
    if tools is not None:
        body["tools"] = tools
    return body
