"""Tool calling (reference §17.1.11): declaring tools, parsing calls out of replies, tool-result turns.

Wire formats, picked from the template's own markers:
  hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>          (Qwen2.5 / Qwen3, Hermes)
  llama3   {"name": ..., "parameters": {...}} as the whole reply, or <|python_tag|> + JSON / a builtin
           call such as brave_search.call(query="...") / python code           (Llama-3.1 / 3.2 / 3.3)
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}], or [TOOL_CALLS]name[ARGS]{...}
  harmony  <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
  dsl      <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flag:true,list:[...],obj:{...}}<tool_call|>  (Gemma-4)
Malformed call text stays in the content: parsing a model's reply never raises. Pure formats: the
chat-level calls (set_tools, parse_calls, ...) are in turns.py.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from .reasoning import ThinkSplit


@dataclass
class ToolCall:
    """One parsed call: the function name, its args as JSON object text, the wire id where the family has one."""

    name: str
    args: str = "{}"
    id: str = ""


@dataclass
class ToolReply:
    """A classified reply: the reasoning span, the content, and the calls made (empty when it answered)."""

    reasoning: str = ""
    content: str = ""
    calls: List[ToolCall] = field(default_factory=list)


def tool_format(template: str) -> Optional[str]:
    """The wire format the template speaks (see above), or None."""
    if "<|channel|>" in template:
        return "harmony"
    if "<|tool_call>" in template:
        return "dsl"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return "llama3"
    return None


def check_tools(tools: Sequence[Union[str, Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """OpenAI tools[] objects (dicts or JSON text) as dicts; raises ValueError on a malformed one."""
    out = []
    for t in tools:
        if isinstance(t, str):
            try:
                t = json.loads(t)
            except ValueError as e:
                raise ValueError(f"tool is not valid JSON: {e}") from e
        if not isinstance(t, dict):
            raise ValueError(f"a tool must be a JSON object, got {type(t).__name__}")
        out.append(t)
    return out


def result_messages(results: Sequence[str], names: Optional[Sequence[str]] = None,
                    ids: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Tool results as ``tool`` messages; ``names`` are the called functions, ``ids`` the call ids."""
    if isinstance(results, str):
        raise TypeError("results must be a list of strings")
    results = list(results)
    if names is not None and len(names) != len(results):
        raise ValueError(f"{len(results)} results but {len(names)} names")
    if ids is not None and len(ids) != len(results):
        raise ValueError(f"{len(results)} results but {len(ids)} ids")
    out = []
    for i, r in enumerate(results):
        if not isinstance(r, str):
            raise TypeError(f"tool result {i} must be str, got {type(r).__name__}")
        m: Dict[str, Any] = {"role": "tool", "content": r}
        if names is not None:
            m["name"] = str(names[i])
        if ids is not None:
            m["tool_call_id"] = str(ids[i])
        out.append(m)
    return out


def call_message(text: str, calls: Sequence[Union[str, Dict[str, Any]]]) -> Dict[str, Any]:
    """An assistant message that made ``calls`` (``{"name", "arguments"}`` objects or their JSON text)."""
    tcs = []
    for c in calls:
        obj = json.loads(c) if isinstance(c, str) else c
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError(f"a call must be an object with a name, got {c!r}")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args)
        tc: Dict[str, Any] = {"type": "function", "function": {"name": obj["name"], "arguments": args}}
        if obj.get("id"):
            tc["id"] = str(obj["id"])
        tcs.append(tc)
    return {"role": "assistant", "content": str(text), "tool_calls": tcs}


# -- parsing ----------------------------------------------------------------------------------------------

def _norm_args(args: Any) -> Optional[str]:
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _as_call(obj: Any, arg_keys=("arguments", "parameters")) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    a = _norm_args(args)
    if a is None:
        return None
    cid = obj.get("id", "")
    return ToolCall(obj["name"], a, cid if isinstance(cid, str) else "")


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _parse_hermes(content: str):
    calls: List[ToolCall] = []
    kept: List[str] = []
    pos = 0
    for m in _HERMES.finditer(content):
        c = _as_call(_loads(m.group(1).strip()))
        if c is None:
            continue  # malformed: the block stays in the content
        kept.append(content[pos:m.start()])
        pos = m.end()
        calls.append(c)
    kept.append(content[pos:])
    return "".join(kept).strip() if calls else content, calls


_BUILTIN = re.compile(r"^([A-Za-z_][\w]*)\.call\((.*)\)$", re.S)


def _parse_llama3(content: str):
    s = content.strip()
    tagged = s.startswith("<|python_tag|>")
    if tagged:
        s = s[len("<|python_tag|>"):].strip()
    # One JSON call, or several separated by ';' (Llama-3.2 may emit more than one).
    parts = [s] if s.startswith("{") and _loads(s) is not None else [p for p in s.split(";") if p.strip()]
    calls = [_as_call(_loads(p.strip())) for p in parts]
    if parts and all(c is not None for c in calls):
        return "", calls
    if tagged:
        m = _BUILTIN.match(s)
        if m:
            try:
                node = ast.parse(f"f({m.group(2)})", mode="eval").body
                if not node.args:
                    kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
                    if len(kw) == len(node.keywords):
                        return "", [ToolCall(m.group(1), json.dumps(kw, ensure_ascii=False))]
            except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
                pass
        if s:
            # Code for the code interpreter (the ipython tool), as llama.cpp names it.
            return "", [ToolCall("python", json.dumps({"code": s}, ensure_ascii=False))]
    return content, []


