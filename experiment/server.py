"""Serve a checkpoint over HTTP (standard library only).

    python -m experiment.server [--checkpoint PATH] [--host 127.0.0.1] [--port 8000] [--device auto]

PATH is a model_*.pt or a run directory (its best checkpoint); by default the best checkpoint of the
most recently written run. The model is loaded once at start; no loadable model -> exit 2 with the
reason. Endpoints: GET /health, GET /info, POST /generate, GET / (a small page).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import torch

from experiment import checkpoint as ckpt
from experiment.dataloader import tokenizer_from_meta
from experiment.distributed import resolve_device
from experiment.files import default_workspace

# Every request is bounded by these.
MAX_BODY_BYTES = 64 * 1024
MAX_NEW_TOKENS = 2048
MAX_TEMPERATURE = 5.0
MAX_STOP_CHARS = 256
QUEUE_WAIT_SECONDS = 120  # a request waiting longer for the model gets 503 instead of hanging
SOCKET_TIMEOUT_SECONDS = 30  # a client that stalls mid-request loses its connection, no one else's
DEFAULTS = {"max_tokens": 256, "temperature": 0.8, "top_k": None, "seed": None, "stop": None, "stream": False}


class BadRequest(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    max_tokens: int
    temperature: float
    top_k: int | None
    seed: int | None
    stop: str | None
    stream: bool


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Engine:
    """The loaded model, its tokenizer and the lock that lets one generation run at a time."""

    def __init__(self, model, meta: dict, path: Path, device: torch.device):
        self.model, self.meta, self.path, self.device = model, meta, path, device
        self.tok = tokenizer_from_meta(meta["tokenizer"])
        self.lock = threading.Lock()

    def info(self) -> dict:
        m = self.meta
        tok = m["tokenizer"]
        return {
            "checkpoint": str(self.path), "step": m["step"], "val_loss": m["val_loss"],
            "tokens_seen": m["tokens_seen"], "model_config": m["model_config"],
            "num_params": self.model.num_params(), "device": str(self.device),
            "vocabulary": {"tokenizer": tok["tokenizer"], "encoding": tok["encoding"], "characters": tok["chars"],
                           "size": self.tok.n_real, "padded_size": tok["vocab_size"]},
            "limits": {"max_body_bytes": MAX_BODY_BYTES, "max_tokens": MAX_NEW_TOKENS,
                       "max_temperature": MAX_TEMPERATURE, "max_stop_chars": MAX_STOP_CHARS},
        }

    def validate(self, body: dict) -> GenerateRequest:
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        unknown = sorted(set(body) - set(DEFAULTS) - {"prompt"})
        if unknown:
            raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
        if "prompt" not in body or not isinstance(body["prompt"], str):
            raise BadRequest("prompt: required, a string")
        r = {**DEFAULTS, **body}
        if not _is_int(r["max_tokens"]) or not 1 <= r["max_tokens"] <= MAX_NEW_TOKENS:
            raise BadRequest(f"max_tokens: an integer in 1..{MAX_NEW_TOKENS}")
        t = r["temperature"]
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise BadRequest(f"temperature: a finite number in 0..{MAX_TEMPERATURE} (0 is greedy)")
        if r["top_k"] is not None and (not _is_int(r["top_k"]) or not 1 <= r["top_k"] <= self.tok.n_real):
            raise BadRequest(f"top_k: null or an integer in 1..{self.tok.n_real} (the vocabulary size)")
        if r["seed"] is not None and (not _is_int(r["seed"]) or not 0 <= r["seed"] < 2**63):
            raise BadRequest("seed: null or an integer in 0..2^63-1")
        if r["stop"] is not None and (not isinstance(r["stop"], str) or not 1 <= len(r["stop"]) <= MAX_STOP_CHARS):
            raise BadRequest(f"stop: null or a string of 1..{MAX_STOP_CHARS} characters")
        if not isinstance(r["stream"], bool):
            raise BadRequest("stream: true or false")
        try:
            self.tok.encode(r["prompt"])
        except ValueError as e:
            raise BadRequest(f"prompt: {e}") from None
        return GenerateRequest(**r)

    def generate(self, req: GenerateRequest):
        """Yields text pieces; its return value (StopIteration.value) is the response's summary.

        The caller holds self.lock for the whole iteration: one generation at a time on the model.
        """
        ctx = self.model.config.max_seq_len
        # Training windows start anywhere in the text, so a prompt is context enough; BOS (the start
        # of a document) only stands in for an empty prompt.
        ids = self.tok.encode(req.prompt) or [self.tok.bos_id]
        dropped = max(0, len(ids) - ctx)  # the model sees at most its context; cut from the left
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        out, emitted, finish = [], 0, "length"
        for token in self.model.generate(ids[dropped:], req.max_tokens, req.temperature, req.top_k,
                                         torch.Generator().manual_seed(seed), allowed_vocab=self.tok.n_real):
            out.append(token)
            text = self.tok.decode(out)
            if req.stop is not None and req.stop in text:
                text, finish = text[: text.index(req.stop)], "stop"
                break
            # Hold back a tail that could be the start of the stop string.
            safe = len(text) - (len(req.stop) - 1 if req.stop else 0)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        else:
            text = self.tok.decode(out)
        if len(text) > emitted:
            yield text[emitted:]
        return {"tokens": len(out), "finish_reason": finish, "prompt_truncated": dropped > 0,
                "prompt_tokens_dropped": dropped}


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>nanoGPT server</title>
<style>
 body{font-family:system-ui,sans-serif;max-width:52rem;margin:2rem auto;padding:0 1rem;color:#222}
 textarea{width:100%;height:7rem;font-family:monospace}
 label{margin-right:1rem} input[type=number]{width:5rem}
 pre{background:#f4f4f4;padding:1rem;white-space:pre-wrap;min-height:4rem}
 #meta{color:#666;font-size:.9rem} #error{color:#b00}
</style></head><body>
<h1>nanoGPT</h1>
<p id="meta">loading model info...</p>
<textarea id="prompt" placeholder="Prompt"></textarea>
<p><label>max tokens <input id="max_tokens" type="number" min="1" max="MAX_NEW" value="200"></label>
<label>temperature <input id="temperature" type="number" min="0" max="MAX_T" step="0.1" value="0.8"></label>
<label>top-k <input id="top_k" type="number" min="1" placeholder="off"></label>
<button id="generate">Generate</button></p>
<p id="error"></p>
<pre id="completion"></pre>
<script>
const $ = id => document.getElementById(id);
fetch('/info').then(r => r.json()).then(i => {
  const val = i.val_loss === null ? 'n/a' : i.val_loss.toFixed(4);
  $('meta').textContent = `step ${i.step} | val loss ${val} | ${i.num_params.toLocaleString()} params | ${i.checkpoint}`;
});
$('generate').onclick = async () => {
  $('error').textContent = ''; $('completion').textContent = '...';
  const body = {prompt: $('prompt').value, max_tokens: +$('max_tokens').value,
                temperature: +$('temperature').value, top_k: $('top_k').value ? +$('top_k').value : null};
  const r = await fetch('/generate', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                      body: JSON.stringify(body)});
  const j = await r.json();
  if (!r.ok) { $('error').textContent = j.error; $('completion').textContent = ''; return; }
  $('completion').textContent = j.text;
  $('completion').dataset.done = '1';
};
</script></body></html>
""".replace("MAX_NEW", str(MAX_NEW_TOKENS)).replace("MAX_T", str(MAX_TEMPERATURE))


