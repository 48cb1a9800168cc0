"""Chat templates: the model's own, a --chat-template file, or its family's documented one."""
from __future__ import annotations

from pathlib import Path
from typing import Any

# Tools in the fallback templates (Hermes's format, which flatserve/server/tools.py parses): the
# function schemas go at the head of the first turn; earlier calls and results are written back.
_TOOLS = (
    "{%- if tools -%}{%- set tool_text = 'You can call these functions (JSON schemas):\n' ~ "
    "(tools | tojson) ~ '\nTo call one, reply with <tool_call>{\"name\": NAME, \"arguments\": "
    "{...}}</tool_call>.\n\n' -%}{%- else -%}{%- set tool_text = '' -%}{%- endif -%}"
    "{%- macro body(m) -%}{%- if m['role'] == 'tool' -%}"
    "{{ '<tool_response>\n' ~ m['content'] ~ '\n</tool_response>' }}"
    "{%- else -%}{{ m['content'] or '' }}{%- for c in (m['tool_calls'] or []) -%}"
    "{{ '<tool_call>{\"name\": ' ~ (c['function']['name'] | tojson) ~ ', \"arguments\": ' ~ "
    "(c['function']['arguments'] | tojson) ~ '}</tool_call>' }}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)
# Gemma's documented turn format (the default base model ships no template).
GEMMA = _TOOLS + (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = tool_text + messages[0]['content'] + '\n\n' -%}{%- set msgs = messages[1:] -%}"
    "{%- else -%}{%- set prefix = tool_text -%}{%- set msgs = messages -%}{%- endif -%}"
    "{%- for m in msgs -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else ('user' if m['role'] == 'tool' "
    "else m['role']) -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + body(m) | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# ChatML, as Qwen documents it.
CHATML = _TOOLS + (
    "{%- if tool_text and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\n' + tool_text | trim + '<|im_end|>\n' }}{%- endif -%}"
    "{%- for m in messages -%}{%- set role = 'user' if m['role'] == 'tool' else m['role'] -%}"
    "{{ '<|im_start|>' + role + '\n' + (tool_text if loop.first and role == 'system' else '')"
    " + body(m) + '<|im_end|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
# Llama 3's documented header format.
LLAMA3 = _TOOLS + (
    "{{ bos_token }}"
    "{%- if tool_text and messages[0]['role'] != 'system' -%}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' + tool_text | trim + '<|eot_id|>' }}"
    "{%- endif -%}{%- for m in messages -%}"
    "{%- set role = 'ipython' if m['role'] == 'tool' else m['role'] -%}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + ((tool_text if loop.first and "
    "role == 'system' else '') + body(m)) | trim + '<|eot_id|>' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)
# Phi-3's documented turn format.
PHI3 = (
    "{%- for m in messages -%}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- else -%}{{ eos_token }}{%- endif -%}"
)
# Mistral's [INST] format (system text goes before the first user turn).
MISTRAL = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set msgs = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set msgs = messages -%}{%- endif -%}"
    "{%- for m in msgs -%}"
    "{%- if m['role'] == 'user' -%}{{ '[INST] ' + (prefix if loop.first else '') + m['content'] + ' [/INST]' }}"
    "{%- else -%}{{ ' ' + m['content'] + eos_token }}{%- endif -%}"
    "{%- endfor -%}"
)
# Granite 3's role markers.
GRANITE = (
    "{%- for m in messages -%}"
    "{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] + '<|end_of_text|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|start_of_role|>assistant<|end_of_role|>' }}"
    "{%- endif -%}"
)
# Used only where the tokenizer ships no template (base checkpoints, some GGUFs).
_FAMILY = {"Gemma3ForCausalLM": (GEMMA, "<end_of_turn>"), "Gemma2ForCausalLM": (GEMMA, "<end_of_turn>"),
           "Qwen3ForCausalLM": (CHATML, "<|im_end|>"), "Qwen2ForCausalLM": (CHATML, "<|im_end|>"),
           "SmolLM3ForCausalLM": (CHATML, "<|im_end|>"), "LlamaForCausalLM": (LLAMA3, "<|eot_id|>"),
           "MistralForCausalLM": (MISTRAL, "</s>"), "Phi3ForCausalLM": (PHI3, "<|end|>"),
           "GraniteForCausalLM": (GRANITE, "<|end_of_text|>")}


def chat_template(tokenizer: Any, architecture: str, override: str | None) -> tuple[str, int | None]:
    """(template, end-of-turn token id to stop on, if the tokenizer knows it)."""
    family, eot = _FAMILY.get(architecture, (CHATML, "<|im_end|>"))
    if override:
        template = Path(override).read_text()
    else:
        template = getattr(tokenizer, "chat_template", None) or family
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    unk = getattr(tokenizer, "unk_token_id", None)
    return template, (eot_id if isinstance(eot_id, int) and eot_id != unk else None)


def render(tokenizer: Any, template: str, messages: list[dict[str, Any]],
           add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] needs a 'role' and a string 'content'")
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, tools=tools)
    # The template writes the BOS itself; do not add a second one.
    return tokenizer(text, add_special_tokens=False).input_ids
