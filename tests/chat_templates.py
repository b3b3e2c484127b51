"""Chat templates the tests write in vendor wire formats (Qwen3 hermes + <think>, Llama-3.1, Mistral, Harmony).

Written here from the vendors' documented turn formats, not copied from model files; transformers'
apply_chat_template renders them as the oracle for our renderer.
"""

# Qwen3: ChatML turns, tools in the system turn as <tools> JSON lines, calls as <tool_call> blocks, tool
# results as <tool_response> in a user turn; reasoning kept only for assistant turns after the last user
# query (so earlier turns are rewritten), and enable_thinking=false writes an empty think block.
QWEN3 = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" + (tool | tojson) }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}
{%- set reasoning = '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_user and reasoning %}{{- '<think>\n' + reasoning + '\n</think>\n\n' }}{%- endif %}
{{- content }}
{%- for tc in m.tool_calls or [] %}
{%- set f = tc.function if tc.function else tc %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# Llama-3.1: header turns closed by <|eot_id|>; tools in the first user turn with the JSON call instruction;
# calls as {"name": ..., "parameters": ...}; tool results in an ipython turn.
LLAMA31 = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set msgs = messages[1:] %}
{%- else %}{%- set sys = '' %}{%- set msgs = messages %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' + sys + '<|eot_id|>' }}
{%- for m in msgs %}
{%- if m.role == 'user' %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
{%- if loop.first and tools %}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) + '\n\n' }}{%- endfor %}
{%- endif %}
{{- m.content | trim + '<|eot_id|>' }}
{%- elif m.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- if m.tool_calls %}
{%- set f = m.tool_calls[0].function %}
{{- '{"name": "' + f.name + '", "parameters": ' + (f.arguments | tojson) + '}<|eot_id|>' }}
{%- else %}{{- m.content | trim + '<|eot_id|>' }}{%- endif %}
{%- elif m.role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Mistral (v3 tokenizer): [INST] turns, tools as [AVAILABLE_TOOLS] before the last user turn, calls as
# [TOOL_CALLS] [...] with 9-character ids, results as [TOOL_RESULTS]; the system prompt opens the last user turn.
MISTRAL = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set msgs = messages[1:] %}
{%- else %}{%- set sys = '' %}{%- set msgs = messages %}{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in msgs %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in msgs %}
{%- if m.role == 'user' %}
{%- if loop.index0 == ns.last_user and tools %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' }}{%- if loop.index0 == ns.last_user and sys %}{{- sys + '\n\n' }}{%- endif %}{{- m.content + '[/INST]' }}
{%- elif m.role == 'assistant' %}
{%- if m.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for tc in m.tool_calls %}
{{- '{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + ', "id": "' + tc.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- else %}{{- ' ' + m.content + eos_token }}{%- endif %}
{%- elif m.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + (m.content | tojson) + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

# gpt-oss Harmony: system and developer messages, functions namespace for tools, channels analysis /
# commentary / final; calls to=functions.NAME on commentary ending in <|call|>; results from functions.NAME.
HARMONY = r"""
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- '<|end|>' }}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set msgs = messages[1:] %}
{%- else %}{%- set sys = '' %}{%- set msgs = messages %}{%- endif %}
{%- if sys or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if sys %}{{- '# Instructions\n\n' + sys }}{%- endif %}
{%- if tools %}
{{- '\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
{%- for t in tools %}
{{- '// ' + t.function.description + '\ntype ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson) + ') => any;\n\n' }}
{%- endfor %}
{{- '} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for m in msgs %}
{%- if m.role == 'user' %}
{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'assistant' %}
{%- if m.tool_calls %}
{%- for tc in m.tool_calls %}
{{- '<|start|>assistant to=functions.' + tc.function.name + '<|channel|>commentary json<|message|>' + (tc.function.arguments | tojson) + '<|call|>' }}
{%- endfor %}
{%- else %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- elif m.role == 'tool' %}
{{- '<|start|>functions.' + m.name + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""
