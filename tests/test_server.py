"""Real HTTP on 127.0.0.1 against a tiny checkpoint trained by the real trainer."""

import http.client
import json
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

from conftest import REPO, TINY, run_train, write_corpus
from experiment import checkpoint as ckpt
from experiment.dataloader import demo_lines
from experiment.server import MAX_BODY_BYTES, MAX_NEW_TOKENS, load_engine, make_server


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("serve")
    run_train([*TINY, "--data_dir", write_corpus(ws), "--workspace", ws, "--max_steps", 30, "--total_batch_size", 256,
               "--max_seq_len", 64])
    return ws


@pytest.fixture(scope="module")
def server(workspace):
    engine = load_engine(None, workspace, "cpu")
    srv = make_server(engine, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield engine, srv.server_address[1]
    srv.shutdown()
    srv.server_close()


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
    # Health never waits behind the queue of generations (they run one at a time, for seconds).
    assert max(latencies) < 5.0


def test_client_leaving_mid_stream_stops_the_generation(server, monkeypatch):
    engine, port = server
    produced = []
    original = engine.generate

    def counting(req):
        pieces = original(req)
        while True:
            try:
                piece = next(pieces)
            except StopIteration as done:
                return done.value
            produced.append(piece)
            yield piece

    monkeypatch.setattr(engine, "generate", counting)
    body = json.dumps({"prompt": "1+", "max_tokens": MAX_NEW_TOKENS, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:  # the headers may come in a packet of their own
            received += s.recv(4096)
    code, out = request(port, "POST", "/generate", {"prompt": "1+", "max_tokens": 3})  # waits for the lock
    assert code == 200 and out["tokens"] == 3
    assert len(produced) < MAX_NEW_TOKENS // 2  # abandoned soon after the client left, not run to the end


def test_cli_fails_fast_without_a_model_and_serves_with_one(tmp_path, workspace):
    cmd = [sys.executable, "-m", "experiment.server", "--port", "0"]
    proc = subprocess.run([*cmd, "--workspace", tmp_path], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
    proc = subprocess.run([*cmd, "--checkpoint", tmp_path / "model_000001.pt"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "no such checkpoint file" in proc.stderr
    srv = subprocess.Popen([*cmd, "--checkpoint", workspace / "checkpoints/d2"], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = srv.stdout.readline()
        assert line.startswith("serving ") and "127.0.0.1" in line
        port = int(line.rsplit(":", 1)[1].strip(" /\n"))
        assert request(port, "GET", "/health")[0] == 200
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


def test_page_answers_a_prompt_in_a_real_browser(server, tmp_path):
    if not shutil.which("chromedriver") or not (shutil.which("chromium") or os.path.exists("/usr/bin/chromium")):
        pytest.skip("Chromium/ChromeDriver not installed (Debian: apt-get install chromium chromium-driver; "
                    ".ci/run does this where apt-get works)")
    engine, port = server
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
    finally:
        if browser is not None:
            browser.quit()
        driver.terminate()
        driver.wait(timeout=30)
    expected = request(port, "POST", "/generate", {"prompt": "12+34=", "max_tokens": 12, "temperature": 0})[1]
    assert shown == expected["text"].strip() or shown == expected["text"]
    assert f"step {engine.meta['step']}" in meta and "val loss" in meta


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
