"""Replicas on Ray Serve (dasllama.server.ray) with cache-affine routing (dasllama.server.routing).

The routing keys and decision are checked as plain code first. Then one local Ray cluster per module
serves two applications, each of two single-thread replicas: SmolLM2 (text) and a tiny random
Qwen2-Audio (audio), driven through the official openai client over HTTP. Replies are checked against
the library's own greedy generation on the rendered prompt (which test_server.py and the text tests tie
to the single server and to transformers), cache hits and encodes through the replicas' metrics.
"""
import base64
import io
import os
import signal
import socket
import sys
import threading
import time

import openai
import pytest

import dasllama as d
from dasllama.chat.template import render_prompt
from dasllama.server.routing import AffinityPolicy, KeyReport, decode_keys, encode_keys, reply_keys, request_keys

import ray  # noqa: E402 - the test extra brings it
from ray import serve  # noqa: E402

from dasllama.server.ray import board_name, build_app  # noqa: E402

# ---- the routing code, alone ----------------------------------------------------------------------------


def _msgs(*turns):
    out = [{"role": "system", "content": "You are terse. " * 40}]
    for i, t in enumerate(turns):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return out


def _clip_msg(data, text):
    return {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                        {"type": "text", "text": text}]}


def test_keys_of_a_later_turn_extend_the_earlier_turn():
    k1 = request_keys({"messages": _msgs("Hi")})
    k2 = request_keys({"messages": _msgs("Hi", "Hello!", "How are you?")})
    assert k2.keys[:len(k1.keys)] == k1.keys and len(k2.keys) > len(k1.keys)
    assert list(k2.weights) == sorted(k2.weights)
    # the reply's keys, as the replica records them, are what the next turn sends
    assert reply_keys(k1, {"messages": _msgs("Hi")}, "Hello!").keys == k2.keys[:-1]
    # a shared system prompt is a shared prefix; a different one is not
    other = request_keys({"messages": [{"role": "system", "content": "Other."}, {"role": "user", "content": "Hi"}]})
    assert other.keys[0] != k1.keys[0] or other.keys[1] != k1.keys[1]


def test_keys_name_media_by_content():
    a = base64.b64encode(b"clip-one" * 10).decode()
    b = base64.b64encode(b"clip-two" * 10).decode()
    ka = request_keys({"messages": [_clip_msg(a, "What is said?")]})
    ka2 = request_keys({"messages": [_clip_msg(a, "What is said?")]})
    kb = request_keys({"messages": [_clip_msg(b, "What is said?")]})
    assert ka == ka2
    assert ka.keys[0] != kb.keys[0] and ka.weights == kb.weights  # another clip: another prefix from there
    img = request_keys({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + a}}]}]})
    assert img.keys[0] != ka.keys[0]
    # a role alone keys nothing: conversations that only share "user:" share no key
    assert request_keys({"messages": [{"role": "user", "content": "a"}]}).keys[0] != \
        request_keys({"messages": [{"role": "user", "content": "b"}]}).keys[0]
    assert request_keys({"prompt": "x" * 600}).weights == (256, 512, 600)
    assert request_keys(None).keys == () and request_keys({"input": "embed me"}).keys == ()


def test_policy_prefers_the_longest_cached_prefix_until_its_load_is_past_the_bound():
    p = AffinityPolicy(max_load=2, load_cost=100, memory_s=0.0)
    k1 = request_keys({"messages": _msgs("Hi")})
    k2 = request_keys({"messages": _msgs("Hi", "Hello!", "Tell me more.")})
    p.report("a", k1.keys[:1])   # only the system prompt
    p.report("b", k1.keys)       # the whole first turn
    assert p.choose(k2, {"a": 0, "b": 1}) == "b"
    assert p.choose(k2, {"a": 0, "b": 2}) == "b"
    assert p.choose(k2, {"a": 0, "b": 3}) == "a"          # past the bound: the least-loaded
    assert p.rank(k2, {"a": 5, "b": 0, "c": 1}) == ["b", "c", "a"]
    fresh = request_keys({"messages": [{"role": "user", "content": "unrelated"}]})
    assert p.choose(fresh, {"a": 1, "b": 0, "c": 0}) == "c"   # no match: least-loaded, emptiest cache
    p.forget("b")
    assert p.choose(k2, {"a": 0, "c": 0}) == "a"
    with pytest.raises(ValueError):
        p.choose(k2, {})


