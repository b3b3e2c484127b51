"""Shared fixtures: real models are pulled through the hub (never skipped)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    from dasllama import hub

    return hub.pull("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path():
    from dasllama import hub

    return hub.pull("gemma3-270m")


@pytest.fixture(scope="session")
def hf_tokenizer():
    """hf_tokenizer(path): transformers' tokenizer built from a GGUF file (the tokenizer oracle),
    once per file a session (tests/oracles/moe.py's cache, which the oracles' own fixtures share):
    gemma3's 262k-token vocabulary takes ~20 s to convert. Shared, so callers only read it
    (deepcopy it to change it)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
    import moe as M

    return lambda path: M.tokenizer(str(path))


@pytest.fixture(scope="session")
def qwen3_asr_files(tmp_path_factory, smollm2_path):
    """A tiny random Qwen3-ASR written by llama.cpp's converter (tests/oracles/qwen3asr.py: two
    converter runs), shared by test_qwen3_asr.py and the device tests: {"hf", "tok", "decoder", "mmproj"}."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
    import moe as M
    import qwen3asr as Q

    tok = Q.asr_tokenizer(M.tokenizer(str(smollm2_path)))
    m, dec, mm = Q.build(tok, str(tmp_path_factory.mktemp("qwen3asr")))
    return {"hf": m, "tok": tok, "decoder": dec, "mmproj": mm}


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_path):
    """transformers' SmolLM2 from the same GGUF in fp32 (the logits oracle), built once a session:
    test_kv and test_llm (twice) each took ~20 s to build it. Shared, so callers only run it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(str(smollm2_path)),
                                                gguf_file=os.path.basename(str(smollm2_path)),
                                                torch_dtype=torch.float32).eval()