class Handler(BaseHTTPRequestHandler):
    engine: Engine  # set on the subclass made by make_server
    timeout = SOCKET_TIMEOUT_SECONDS
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # one short line per request on stderr
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self.close_connection = True  # the request body may be unread: never reuse this connection
        self._json(status, {"error": message})

    def send_error(self, code, message=None, explain=None):
        # The base class answers malformed requests (bad request line, huge headers, unknown
        # method) with HTML; our clients always get JSON, and an unknown method is a 405.
        self._error(405 if code == HTTPStatus.NOT_IMPLEMENTED else code, message or HTTPStatus(code).phrase)

    @property
    def route(self) -> str:
        return urlsplit(self.path).path

    def do_GET(self):
        if self.route == "/health":
            self._json(200, {"status": "ok", "step": self.engine.meta["step"], "val_loss": self.engine.meta["val_loss"]})
        elif self.route == "/info":
            self._json(200, self.engine.info())
        elif self.route == "/":
            self._send(200, PAGE.encode(), "text/html; charset=utf-8")
        elif self.route == "/generate":
            self._error(405, "method GET not allowed on /generate; use POST")
        else:
            self._error(404, f"no such path: {self.path[:100]}")

    def do_POST(self):
        if self.route != "/generate":
            status = 405 if self.route in ("/", "/health", "/info") else 404
            return self._error(status, f"POST {self.path[:100]}: use POST /generate")
        try:
            req = self.engine.validate(self._read_json())
        except BadRequest as e:
            return self._error(e.status, str(e))
        if not self.engine.lock.acquire(timeout=QUEUE_WAIT_SECONDS):
            return self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the model is busy; try again")
        try:
            pieces = self.engine.generate(req)
            if req.stream:
                return self._stream(pieces)
            text = []
            while True:
                try:
                    text.append(next(pieces))
                except StopIteration as done:
                    return self._json(200, {"text": "".join(text), **done.value})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception:  # a bug must cost one request, never the server
            traceback.print_exc()
            self._error(500, "internal error while generating (logged on the server)")
        finally:
            self.engine.lock.release()

    def _stream(self, pieces) -> None:
        """Server-sent events: {"text": piece} per chunk, then {"done": true, ...summary}."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's end
        self.close_connection = True
        self.end_headers()
        try:
            while True:
                try:
                    event = {"text": next(pieces)}
                except StopIteration as done:
                    event = {"done": True, **done.value}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                if "done" in event:
                    return
        except (BrokenPipeError, ConnectionResetError):
            pieces.close()  # the client left: stop generating and release the model

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise BadRequest("Content-Length header required", HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            raise BadRequest(f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}",
                             HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not valid JSON: {e}") from None

    def _method_not_allowed(self):
        self._error(405, f"method {self.command} not allowed")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed


def make_server(engine: Engine, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"engine": engine})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True  # a stuck client never keeps the process alive at shutdown
    return server


def load_engine(checkpoint: str | None, workspace: Path, device: str) -> Engine:
    dev = resolve_device(device)
    path = ckpt.resolve_serving_checkpoint(checkpoint, workspace)
    model, meta = ckpt.load_model(path, dev)
    return Engine(model, meta, path, dev)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiment.server", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None, help="model_*.pt or a run directory (default: newest run's best)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes the server to the network")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--workspace", default=None, help="where to look for runs (default as in run.sh)")
    args = parser.parse_args(argv)
    workspace = Path(args.workspace) if args.workspace else default_workspace()
    try:
        engine = load_engine(args.checkpoint, workspace, args.device)
        server = make_server(engine, args.host, args.port)
    except (ckpt.CheckpointError, OSError, RuntimeError, KeyError, ValueError) as e:
        print(f"error: no model served: {e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    m = engine.meta
    val = "n/a (saved at a preemption, without an eval)" if m["val_loss"] is None else f"{m['val_loss']:.4f}"
    print(f"serving {engine.path} (step {m['step']}, val_loss {val}) at http://{host}:{port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
