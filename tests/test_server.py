"""Real HTTP on 127.0.0.1 against a tiny checkpoint trained by the real trainer."""

import contextlib
import http.client
import json
import re
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import REPO
from experiment import checkpoint as ckpt
from experiment import server as server_module
from experiment import servemem
from experiment.dataloader import demo_lines
from experiment.engine import generate
from experiment.server import MAX_BODY_BYTES, MAX_NEW_TOKENS, ServeConfig, load_engine, make_server


@pytest.fixture(scope="module")
def server(workspace):
    with serving(workspace, max_batch=4) as served:
        yield served


@contextlib.contextmanager
def serving(workspace, **config):
    """(engine, port) of an in-process server on a free port, torn down after."""
    engine = load_engine(ServeConfig(workspace=str(workspace), device="cpu", **config))
    srv = make_server(engine, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield engine, srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()
        engine.close()


def request(port, method, path, body=None, raw: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers=headers or {})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, (json.loads(text) if ctype.startswith("application/json") else text)


def test_health_and_info_describe_the_best_checkpoint(server, workspace):
    engine, port = server
    best = json.loads((workspace / "checkpoints/d2/best.json").read_text())
    status, health = request(port, "GET", "/health")
    assert status == 200 and health == {"status": "ok", "step": best["step"], "val_loss": best["val_loss"]}
    status, info = request(port, "GET", "/info")
    assert status == 200 and info["checkpoint"] == str(ckpt.model_path(workspace / "checkpoints/d2", best["step"]))
    assert info["model_config"]["depth"] == 2 and set(info["vocabulary"]["characters"]) >= set("0123456789+=\n")
    assert info["limits"]["max_tokens"] == MAX_NEW_TOKENS


def test_page_is_self_contained(server):
    status, page = request(server[1], "GET", "/")
    assert status == 200 and 'id="generate"' in page and 'id="prompt"' in page
    assert "http://" not in page and "https://" not in page  # no external assets


def test_greedy_generation_equals_the_naive_path(server):
    engine, port = server
    prompt = "12+34=5\n7+"
    status, out = request(port, "POST", "/generate", {"prompt": prompt, "max_tokens": 40, "temperature": 0})
    assert status == 200 and out["finish_reason"] == "length" and out["tokens"] == 40
    naive = engine.model.generate(engine.tok.encode(prompt), 40, temperature=0, use_cache=False,
                                  allowed_vocab=engine.tok.n_real)
    assert out["text"] == engine.tok.decode(list(naive))


def test_seed_reproduces_sampling_and_stop_ends_at_the_string(server):
    port = server[1]
    body = {"prompt": "5+5=", "max_tokens": 60, "temperature": 1.0, "top_k": 10, "seed": 42}
    a, b = (request(port, "POST", "/generate", body)[1] for _ in range(2))
    assert a == b
    c = request(port, "POST", "/generate", {**body, "seed": 43})[1]
    assert c["text"] != a["text"]
    assert "\n" in a["text"]  # the stop test below needs the string to occur
    s = request(port, "POST", "/generate", {**body, "stop": "\n"})[1]
    assert s["finish_reason"] == "stop" and s["text"] == a["text"][: a["text"].index("\n")]


def test_streaming_gives_the_same_text_as_one_response(server):
    port = server[1]
    body = {"prompt": "1+1=", "max_tokens": 30, "temperature": 0.7, "seed": 3, "stop": "+9"}
    whole = request(port, "POST", "/generate", body)[1]
    status, stream = request(port, "POST", "/generate", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1]["done"] and events[-1]["tokens"] == whole["tokens"]
    assert "".join(e.get("text", "") for e in events[:-1]) == whole["text"]


def test_long_prompt_is_cut_from_the_left_and_says_so(server):
    prompt = "".join(demo_lines(30))  # ~300 characters, context is 64
    out = request(server[1], "POST", "/generate", {"prompt": prompt, "max_tokens": 5, "temperature": 0})[1]
    assert out["prompt_truncated"] is True and out["prompt_tokens_dropped"] == len(prompt) - 64


@pytest.mark.parametrize("body,status,field", [
    ({"max_tokens": 5}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "1+", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "1+", "max_tokens": MAX_NEW_TOKENS + 1}, 400, "max_tokens"),
    ({"prompt": "1+", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "1+", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "1+", "temperature": -1}, 400, "temperature"),
    ({"prompt": "1+", "temperature": 1e9}, 400, "temperature"),
    ({"prompt": "1+", "top_k": 0}, 400, "top_k"),
    ({"prompt": "1+", "top_k": 100000}, 400, "top_k"),
    ({"prompt": "1+", "seed": -3}, 400, "seed"),
    ({"prompt": "1+", "stop": ""}, 400, "stop"),
    ({"prompt": "1+", "stream": "yes"}, 400, "stream"),
    ({"prompt": "1+", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "héllo"}, 400, "'hloé'"),  # the corpus has digits, '+', '=' and newline
    ([1, 2], 400, "JSON object"),
])
def test_bad_requests_get_a_4xx_naming_the_field(server, body, status, field):
    code, out = request(server[1], "POST", "/generate", body)
    assert code == status and field in out["error"]


