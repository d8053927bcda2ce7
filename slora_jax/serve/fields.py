"""The fields of vLLM's CompletionRequest and ChatCompletionRequest as this server takes them.

SUPPORTED_FIELDS: those the server reads (protocol.py checks each; `user` and `request_id` carry
no effect on the output; `best_of`, `suffix`, `tools` and chat's `echo` are read only to be
refused unless off). REFUSED_FIELDS: vLLM's fields that this server does not implement, each with the
values that mean "off" (the value vLLM defaults to; null is always off): any other value is a 400
naming the field, never ignored. docs/openai-api.md has the table beside vLLM's meanings.
"""

from __future__ import annotations

_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
             "ignore_eos", "min_tokens", "logprobs", "stream", "stream_options", "n", "best_of",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "echo", "user",
             "request_id", "return_token_ids", "ttft_slo", "include_stop_str_in_output", "skip_special_tokens",
             "prompt_logprobs"}
SUPPORTED_FIELDS = {
    "completions": _SAMPLING | {"prompt", "suffix"},
    "chat": _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools"},
}

_COMMON_REFUSED = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (), "allowed_token_ids": (),
    "bad_words": ([],), "response_format": ({"type": "text"},),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "structural_tag": (),
    "structured_outputs": (), "priority": (0,), "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "cache_salt": (), "kv_transfer_params": (), "vllm_xargs": (), "prompt_embeds": (),
}
REFUSED_FIELDS = {
    "completions": {**_COMMON_REFUSED, "add_special_tokens": (True,)},
    "chat": {**_COMMON_REFUSED, "add_special_tokens": (False,), "add_generation_prompt": (True,),
             "continue_final_message": (False,), "documents": (), "chat_template": (),
             "chat_template_kwargs": ({},), "mm_processor_kwargs": (), "tool_choice": ("none",),
             "parallel_tool_calls": (), "functions": (), "function_call": ("none",),
             "reasoning_effort": (), "include_reasoning": (True,)},
}


def is_off(value, offs: tuple) -> bool:
    """Whether a refused field's value asks for nothing: null, or one of its off values (of the
    same JSON type: false is not 0)."""
    return value is None or any(type(value) is type(off) and value == off for off in offs)