def test_a_shared_system_prompt_spreads_once_its_holder_is_busier():
    p = AffinityPolicy(max_load=8, load_cost=512, memory_s=0.0)
    system = request_keys({"messages": _msgs()})           # 600 characters every conversation starts with
    p.report("a", system.keys)
    new = request_keys({"messages": _msgs("A new conversation")})
    assert p.choose(new, {"a": 0, "b": 0}) == "a"          # the prefill saved is worth it
    assert p.choose(new, {"a": 2, "b": 0}) == "b"          # not two requests of waiting
    own = request_keys({"messages": _msgs("x" * 4000, "ok", "more")})
    p.report("a", request_keys({"messages": _msgs("x" * 4000, "ok")}).keys)
    assert p.choose(own, {"a": 4, "b": 0}) == "a"          # a long history of its own stays home


def test_policy_remembers_its_own_routes_until_the_next_report():
    now = [0.0]
    p = AffinityPolicy(memory_s=5.0, clock=lambda: now[0])
    k = request_keys({"messages": _msgs("Hi")})
    p.note_routed("b", k)
    assert p.choose(k, {"a": 0, "b": 0}) == "b"
    now[0] = 10.0  # past the memory: only reports count
    assert p.matched("b", k) == 0


def test_key_report_keeps_what_the_cache_still_holds():
    r = KeyReport(max_keys=100)
    k1 = request_keys({"messages": _msgs("Hi")})
    k2 = request_keys({"messages": [{"role": "user", "content": "y" * 1000}]})
    t1, t2 = r.add(k1), r.add(k2)
    assert set(r.snapshot({t1: 1.0, t2: 1.0})) == set(k1.keys) | set(k2.keys)
    half = r.snapshot({t1: 1.0, t2: 0.5})  # leaves evicted first: the front half of the chain is kept
    assert set(half) - set(k1.keys) == {k for k, w in zip(k2.keys, k2.weights) if w <= k2.total * 0.5}
    assert set(r.snapshot({t1: 1.0})) == set(k1.keys)                  # t2 was cached and let go: forgotten
    assert set(r.snapshot({t1: 1.0, t2: 1.0})) == set(k1.keys)
    # a request between its reply and its donation (never seen live yet) is kept until it shows up
    t3 = r.add(request_keys({"prompt": "z" * 300}))
    assert set(r.snapshot({t1: 1.0})) == set(k1.keys)
    assert len(r.snapshot({t1: 1.0, t3: 1.0})) == len(k1.keys) + 2
    assert decode_keys(encode_keys(k1.keys)) == list(k1.keys)


def test_cli_ray_flags_need_ray():
    from dasllama import cli

    assert cli.main(["serve", "--replicas", "2"]) == 2
    assert cli.main(["serve", "--ray", "--replicas", "0"]) == 2


# ---- a local Ray cluster ---------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    # Logical CPUs: four single-thread replicas at 0.5 each; the machine's cores are shared anyway.
    ray.init(num_cpus=4, include_dashboard=False, namespace="dasllama-test", log_to_driver=False,
             object_store_memory=200 << 20)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _board(app):
    return ray.get_actor(board_name(app), namespace="serve")


def _per_replica(app):
    # Replicas post every second; a loaded machine may delay a post by seconds, so allow 15 s of age.
    return ray.get(_board(app).get.remote(15.0))


def _metrics(base, prefix):
    """The aggregated /metrics page: {name: value} for the unlabelled sums, {(name, replica): value} per replica."""
    import httpx

    out = {}
    for ln in httpx.get(f"{base}{prefix}/metrics", timeout=60).text.splitlines():
        if ln.startswith("dasllama_"):
            name, val = ln.rsplit(" ", 1)
            if "{" in name:
                key, label = name.split("{", 1)
                out[(key[len("dasllama_"):], label.split('"')[1])] = float(val)
            else:
                out[name[len("dasllama_"):]] = float(val)
    return out