def test_malformed_transport_gets_json_errors(server):
    port = server[1]
    assert request(port, "POST", "/generate", raw=b"{nope")[0] == 400
    assert request(port, "POST", "/generate", raw=b'{"prompt": NaN}')[0] == 400  # Python parses NaN; still not a string
    code, out = request(port, "POST", "/generate", raw=b"x" * (MAX_BODY_BYTES + 1))
    assert code == 413 and "exceeds" in out["error"]
    assert request(port, "GET", "/nope")[0] == 404
    assert request(port, "GET", "/generate")[0] == 405
    assert request(port, "POST", "/health", {"prompt": ""})[0] == 405
    code, out = request(port, "DELETE", "/info")
    assert code == 405 and "DELETE" in out["error"]
    code, out = request(port, "BREW", "/")
    assert code == 405 and "error" in out
    # A raw request with no Content-Length, and a garbage request line.
    # (http.server answers an unparsable request line the HTTP/0.9 way: body only, no status line.)
    for raw, expect in ((b"POST /generate HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 411"),
                        (b"\x16\x03\x01garbage\r\n\r\n", '{"error": "Bad request')):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(raw)
            chunks = []  # the server closes after an error; read it all, headers and body may come apart
            while chunk := s.recv(4096):
                chunks.append(chunk)
        reply = b"".join(chunks).decode(errors="replace")
        assert reply.startswith(expect) and '"error"' in reply
    assert request(port, "GET", "/health")[0] == 200  # still alive


def test_concurrent_clients_are_all_answered_while_health_stays_responsive(server):
    port = server[1]
    body = {"prompt": "3+4=", "max_tokens": 120, "temperature": 0.8}

    def health_latency():
        t0 = time.time()
        assert request(port, "GET", "/health")[0] == 200
        return time.time() - t0

    with ThreadPoolExecutor(max_workers=10) as pool:
        gens = [pool.submit(request, port, "POST", "/generate", {**body, "seed": i}) for i in range(6)]
        time.sleep(0.05)
        healths = [pool.submit(health_latency) for _ in range(4)]
        results = [g.result() for g in gens]
        latencies = [h.result() for h in healths]
    assert all(code == 200 and out["tokens"] == 120 for code, out in results)
    assert len({out["text"] for _, out in results}) > 1
    # Health never waits behind the generations (the engine thread runs them; handlers only wait).
    assert max(latencies) < 5.0


def submitted_jobs(engine, monkeypatch) -> list:
    """The Job of every request the engine accepts from now on."""
    jobs, original = [], engine.submit
    monkeypatch.setattr(engine, "submit", lambda req: jobs.append(original(req)) or jobs[-1])
    return jobs


def wait_until_idle(engine, timeout=30.0) -> None:
    deadline = time.time() + timeout
    while engine.scheduler.load() != {"running": 0, "waiting": 0}:
        assert time.time() < deadline, f"the engine is still busy: {engine.scheduler.load()}"
        time.sleep(0.02)