def _parse_mistral(content: str):
    i = content.find("[TOOL_CALLS]")
    if i < 0:
        return content, []
    before, rest = content[:i], content[i:]
    calls: List[ToolCall] = []
    # v3: [TOOL_CALLS] [{...}, ...]
    body = rest[len("[TOOL_CALLS]"):].strip()
    if body.startswith("["):
        try:
            obj, end = json.JSONDecoder().raw_decode(body)
        except (ValueError, RecursionError):
            obj, end = None, 0
        if isinstance(obj, list) and obj:
            calls = [_as_call(o) for o in obj]
            if all(c is not None for c in calls):
                return (before + body[end:]).strip(), calls
        return content, []
    # v11+: [TOOL_CALLS]name[ARGS]{...} (repeated)
    for seg in rest.split("[TOOL_CALLS]")[1:]:
        name, sep, args = seg.partition("[ARGS]")
        name = name.strip()
        if not sep or not name:
            return content, []
        if "[CALL_ID]" in name:
            name, _, cid = name.partition("[CALL_ID]")
        else:
            cid = ""
        a = _norm_args(args.strip())
        if a is None:
            return content, []
        calls.append(ToolCall(name.strip(), a, cid.strip()))
    return before.strip(), calls


_HARMONY_MSG = re.compile(r"(?:<\|start\|>)?([^<]*?)<\|channel\|>([^<]*?)(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)"
                          r"(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)", re.S)


def _parse_harmony(reply: str) -> ToolReply:
    reasoning, content, calls = [], [], []
    if "<|channel|>" not in reply:
        return ToolReply("", reply, [])
    for m in _HARMONY_MSG.finditer(reply):
        head = (m.group(1) + " " + m.group(2)).strip()
        body = m.group(3)
        channel = m.group(2).split()[0] if m.group(2).split() else ""
        to = re.search(r"to=functions\.([\w.\-]+)", head)
        if to:
            a = _norm_args(body.strip())
            if a is not None:
                calls.append(ToolCall(to.group(1), a))
                continue
            content.append(body)
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    if not (reasoning or content or calls):
        return ToolReply("", reply, [])
    return ToolReply("\n".join(r.strip() for r in reasoning), "\n".join(c.strip() for c in content).strip(), calls)


_DSL_Q = '<|"|>'
_DSL_CALL = re.compile(r"<\|tool_call>call:([\w.\-]+)(\{.*?\})<tool_call\|>", re.S)


class _DslError(ValueError):
    pass


def _dsl_value(t: str, i: int):
    """One value of the call grammar at t[i:]: a <|"|>-quoted string, {key:value,...}, [v,...], true / false /
    null, or a number (JSON's). Returns (value, next index)."""
    while i < len(t) and t[i] in " \n\t":
        i += 1
    if t.startswith(_DSL_Q, i):
        j = t.find(_DSL_Q, i + len(_DSL_Q))
        if j < 0:
            raise _DslError("unclosed string")
        return t[i + len(_DSL_Q):j], j + len(_DSL_Q)
    if t.startswith("{", i):
        out, i = {}, i + 1
        while True:
            while i < len(t) and t[i] in " \n\t,":
                i += 1
            if t.startswith("}", i):
                return out, i + 1
            j = t.find(":", i)
            if j < 0 or "}" in t[i:j]:
                raise _DslError("key without value")
            key = t[i:j].strip()
            if key.startswith(_DSL_Q) and key.endswith(_DSL_Q):
                key = key[len(_DSL_Q):-len(_DSL_Q)]
            out[key], i = _dsl_value(t, j + 1)
    if t.startswith("[", i):
        out, i = [], i + 1
        while True:
            while i < len(t) and t[i] in " \n\t,":
                i += 1
            if t.startswith("]", i):
                return out, i + 1
            v, i = _dsl_value(t, i)
            out.append(v)
    m = re.compile(r"true|false|null|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?").match(t, i)
    if not m:
        raise _DslError(f"bad value at {i}")
    return json.loads(m.group(0)), m.end()


def _parse_dsl(content: str):
    calls, keep, last = [], [], 0
    for m in _DSL_CALL.finditer(content):
        try:
            args, end = _dsl_value(m.group(2), 0)
            if end != len(m.group(2)):
                raise _DslError("trailing text")
        except (_DslError, ValueError, RecursionError):
            continue  # malformed: stays in the content
        keep.append(content[last:m.start()])
        last = m.end()
        calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
    keep.append(content[last:])
    return "".join(keep).strip() if calls else content, calls


def parse_reply(fmt: Optional[str], reply: str, split: Optional[ThinkSplit] = None) -> ToolReply:
    """Classify a complete reply per the wire format ``fmt``: reasoning, content, and the calls with their
    arguments as JSON object text. ``split`` is the reply's reasoning split (not used by Harmony, whose
    channels carry both); without a tool format the split alone is the answer."""
    if fmt == "harmony":
        return _parse_harmony(reply)
    split = split if split is not None else ThinkSplit("", reply)
    content, calls = split.content, []
    if fmt == "hermes":
        content, calls = _parse_hermes(content)
    elif fmt == "llama3":
        content, calls = _parse_llama3(content)
    elif fmt == "mistral":
        content, calls = _parse_mistral(content)
    elif fmt == "dsl":
        content, calls = _parse_dsl(content)
    return ToolReply(split.reasoning, content, calls)
