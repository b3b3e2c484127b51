"""`dasllama chat` as a user runs it: a one-shot question, and an interactive session fed on stdin."""
from __future__ import annotations

import json
import subprocess
import sys


def _chat(args, stdin=None):
    return subprocess.run([sys.executable, "-m", "dasllama", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=600)


def test_one_shot_question(smollm2_path):
    r = _chat(["What is the capital of France?", "--model", str(smollm2_path), "--max-tokens", "16"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_interactive_save_reset_load(smollm2_path, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    script = "\n".join([
        "Hello!", f"/save {a}", "/reset", f"/save {tmp_path / 'empty.json'}", f"/load {a}", f"/save {b}",
        "Tell me a joke.", f"/save {tmp_path / 'c.json'}", f"/load {tmp_path / 'missing.json'}", "/exit"]) + "\n"
    r = _chat(["--model", str(smollm2_path), "--system", "Be brief.", "--max-tokens", "12"], stdin=script)
    assert r.returncode == 0, r.stderr
    saved = json.loads(a.read_text())
    assert saved["system"] == "Be brief."
    assert [m["role"] for m in saved["history"]] == ["system", "user", "assistant"]
    assert saved["history"][1]["content"] == "Hello!" and saved["history"][2]["content"]
    # /reset keeps only the system prompt; /load brings the transcript back exactly.
    assert [m["role"] for m in json.loads((tmp_path / "empty.json").read_text())["history"]] == ["system"]
    assert json.loads(b.read_text()) == saved
    after = json.loads((tmp_path / "c.json").read_text())["history"]
    assert after[:3] == saved["history"] and [m["role"] for m in after[3:]] == ["user", "assistant"]
    assert "cannot load" in r.stdout


def test_main_job_answers(smollm2_path, capsys):
    """The README's main job through the chat layer: the same greedy answer `dasllama run` gives."""
    from dasllama.cli import main

    assert main(["chat", "What is the capital of France? Answer in one sentence.", "--model", str(smollm2_path),
                 "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out