def raw_post(port, path, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return s


def first_event(s: socket.socket, timeout: float = 30.0) -> bytes:
    """What the server sent up to its stream's first event; fails on EOF or after `timeout` s."""
    deadline, received = time.time() + timeout, b""
    while b"data: " not in received:  # the headers may come in a packet of their own
        assert time.time() < deadline, f"no event within {timeout} s: {received[:300]!r}"
        chunk = s.recv(4096)
        assert chunk, f"the server closed the connection before the first event: {received[:300]!r}"
        received += chunk
    return received


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_stops_its_generation(server, monkeypatch, stream):
    engine, port = server
    jobs = submitted_jobs(engine, monkeypatch)
    with raw_post(port, "/generate", {"prompt": "1+", "max_tokens": MAX_NEW_TOKENS, "stream": stream}) as s:
        if stream:
            first_event(s)
        else:
            deadline = time.time() + 30
            while not jobs or not jobs[0].out:  # running: a non-streaming client leaves without a byte read
                assert time.time() < deadline, "the request never started"
                time.sleep(0.01)
    wait_until_idle(engine)
    assert len(jobs[0].out) < MAX_NEW_TOKENS // 2  # abandoned soon after the client left, not run to the end
    code, out = request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 3})
    assert code == 200 and out["tokens"] == 3


@pytest.mark.slow
def test_concurrent_requests_get_exactly_what_they_get_alone(server, monkeypatch):
    """More requests than batch slots, joining at different steps: each one's output equals serving it
    alone, token for token (greedy, seeded sampling with top_k / top_p, stop strings, context rebuilds)."""
    engine, port = server
    bodies = [{"prompt": p, "max_tokens": n, "temperature": t, "seed": i, **extra}
              for i, (p, n, t, extra) in enumerate([
                  ("12+34=", 40, 0, {}), ("5+5=", 70, 1.0, {"top_k": 10}), ("1+", 25, 0.8, {"stop": "\n"}),
                  ("", 30, 1.2, {}), ("7+8=15\n9+", 90, 0.9, {"top_p": 0.8}),  # 90 > context 64: a rebuild
                  ("3", 12, 0, {"stop": "+"}), ("44+", 55, 1.0, {"top_k": 3, "top_p": 0.95}), ("8+1=", 33, 0.5, {}),
              ])]
    alone = [request(port, "POST", "/generate", b)[1] for b in bodies]
    assert {a["finish_reason"] for a in alone} == {"length", "stop"}
    jobs = submitted_jobs(engine, monkeypatch)

    def late(i):  # staggered, so requests join a batch that is already decoding
        time.sleep(0.02 * i)
        return request(port, "POST", "/generate", bodies[i])[1]

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        together = list(pool.map(late, range(len(bodies))))
    assert together == alone
    assert max(len(j.out) for j in jobs) == 90 and engine.max_batch < len(bodies)


def test_greedy_batched_equals_generate_token_for_token(server):
    engine, port = server
    prompts = ["1+2=", "99+1=", "\n", "6+"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        outs = list(pool.map(lambda p: request(port, "POST", "/generate", {"prompt": p, "max_tokens": 80,
                                                                           "temperature": 0})[1], prompts))
    for p, out in zip(prompts, outs):
        alone = engine.model.generate(engine.tok.encode(p), 80, temperature=0, allowed_vocab=engine.tok.n_real)
        assert out["text"] == engine.tok.decode(list(alone))


def test_a_burst_of_64_clients_all_get_an_http_answer(workspace):
    """64 connections at the same instant against 2 slots and a queue of 4: every client gets an HTTP
    status (200, or 503 with Retry-After), never a refused or reset connection."""
    n = 64
    with serving(workspace, max_batch=2, max_queue=4) as (engine, port):
        barrier = threading.Barrier(n)

        def client(i):
            barrier.wait()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/generate", body=json.dumps({"prompt": "1+", "max_tokens": 4, "seed": i}))
            resp = conn.getresponse()
            out = resp.status, resp.getheader("Retry-After"), json.loads(resp.read())
            conn.close()
            return out

        with ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(pool.map(client, range(n)))  # a reset would raise here
    codes = [code for code, _, _ in answers]
    assert set(codes) <= {200, 503} and codes.count(200) >= 6  # at least the batch and the queue
    assert all(retry and int(retry) > 0 and "retry" in out["error"] for code, retry, out in answers if code == 503)
    assert all(out["tokens"] == 4 for code, _, out in answers if code == 200)


@pytest.mark.slow
def test_a_request_waiting_too_long_for_a_slot_gets_503(workspace, monkeypatch):
    monkeypatch.setattr(server_module, "QUEUE_WAIT_SECONDS", 0.5)
    with serving(workspace, max_batch=1) as (engine, port):
        with raw_post(port, "/generate", {"prompt": "1+", "max_tokens": MAX_NEW_TOKENS, "stream": True}) as s:
            first_event(s)  # the one slot is taken
            t0 = time.time()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/completions", body=json.dumps({"model": "d2", "prompt": "1+"}))
            resp = conn.getresponse()
            out = json.loads(resp.read())
            assert resp.status == 503 and resp.getheader("Retry-After") == "2" and time.time() - t0 >= 0.5
            assert out["error"]["type"] == "server_error" and out["error"]["code"] == "overloaded"
        wait_until_idle(engine)
        assert request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 3})[0] == 200