@pytest.fixture(scope="module")
def text_app(cluster, smollm2_path):
    serve.run(build_app(smollm2_path, replicas=2, replica_cpus=0.5, streams=2, ctx=1024, n_threads=1,
                        stats_period_s=0.5, health_check_period_s=2.0),
              name="text", route_prefix="/text")
    base = f"{cluster}/text"
    yield {"base": base, "model": d.load_model(smollm2_path),
           "oai": openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)}
    serve.delete("text")


def reference(model, messages, max_tokens):
    """Greedy reply of the library itself, on the rendered prompt, in a fresh session (what one server gives)."""
    ids = d.encode(model, render_prompt(model, messages), add_special=False, parse_special=True)
    s = d.create_session(model, n_ctx=1024)
    out = []
    d.generate(model, s, ids, d.SamplingParams(), max_tokens, lambda i, p: out.append(p))
    return "".join(out)


CONVERSATIONS = [["What is the capital of France?", "And of Italy?", "Which one is bigger?"],
                 ["Name three colors.", "Which of them is warm?", "Why?"],
                 ["Write a haiku about the sea.", "Now one about rain.", "Which do you prefer?"],
                 ["What is 2 + 2?", "And times 3?", "Say it in words."]]


def test_later_turns_hit_their_affine_replica_and_equal_greedy(text_app):
    oai, model = text_app["oai"], text_app["model"]
    firsts = []
    for conv in CONVERSATIONS:
        msgs = []
        home = None
        for turn, q in enumerate(conv):
            msgs.append({"role": "user", "content": q})
            raw = oai.chat.completions.with_raw_response.create(model="m", messages=msgs, temperature=0, max_tokens=12)
            r = raw.parse()
            replica = raw.headers["x-dasllama-replica"]
            assert r.choices[0].message.content == reference(model, msgs, 12), (conv, turn)
            if turn == 0:
                home = replica
                firsts.append(replica)
            else:
                assert replica == home, f"turn {turn} of {conv[0]!r} left its replica"
                assert r.usage.prompt_tokens_details.cached_tokens > 0
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    assert len(set(firsts)) == 2, "new conversations should spread over both replicas"


def test_streaming_through_the_ingress_equals_greedy(text_app):
    oai, model = text_app["oai"], text_app["model"]
    msgs = [{"role": "user", "content": "Tell me a fact about owls."}]
    raw = oai.chat.completions.with_raw_response.create(model="m", messages=msgs, temperature=0, max_tokens=12,
                                                        stream=True)
    parts = [c.choices[0].delta.content or "" for c in raw.parse() if c.choices]
    assert "".join(parts) == reference(model, msgs, 12)
    # the next turn goes home and finds the streamed reply in the cache too
    msgs += [{"role": "assistant", "content": "".join(parts)}, {"role": "user", "content": "Another one?"}]
    raw2 = oai.chat.completions.with_raw_response.create(model="m", messages=msgs, temperature=0, max_tokens=12)
    assert raw2.headers["x-dasllama-replica"] == raw.headers["x-dasllama-replica"]
    assert raw2.parse().choices[0].message.content == reference(model, msgs, 12)
    assert raw2.parse().usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_aggregate_the_replicas_pools(text_app):
    m = _wait(lambda: (lambda x: x if x.get("replicas") == 2 else None)(_metrics(text_app["base"], "")),
              120, "both replicas on the board")
    reps = {rep for (k, rep) in [k for k in m if isinstance(k, tuple)]}
    assert len(reps) == 2
    assert m["kv_pages_total"] == sum(m[("kv_pages_total", r)] for r in reps)
    assert m["requests_total"] >= 1
    for r in reps:  # idle: no session holds a page; every page is free or cached
        assert m[("kv_pages_sessions", r)] == 0
        assert m[("kv_pages_free", r)] + m[("kv_pages_cache", r)] == m[("kv_pages_total", r)]


def test_bad_requests_answer_like_the_plain_server(text_app):
    import httpx

    r = httpx.post(f"{text_app['base']}/v1/chat/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{text_app['base']}/v1/nothing", timeout=60)
    assert r.status_code == 404
    assert httpx.get(f"{text_app['base']}/health", timeout=60).json() == {"status": "ok"}