def test_a_queued_client_that_leaves_is_withdrawn_at_once(workspace):
    """A request whose client leaves while it waits stops counting against --max_queue right away,
    not when the engine reaches it."""
    with serving(workspace, max_batch=1, max_queue=1) as (engine, port):
        with raw_post(port, "/generate", {"prompt": "1+", "max_tokens": MAX_NEW_TOKENS, "stream": True}) as s:
            first_event(s)  # the one slot is taken for a long while
            with raw_post(port, "/generate", {"prompt": "1+", "max_tokens": 3}):
                deadline = time.time() + 30
                while engine.scheduler.load()["waiting"] != 1:
                    assert time.time() < deadline, engine.scheduler.load()
                    time.sleep(0.01)
            deadline = time.time() + 30
            while engine.scheduler.load()["waiting"]:  # withdrawn once its handler sees the client gone
                assert time.time() < deadline, "a request whose client left still waits in the queue"
                time.sleep(0.01)
            assert engine.scheduler.load() == {"running": 1, "waiting": 0}
        wait_until_idle(engine)
        assert request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 3})[0] == 200


def test_a_dead_engine_thread_shows_in_health_and_turns_requests_away(workspace, monkeypatch):
    class EngineBroke(BaseException):  # not an Exception: escapes the per-step handler, ends the thread
        pass

    def broken(joining):
        raise EngineBroke("injected")

    reported = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_type))
    with serving(workspace, max_batch=1) as (engine, port):
        monkeypatch.setattr(engine.scheduler, "_advance", broken)
        code, out = request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 3})
        assert code == 500 and "engine stopped" in out["error"]  # the request it held is answered
        engine.scheduler.thread.join(timeout=30)
        assert not engine.scheduler.thread.is_alive() and reported == [EngineBroke]
        code, health = request(port, "GET", "/health")
        assert code == 503 and health["status"] != "ok" and "engine" in health["error"]
        assert {"step", "val_loss"} <= set(health)
        code, out = request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 3})
        assert code == 503 and "not running" in out["error"]


@pytest.mark.slow
def test_batching_numbers_are_checked_where_the_engine_is_built(workspace):
    for config, name in [({"max_batch": 0}, "max_batch"), ({"max_queue": -1}, "max_queue"),
                         ({"kv_cache_gib": float("inf")}, "kv_cache_gib"), ({"kv_cache_gib": float("nan")}, "kv_cache_gib"),
                         ({"kv_cache_gib": 0.0}, "kv_cache_gib")]:
        with pytest.raises(ValueError, match=f"--{name} must be"):
            load_engine(ServeConfig(workspace=str(workspace), device="cpu", **config))
    for flags in (["--kv_cache_gib", "inf"], ["--kv_cache_gib", "nan"], ["--max_batch", "0"]):
        proc = subprocess.run([sys.executable, "-m", "experiment.server", "--port", "0", "--workspace", workspace,
                               *flags], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"{flags[0]} must be" in proc.stderr, (flags, proc.stderr[-500:])


def test_an_engine_failure_costs_the_requests_in_flight_not_the_server(server, monkeypatch):
    engine, port = server
    original = engine.scheduler.batch.step
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return original()

    monkeypatch.setattr(engine.scheduler.batch, "step", failing_once)
    code, out = request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 5})
    assert code == 500 and "internal error" in out["error"]
    assert engine.scheduler.batch.free == engine.max_batch  # its slot was given back
    code, out = request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 5})
    assert code == 200 and out["tokens"] == 5


def test_kv_cache_cap_sets_the_batch(workspace):
    slot = 2 * 2 * 2 * 64 * 32 * 4  # layers x (k, v) x heads x positions x head_dim x fp32 bytes
    with serving(workspace, max_batch=32, kv_cache_gib=2.5 * slot / 2**30) as (engine, port):
        info = request(port, "GET", "/info")[1]["batching"]
    assert engine.slot_bytes == slot and info["max_batch"] == 2 and info["kv_cache_bytes"] == 2 * slot
    with pytest.raises(ValueError, match="holds no KV-cache slot"):
        load_engine(ServeConfig(workspace=str(workspace), device="cpu", kv_cache_gib=1e-6))