def test_a_killed_replica_loses_no_other_request_and_recovers(text_app):
    base, model = text_app["base"], text_app["model"]
    before = _per_replica("text")
    assert len(before) == 2
    # Replies long enough (160 tokens, 4 a stream) that a replica is still generating when its
    # board entry (posted every second) is read: on a quiet machine 40-token replies all ended first.
    questions = [f"Count from {i} to {i + 200}, one number a line." for i in range(8)]
    want = {q: reference(model, [{"role": "user", "content": q}], 160) for q in questions}
    retrying = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=6, timeout=600)
    once = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    results = {}

    def ask(i, q):
        client = retrying if i % 2 == 0 else once
        try:
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}],
                                               temperature=0, max_tokens=160)
            results[q] = ("ok", r.choices[0].message.content)
        except openai.APIStatusError as e:
            results[q] = ("status", e.status_code, e.response.headers.get("retry-after"), e.message)
        except Exception as e:  # noqa: BLE001 - recorded, and fails the test below
            results[q] = ("error", repr(e))

    threads = [threading.Thread(target=ask, args=(i, q)) for i, q in enumerate(questions)]
    for t in threads:
        t.start()
    # Kill a replica while it generates (its board entry shows active streams).
    busy = _wait(lambda: next((m for m in _per_replica("text").values() if m["active_streams"] > 0), None),
                 300, "a replica generating")
    os.kill(int(busy["pid"]), signal.SIGKILL)
    for t in threads:
        t.join(timeout=900)
    assert all(not t.is_alive() for t in threads)
    print("killed", busy["replica"], "with", busy["active_streams"], "streams running;",
          {q[:14]: r[:2] for q, r in results.items()})
    for i, q in enumerate(questions):
        res = results[q]
        if res[0] == "ok":
            assert res[1] == want[q], q
        else:  # only a request that was on the killed replica, without retries, may fail: 503, retry
            assert i % 2 == 1 and res[0] == "status" and res[1] == 503 and res[2], res
    assert all(results[q][0] == "ok" for i, q in enumerate(questions) if i % 2 == 0)
    # Ray Serve replaces the replica; both report again, the new one with another process.
    after = _wait(lambda: (lambda x: x if len(x) == 2 and all(int(m["pid"]) != int(busy["pid"]) for m in x.values())
                           else None)(_per_replica("text")), 600, "the replica's replacement")
    assert busy["replica"] not in after
    # The survivor leaked nothing: idle, no session holds pages.
    m = _wait(lambda: (lambda x: x if all(x[("active_streams", r)] == 0 for r in after) else None)(
        _metrics(base, "")), 120, "idle replicas")
    for r in after:
        assert m[("kv_pages_sessions", r)] == 0
        assert m[("kv_pages_free", r)] + m[("kv_pages_cache", r)] == m[("kv_pages_total", r)]
    # and the service answers again on both
    r = retrying.chat.completions.create(model="m", messages=[{"role": "user", "content": questions[0]}],
                                         temperature=0, max_tokens=40)
    assert r.choices[0].message.content == want[questions[0]]


def test_a_stream_whose_replica_dies_ends_with_a_retryable_error(text_app):
    base = text_app["base"]
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    raw = oai.chat.completions.with_streaming_response.create(
        model="m", messages=[{"role": "user", "content": "Count from 1 to 200, one number a line."}],
        temperature=0, max_tokens=400, stream=True)
    with raw as resp:
        home = resp.headers["x-dasllama-replica"]
        chunks = resp.iter_lines()
        first = next(ln for ln in chunks if ln.startswith("data:"))  # the stream is running
        assert '"choices"' in first
        victim = _per_replica("text")[home]
        os.kill(int(victim["pid"]), signal.SIGKILL)
        rest = [ln for ln in chunks if ln.startswith("data:")]
    import json

    last = json.loads(rest[-1][len("data:"):])
    assert last["error"]["code"] == "replica_unavailable" and "retry" in last["error"]["message"]
    _wait(lambda: (lambda x: x if len(x) == 2 and home not in x else None)(_per_replica("text")), 600,
          "the replica's replacement")


def test_scale_down_drains_the_leaving_replica(text_app, smollm2_path):
    """Down to one replica while requests run: the leaving replica finishes what it has (no client retries)."""
    base, model, oai = text_app["base"], text_app["model"], text_app["oai"]
    questions = [f"List {i + 3} animals that live in the sea." for i in range(4)]
    want = {q: reference(model, [{"role": "user", "content": q}], 32) for q in questions}
    results = {}

    def ask(q):
        try:
            r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], temperature=0,
                                            max_tokens=32)
            results[q] = r.choices[0].message.content
        except Exception as e:  # noqa: BLE001 - recorded, fails below
            results[q] = repr(e)

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    # (if the machine is quick enough to finish them first, the drain below has nothing to wait for)
    _wait(lambda: sum(m["active_streams"] for m in _per_replica("text").values()) >= 1 or len(results) == 4,
          300, "requests running")
    serve.run(build_app(smollm2_path, replicas=1, replica_cpus=0.5, streams=2, ctx=1024, n_threads=1,
                        stats_period_s=0.5, health_check_period_s=2.0),
              name="text", route_prefix="/text")
    for t in threads:
        t.join(timeout=900)
    assert results == want
    _wait(lambda: len(_per_replica("text")) == 1, 120, "one replica left on the board")
    assert _metrics(base, "")["replicas"] == 1


# ---- audio: a resent clip runs no second encode --------------------------------------------------------------

def _wav(samples):
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def audio_app(cluster, tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
    import audio as A
    from speech import speak

    tmp = tmp_path_factory.mktemp("ray_audio")
    hf = A.qwen2_audio()
    mm = A.write_qwen2_audio(hf, tmp / "mmproj.gguf")
    dec = A.write_decoder(hf, tmp / "decoder.gguf")
    serve.run(build_app(str(dec), replicas=2, replica_cpus=0.5, mmproj=str(mm), streams=2, ctx=2048,
                        kv_dtype=d.KVDtype.f32, n_threads=1, stats_period_s=0.5),
              name="audio", route_prefix="/audio")
    base = f"{cluster}/audio"
    yield {"base": base, "clip": speak("Hello there, how are you today?"), "mmproj": str(mm), "decoder": str(dec),
           "oai": openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)}
    serve.delete("audio")


def test_a_resent_clip_runs_no_second_encode(audio_app):
    import soundfile as sf

    oai, base, clip = audio_app["oai"], audio_app["base"], audio_app["clip"]
    wav = _wav(clip)
    # The library's own audio chat on the clip as the WAV round trip gives it.
    # The replicas load the file as create_app does (the default quant mode); so does the reference.
    model = d.load_model(audio_app["decoder"], n_threads=1)
    pcm, _ = sf.read(io.BytesIO(base64.b64decode(wav)), dtype="float32")
    ch = d.create_chat(model, d.load_audio_tower(audio_app["mmproj"]), max_new=8, kv_dtype=d.KVDtype.f32)
    d.add_user_audio(ch, pcm, "What is said?")
    want = d.respond(model, ch, d.SamplingParams())

    msgs = [_clip_msg(wav, "What is said?")]
    raw = oai.chat.completions.with_raw_response.create(model="m", messages=msgs, temperature=0, max_tokens=8)
    r1 = raw.parse()
    assert r1.choices[0].message.content == want
    enc = _metrics(base, "")["audio_encodes_total"]
    assert enc >= 1
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "Say it again."}]
    raw2 = oai.chat.completions.with_raw_response.create(model="m", messages=msgs, temperature=0, max_tokens=8)
    r2 = raw2.parse()
    assert raw2.headers["x-dasllama-replica"] == raw.headers["x-dasllama-replica"]
    assert _metrics(base, "")["audio_encodes_total"] == enc
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    # The second turn against one plain server given the same requests (the client sends back the reply's
    # text, so a random model's invalid UTF-8 makes this prompt differ from the library chat's own history).
    from starlette.testclient import TestClient

    from dasllama.server import create_app

    app = create_app(audio_app["decoder"], mmproj=audio_app["mmproj"], n_threads=1, streams=2, ctx=2048, kv_dtype=d.KVDtype.f32)
    try:
        with TestClient(app) as c:
            one = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0)
            # the same two requests, so its second turn attaches its first from the cache as the replica's did
            assert one.chat.completions.create(model="m", messages=msgs[:1], temperature=0,
                                               max_tokens=8).choices[0].message.content == want
            single = one.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=8)
    finally:
        app.state.engine.stop()
    assert r2.choices[0].message.content == single.choices[0].message.content