@pytest.mark.slow
def test_the_kv_cache_is_sized_from_free_memory_by_default(workspace, monkeypatch):
    """Without --kv_cache_gib the batch is the slots that fit in half the memory free once the model
    is loaded (a d32 checkpoint's 32 slots would ask a laptop for 16 GiB at start), at most
    max_batch; memory for none is one error naming the memory, not an out-of-memory mid-request."""
    slot = 2 * 2 * 2 * 64 * 32 * 4
    monkeypatch.setattr(servemem, "free_bytes", lambda device: 7 * slot)  # half: 3.5 slots
    with serving(workspace, max_batch=32) as (engine, port):
        info = request(port, "GET", "/info")[1]["batching"]
    assert info["max_batch"] == 3 and info["kv_cache_bytes"] == 3 * slot
    assert engine.kv_note == f"sized to half of the {7 * slot / 2**30:.1f} GiB free on cpu (--kv_cache_gib sets it)"
    with serving(workspace, max_batch=2) as (engine, port):
        assert engine.max_batch == 2  # max_batch still caps it
    monkeypatch.setattr(servemem, "free_bytes", lambda device: 2 * slot)  # half holds exactly one
    with serving(workspace, max_batch=32) as (engine, port):
        assert engine.max_batch == 1
    monkeypatch.setattr(servemem, "free_bytes", lambda device: 2 * slot - 1)
    with pytest.raises(ValueError, match=r"half of the .* GiB free on cpu holds no KV-cache slot .* set --kv_cache_gib"):
        load_engine(ServeConfig(workspace=str(workspace), device="cpu"))
    # a machine that does not say (macOS has no /proc/meminfo nor sysconf's free pages): every slot, as before
    def unknown():
        raise ValueError("unrecognized configuration name")
    monkeypatch.undo()  # the real free_bytes, over a host that does not say
    monkeypatch.setattr(servemem, "host_available_bytes", unknown)
    with serving(workspace, max_batch=5) as (engine, port):
        assert engine.max_batch == 5 and "does not say how much memory is free" in engine.kv_note
    monkeypatch.undo()
    assert servemem.free_bytes(torch.device("cpu")) > 0  # the real count: the host's available memory


def test_free_memory_is_the_gpus_on_cuda_and_metals_on_mps(monkeypatch):
    """Read without the device (this machine has neither): the free figure each API gives."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (7_000, 80_000))  # (free, total)
    assert servemem.free_bytes(torch.device("cuda")) == 7_000
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12_000)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 5_000)
    assert servemem.free_bytes(torch.device("mps")) == 7_000


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_device_mps_where_there_is_none_exits_2_naming_it(workspace):
    proc = subprocess.run([sys.executable, "-m", "experiment.server", "--device", "mps", "--port", "0",
                           "--checkpoint", workspace / "checkpoints/d2"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "error: no model served: --device mps, but MPS is not available" in proc.stderr


@pytest.mark.slow
def test_several_checkpoints_are_served_as_one_ensemble(workspace, tmp_path):
    """--checkpoint A,B: one model id, both members in /info, a KV cache each, and sampled tokens from
    the mean of their probabilities: the run's fp32 best and a bf16 export of other weights, so the
    ensemble's tokens are engine.generate's over both, not either member's alone."""
    run = workspace / "checkpoints" / "d2"
    obj = torch.load(run / "best.pt", weights_only=True)
    gen = torch.Generator().manual_seed(0)
    obj["model"] = {k: v + (0.5 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype) if v.numel() > 1
                    else v for k, v in obj["model"].items()}
    torch.save(obj, tmp_path / "other.pt")
    with serving(workspace, checkpoint=str(run)) as (engine, port):
        single = engine.slot_bytes
        assert request(port, "GET", "/info")[1]["ensemble"] is None  # one model: no ensemble
    body = {"prompt": "1+", "max_tokens": 40, "temperature": 1.5, "seed": 4}
    with serving(workspace, checkpoint=f"{run},{tmp_path / 'other.pt'}") as (engine, port):
        info = request(port, "GET", "/info")[1]
        both = request(port, "POST", "/generate", body)[1]
        assert request(port, "GET", "/v1/models")[1]["data"][0]["id"] == "d2+d2"
        ids = engine.tok.encode("1+")
        expected = [list(generate(m, ids, 40, 1.5, generator=torch.Generator().manual_seed(4),
                                  allowed_vocab=engine.tok.n_real)) for m in (engine.models, *engine.models)]
    assert [m["step"] for m in info["ensemble"]] == [engine.meta["step"]] * 2 and len(engine.models) == 2
    assert engine.slot_bytes == single + single // 2  # a KV cache per member: fp32, then bf16
    assert both["text"] == engine.tok.decode(expected[0]) and both["tokens"] == 40
    assert expected[0] not in expected[1:]  # neither member alone


@pytest.mark.slow
def test_an_ensemble_of_two_tokenizers_exits_2_naming_both(workspace, tmp_path):
    export = workspace / "checkpoints" / "d2" / "best.pt"
    obj = torch.load(export, weights_only=True)
    obj["meta"]["tokenizer"]["chars"] = obj["meta"]["tokenizer"]["chars"][::-1]  # the same size, other ids
    torch.save(obj, tmp_path / "other.pt")
    proc = subprocess.run([sys.executable, "-m", "experiment.server", "--port", "0", "--checkpoint",
                           f"{export},{tmp_path / 'other.pt'}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "error: no model served: ensemble members need one tokenizer: " \
        f"{tmp_path / 'other.pt'} has char over" in proc.stderr, proc.stderr
    assert str(export) in proc.stderr


# ---------------------------------------------------------------- OpenAI-style API


def openai_post(port, body, path="/v1/completions"):
    """POST the way the openai client does: base_url .../v1, JSON body, bearer key, JSON or SSE back."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "application/json",
                                          "Authorization": "Bearer sk-unused", "User-Agent": "OpenAI/Python 1.0"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read().decode()
            if r.headers.get_content_type() == "text/event-stream":
                return r.status, [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
            return r.status, json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_models_and_completions(server):
    engine, port = server
    status, models = request(port, "GET", "/v1/models")
    assert status == 200 and models["object"] == "list"
    model = models["data"][0]["id"]
    assert model == "d2" and models["data"][0]["object"] == "model"
    body = {"model": model, "prompt": "5+5=", "max_tokens": 30, "temperature": 1.0, "top_p": 0.9, "seed": 7,
            "stop": ["\n\n", "+9"], "n": 1, "user": "test"}
    status, out = openai_post(port, body)
    assert status == 200 and out["object"] == "text_completion" and out["model"] == model
    assert out["id"].startswith("cmpl-") and isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["prompt_tokens"] == 4 and usage["total_tokens"] == 4 + usage["completion_tokens"]
    # The same request through /generate gives the same text (stop: the earliest of either string).
    native = request(port, "POST", "/generate", {"prompt": "5+5=", "max_tokens": 30, "temperature": 1.0,
                                                 "top_p": 0.9, "seed": 7})[1]["text"]
    cuts = [i for i in (native.find("\n\n"), native.find("+9")) if i >= 0]
    assert choice["text"] == (native[: min(cuts)] if cuts else native)
    # Streaming: chunks of the same text, the finish reason last, a usage chunk on request, then [DONE].
    status, events = openai_post(port, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == model for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    # Defaults: OpenAI's max_tokens 16. A list of one prompt is that prompt.
    status, out = openai_post(port, {"model": model, "prompt": "1+", "seed": 1})
    assert status == 200 and out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"
    assert openai_post(port, {"model": model, "prompt": ["1+"], "seed": 1})[1]["choices"] == out["choices"]


@pytest.mark.parametrize("body,status,param,code", [
    ({"model": "gpt-4", "prompt": "1+"}, 404, "model", "model_not_found"),
    ({"prompt": "1+"}, 400, "model", None),
    ({"model": "d2"}, 400, "prompt", None),
    ({"model": "d2", "prompt": ["1+", "2+"]}, 400, "prompt", None),
    ({"model": "d2", "prompt": "1+", "max_tokens": 0}, 400, "max_tokens", None),
    ({"model": "d2", "prompt": "1+", "temperature": 9}, 400, "temperature", None),
    ({"model": "d2", "prompt": "1+", "top_p": 0}, 400, "top_p", None),
    ({"model": "d2", "prompt": "1+", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"model": "d2", "prompt": "1+", "stop": [""]}, 400, "stop", None),
    ({"model": "d2", "prompt": "1+", "n": 2}, 400, "n", None),
    ({"model": "d2", "prompt": "1+", "logprobs": 3}, 400, "logprobs", None),
    ({"model": "d2", "prompt": "1+", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"model": "d2", "prompt": "1+", "frobnicate": 1}, 400, "frobnicate", None),
    ({"model": "d2", "prompt": "héllo"}, 400, "prompt", None),
])
def test_openai_errors_have_openai_shape(server, body, status, param, code):
    got, out = openai_post(server[1], body)
    err = out["error"]
    assert got == status and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert param in err["message"] or param == "model"


def test_openai_transport_errors_have_openai_shape(server):
    port = server[1]
    for method, path, raw, status in (("GET", "/v1/completions", None, 405), ("POST", "/v1/nope", b"{}", 404),
                                      ("POST", "/v1/completions", b"{nope", 400),
                                      ("POST", "/v1/models", b"{}", 405)):
        code, out = request(port, method, path, raw=raw)
        assert code == status and out["error"]["type"] == "invalid_request_error", (method, path)


@pytest.mark.slow
def test_cli_fails_fast_without_a_model_and_serves_with_one(tmp_path, workspace):
    cmd = [sys.executable, "-m", "experiment.server", "--port", "0"]
    proc = subprocess.run([*cmd, "--workspace", tmp_path], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
    proc = subprocess.run([*cmd, "--checkpoint", tmp_path / "model_000001.pt"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "no such checkpoint file" in proc.stderr
    err = (tmp_path / "stderr.txt").open("w")
    srv = subprocess.Popen([*cmd, "--checkpoint", workspace / "checkpoints/d2", "--dtype", "bf16", "--max_batch", "3"],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = srv.stdout.readline()
        assert line.startswith("serving ") and "127.0.0.1" in line
        assert re.search(r"/d2/model_000030.pt \(step 30, val_loss \d\.\d{4}\) at http", line) and " ensemble" not in line
        batch = next(x for x in (tmp_path / "stderr.txt").read_text().splitlines() if x.startswith("batch | "))
        assert batch.startswith("batch | 3 slots x ") and "sized to half of the" in batch and batch.endswith("threads 1")
        port = int(line.rsplit(":", 1)[1].strip(" /\n"))
        assert request(port, "GET", "/health")[0] == 200
        info = request(port, "GET", "/info")[1]
        assert info["dtype"] == "bfloat16" and info["batching"]["max_batch"] == 3  # the checkpoint is fp32
        code, out = request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 5, "seed": 0})
        assert code == 200 and out["tokens"] == 5
    finally:
        srv.terminate()
        srv.wait(timeout=30)


# ---------------------------------------------------------------- browser


class WebDriver:
    """The few W3C WebDriver calls the test needs, spoken to chromedriver over HTTP (stdlib only)."""

    ELEMENT = "element-6066-11e4-a52e-4f735466cecf"

    def __init__(self, port: int, profile_dir: str):
        self.base = f"http://127.0.0.1:{port}"
        caps = {"browserName": "chrome", "goog:chromeOptions": {
            "binary": shutil.which("chromium") or "/usr/bin/chromium",
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--no-first-run", f"--user-data-dir={profile_dir}"]}}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]

    def _call(self, method, path, body=None):
        req = urllib.request.Request(self.base + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["value"]

    def s(self, method, path, body=None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def find(self, css):
        return self.s("POST", "/element", {"using": "css selector", "value": css})[self.ELEMENT]

    def type(self, css, text):
        el = self.find(css)
        self.s("POST", f"/element/{el}/clear", {})
        self.s("POST", f"/element/{el}/value", {"text": text})

    def text(self, css):
        return self.s("GET", f"/element/{self.find(css)}/text")

    def quit(self):
        self._call("DELETE", f"/session/{self.session}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def chrome(tmp_path):
    """A WebDriver session with headless Chromium (skips the test where Chromium is not installed)."""
    if not shutil.which("chromedriver") or not (shutil.which("chromium") or os.path.exists("/usr/bin/chromium")):
        pytest.skip("Chromium/ChromeDriver not installed (Debian: apt-get install chromium chromium-driver; "
                    ".ci/run does this where apt-get works)")
    driver_port = _free_port()
    driver = subprocess.Popen(["chromedriver", f"--port={driver_port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    browser = None
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{driver_port}/status", timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        browser = WebDriver(driver_port, str(tmp_path / "profile"))
        yield browser
    finally:
        if browser is not None:
            browser.quit()
        driver.terminate()
        driver.wait(timeout=30)


def test_page_answers_a_prompt_in_a_real_browser(server, tmp_path):
    engine, port = server
    with chrome(tmp_path) as browser:
        browser.s("POST", "/url", {"url": f"http://127.0.0.1:{port}/"})
        browser.type("#prompt", "12+34=")
        browser.type("#max_tokens", "12")
        browser.type("#temperature", "0")
        browser.s("POST", f"/element/{browser.find('#generate')}/click", {})
        deadline = time.time() + 30
        while browser.s("POST", "/execute/sync", {"script": "return document.getElementById('completion')"
                                                  ".dataset.done || ''", "args": []}) != "1":
            assert time.time() < deadline, "the page never showed a completion"
            time.sleep(0.2)
        shown = browser.text("#completion")
        meta = browser.text("#meta")
    expected = request(port, "POST", "/generate", {"prompt": "12+34=", "max_tokens": 12, "temperature": 0})[1]
    assert shown == expected["text"].strip() or shown == expected["text"]
    assert f"step {engine.meta['step']}" in meta and "val loss" in meta


# Draws the report's loss picture into a canvas and counts its pixels: drawn (not white) and the
# val curve's blue.
COUNT_PIXELS = """
const img = document.getElementById('loss');
if (!img.complete || !img.naturalWidth) return null;
const c = document.createElement('canvas');
c.width = img.naturalWidth; c.height = img.naturalHeight;
const g = c.getContext('2d');
g.drawImage(img, 0, 0);
const d = g.getImageData(0, 0, c.width, c.height).data;
let drawn = 0, blue = 0;
for (let i = 0; i < d.length; i += 4) {
  if (d[i] < 235 || d[i + 1] < 235 || d[i + 2] < 235) drawn++;
  if (d[i + 2] > 150 && d[i] < 80 && d[i + 1] < 130) blue++;
}
return [c.width, c.height, drawn, blue];
"""


def test_the_run_report_renders_in_a_real_browser(server, workspace, tmp_path):
    engine, port = server
    assert request(port, "GET", "/info")[1]["report"] == "/report"
    status, svg = request(port, "GET", "/loss.svg")
    assert status == 200 and svg.startswith("<svg")
    with chrome(tmp_path) as browser:
        browser.s("POST", "/url", {"url": f"http://127.0.0.1:{port}/"})
        deadline = time.time() + 30
        while not browser.s("POST", "/execute/sync", {"script": "return !document.getElementById('report').hidden",
                                                      "args": []}):
            assert time.time() < deadline, "the page never showed the report link"
            time.sleep(0.2)
        browser.s("POST", f"/element/{browser.find('#report')}/click", {})
        deadline = time.time() + 30
        while (counts := browser.s("POST", "/execute/sync", {"script": COUNT_PIXELS, "args": []})) is None:
            assert time.time() < deadline, "the loss picture never loaded"
            time.sleep(0.2)
        text = browser.text("pre")
    width, height, drawn, blue = counts
    assert (width, height) == (980, 400)
    assert drawn > 0.02 * width * height and blue > 200, counts  # axes, labels, curves; the val curve
    assert text.startswith("# Run report: d2") and "## Evals" in text


@pytest.mark.slow
def test_serves_a_checkpoint_saved_at_a_preemption(tmp_path, workspace):
    # A preemption save skips the eval, so its meta holds val_loss null; it must still be servable.
    src = workspace / "checkpoints/d2"
    step = ckpt.complete_steps(src)[-1]
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ckpt.model_path(src, step), ckpt.model_path(run, step))
    meta = json.loads(ckpt.meta_path(src, step).read_text())
    ckpt.meta_path(run, step).write_text(json.dumps({**meta, "val_loss": None}))
    srv = subprocess.Popen([sys.executable, "-m", "experiment.server", "--port", "0", "--checkpoint", run], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = srv.stdout.readline()
        assert line.startswith("serving ") and "val_loss n/a" in line, srv.stderr.read() if not line else line
        port = int(line.rsplit(":", 1)[1].strip(" /\n"))
        assert request(port, "GET", "/health")[1]["val_loss"] is None
    finally:
        srv.terminate()
        srv.wait(timeout=30)
