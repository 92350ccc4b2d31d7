"""Serve a checkpoint over HTTP (standard library only), many clients at once.

    python -m experiment.server [--checkpoint PATH] [--host 127.0.0.1] [--port 8000] [--device auto]
                                [--dtype auto] [--max_batch 32] [--max_queue 256] [--kv_cache_gib G]
                                [--threads 0] [--workspace DIR]

PATH is a model_*.pt or a run directory (its best checkpoint); by default the best checkpoint of the
most recently written run. The model is loaded once at start; no loadable model -> exit 2 with the
reason. Endpoints: GET /health, GET /info, POST /generate, POST /v1/completions, GET /v1/models,
GET / (a small page).

One engine thread decodes every running request together (experiment.engine.Batch): a request joins
the batch between decode steps, its prompt prefilled into its own KV-cache slot, and leaves at its
max_tokens, at a stop string or when its client goes away; each gets exactly the tokens it would get
alone. Requests beyond the batch wait in a bounded queue; beyond that they get 503 with Retry-After.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import torch

from experiment import checkpoint as ckpt
from experiment.config import opt, parse_flags
from experiment.dataloader import tokenizer_from_meta
from experiment.engine import Batch, KVSlots, prompt_ids
from experiment.files import default_workspace
from experiment.model import DTYPES
from experiment.pages import prompt_page, report_page
from experiment.servemem import auto_kv_cache_gib, served_line, serving_device

# Every request is bounded by these.
MAX_BODY_BYTES = 64 * 1024
MAX_NEW_TOKENS = 2048
MAX_TEMPERATURE = 5.0
MAX_STOP_CHARS = 256
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
QUEUE_WAIT_SECONDS = 120  # a request waiting longer for a batch slot gets 503 instead of hanging
SOCKET_TIMEOUT_SECONDS = 30  # a client that stalls mid-request loses its connection, no one else's
# listen() backlog: a burst of connections waits in the kernel until accepted instead of being reset
# (socketserver's default is 5; Linux caps it at net.core.somaxconn, 4096 since 5.4).
LISTEN_BACKLOG = 1024
RETRY_AFTER_SECONDS = 2  # told to clients turned away with 503
POLL_SECONDS = 0.25  # how often a waiting handler checks whether its client is still there
DEFAULTS = {"max_tokens": 256, "temperature": 0.8, "top_k": None, "top_p": None, "seed": None, "stop": None,
            "stream": False}
# /v1/completions: OpenAI's defaults, and its fields we accept only at the value that asks for nothing
# we lack (one choice, no echo, no logprobs, no penalties).
OPENAI_DEFAULTS = {"max_tokens": 16, "temperature": 1.0, "top_k": None, "top_p": None, "seed": None, "stop": None,
                   "stream": False}
OPENAI_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "presence_penalty": 0,
                  "frequency_penalty": 0, "logit_bias": {}, "suffix": None}


@dataclass
class ServeConfig:
    checkpoint: str | None = opt("model_*.pt, an export (best.pt) or a run directory (default: the newest run's best); "
                                 "several, separated by commas: an ensemble, decoded as one model from the mean of "
                                 "their next-token probabilities")
    host: str = opt("bind address; 0.0.0.0 exposes the server to the network", "127.0.0.1")
    port: int = opt("0 picks a free port", 8000)
    device: str = opt("where the model runs (mps: Apple silicon, where torch has it)", "auto",
                      choices=("auto", "cpu", "cuda", "mps"))
    dtype: str = opt("weights (and KV cache) dtype; auto: the checkpoint's own", "auto",
                      choices=("auto", *DTYPES))
    workspace: str | None = opt("where to look for runs (default as in run.sh)")
    max_batch: int = opt("requests decoded together (KV-cache slots, allocated at start)", 32)
    max_queue: int = opt("requests waiting for a slot; more get 503 with Retry-After", 256)
    kv_cache_gib: float | None = opt("KV-cache memory cap in GiB: the batch is the most slots that fit, at "
                                      "most max_batch (default: half the memory free once the model is loaded: "
                                      "available RAM on CPU and MPS, free GPU memory on CUDA)")
    threads: int = opt("torch CPU threads (0: 1 on CPU, where a decode step's ops are too small to split "
                        "across cores; torch's default with CUDA)", 0)


def parse_config(argv=None) -> ServeConfig:
    return parse_flags(ServeConfig, argv, "python -m experiment.server", __doc__.split("\n")[0])


class BadRequest(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class Overloaded(Exception):
    """No room for the request: 503 with Retry-After."""


class ClientGone(Exception):
    """The client closed its connection while its request waited or ran."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    max_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = False  # /v1/completions stream_options: a last chunk with the token counts


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _neutral(v, neutral) -> bool:
    if v is None:
        return True
    if isinstance(v, bool) or isinstance(neutral, bool):
        return v is neutral
    return v == neutral


class Job:
    """One request between its handler thread and the engine thread.

    The engine thread feeds it tokens (add); it turns them into text, ends at a stop string or at
    max_tokens, and puts events on `events` for the handler: ("text", piece) while streaming, then
    ("done", summary) or ("error", message). The handler sets `cancelled` when its client leaves.
    """

    def __init__(self, req: GenerateRequest, tok, ids: list[int], dropped: int, seed: int):
        self.req, self.tok, self.ids, self.dropped = req, tok, ids, dropped
        self.generator = torch.Generator().manual_seed(seed)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.out: list[int] = []
        self.emitted = 0
        # Hold back a tail that could be the start of a stop string.
        self.holdback = max(map(len, req.stop), default=1) - 1
        # Text is decoded per token only when something reads it before the end.
        self.watch = req.stream or bool(req.stop)

    def add(self, token: int) -> bool:
        """Takes the next token; True when the request is complete (its last event is put)."""
        self.out.append(token)
        if not self.watch:
            if len(self.out) < self.req.max_tokens:
                return False
            return self._finish(self.tok.decode(self.out), "length")
        text = self.tok.decode(self.out)
        cut = min((i for i in (text.find(s) for s in self.req.stop) if i >= 0), default=-1)
        if cut >= 0:
            return self._finish(text[:cut], "stop")
        if len(self.out) >= self.req.max_tokens:
            return self._finish(text, "length")
        safe = len(text) - self.holdback
        if self.req.stream and safe > self.emitted:
            self.events.put(("text", text[self.emitted : safe]))
            self.emitted = safe
        return False

    def _finish(self, text: str, reason: str) -> bool:
        if self.req.stream and len(text) > self.emitted:
            self.events.put(("text", text[self.emitted :]))
        self.events.put(("done", {"text": text, "tokens": len(self.out), "finish_reason": reason,
                                  "prompt_tokens": len(self.ids), "prompt_truncated": self.dropped > 0,
                                  "prompt_tokens_dropped": self.dropped}))
        return True


class Scheduler:
    """The engine thread: one Batch of at most `slots` requests, fed from a queue of at most
    `max_queue` waiting ones. Between decode steps it drops cancelled requests and lets waiting ones
    join (each prefilled alone into its slot); every step gives each running request one token."""

    def __init__(self, model, slots: int, max_queue: int, allowed_vocab: int):
        self.batch = Batch(model, slots, allowed_vocab)
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.idle = slots  # slots neither running nor promised to a job taken from the queue
        self.running: dict[int, Job] = {}  # Batch member id -> job; only the engine thread touches it
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes requests (False once closed, or if it died)."""
        return not self.closed and self.thread.is_alive()

    def submit(self, job: Job) -> None:
        with self.cond:
            if not self.alive:
                raise Overloaded("the model is not running (the server is shutting down or its engine "
                                 "stopped); retry later")
            # A request for which a slot is free is not waiting, even before the engine thread wakes.
            if len(self.waiting) >= self.max_queue + self.idle:
                raise Overloaded(f"{self.max_queue} requests are waiting for the model already; retry later")
            self.waiting.append(job)
            self.cond.notify()

    def withdraw(self, job: Job) -> bool:
        """Takes a job out of the queue; False if it has started (or ended) already."""
        with self.cond:
            try:
                self.waiting.remove(job)
                return True
            except ValueError:
                return False

    def load(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()

    def _run(self) -> None:
        message, joining = "the server is shutting down", []
        try:
            while True:
                with self.cond:
                    while not (self.closed or self.waiting or self.running):
                        self.cond.wait()
                    if self.closed:
                        break
                    joining = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.idle))]
                    self.idle -= len(joining)
                try:
                    self._advance(joining)
                except Exception:  # a bug costs the requests in flight, never the server
                    traceback.print_exc()
                    self._fail([*joining, *self.running.values()],
                               "internal error while generating (logged on the server)")
                joining = []
        except BaseException:  # the engine itself broke (threading prints why): no request may wait on it
            message = "the model's engine stopped (logged on the server)"
            raise
        finally:
            with self.cond:
                self.closed = True  # submit() turns new requests away from here on
                waiting = list(self.waiting)
                self.waiting.clear()
            self._fail([*joining, *waiting, *self.running.values()], message)

    def _advance(self, joining: list[Job]) -> None:
        for job in joining:
            if job.cancelled.is_set():
                self._release(1)
                continue
            r = job.req
            member, token = self.batch.join(job.ids, r.temperature, r.top_k, job.generator, r.top_p)
            self.running[member] = job
            self._deliver(member, token)
        for member in [m for m, job in self.running.items() if job.cancelled.is_set()]:
            self._leave(member)
        if self.running:
            for member, token in self.batch.step().items():
                self._deliver(member, token)

    def _deliver(self, member: int, token: int) -> None:
        if self.running[member].add(token):
            self._leave(member)

    def _leave(self, member: int) -> None:
        self.batch.leave(member)
        del self.running[member]
        self._release(1)

    def _release(self, n: int) -> None:
        with self.cond:
            self.idle += n

    def _fail(self, jobs, message: str) -> None:
        """Empties the batch, then ends the jobs with an error (a client that reads its error finds the
        slots already free); nothing here can raise (no cache moves)."""
        self.running.clear()
        self.batch.clear()
        with self.cond:
            self.idle = self.batch.free
        for job in jobs:
            job.events.put(("error", message))


def check_batching(max_batch, max_queue, kv_cache_gib) -> None:
    """ValueError unless max_batch >= 1, max_queue >= 0 and kv_cache_gib is None or finite and > 0."""
    if not _is_int(max_batch) or max_batch < 1:
        raise ValueError(f"--max_batch must be an integer >= 1, got {max_batch!r}")
    if not _is_int(max_queue) or max_queue < 0:
        raise ValueError(f"--max_queue must be an integer >= 0, got {max_queue!r}")
    if kv_cache_gib is not None and not (_is_number(kv_cache_gib) and kv_cache_gib > 0):
        raise ValueError(f"--kv_cache_gib must be a finite number > 0 (or left out), got {kv_cache_gib!r}")


class Engine:
    """The loaded model, its tokenizer, request validation and the scheduler that runs requests."""

    def __init__(self, model, meta: dict, path: Path, device: torch.device, max_batch: int = 32,
                 max_queue: int = 256, kv_cache_gib: float | None = None, kv_note: str = "",
                 members: list[tuple[dict, Path]] | None = None):
        """model: a GPT, or a list of them decoded as one (an ensemble: engine.Batch), whose (meta,
        path) are `members`, the first's also `meta`, `path`; kv_cache_gib: the KV cache's cap (None:
        max_batch slots, whatever they take); kv_note: how the cap was chosen, for the start line."""
        check_batching(max_batch, max_queue, kv_cache_gib)
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        self.model, self.meta, self.path, self.device, self.kv_note = self.models[0], meta, path, device, kv_note
        self.members = members or [(meta, path)]
        self.tok = tokenizer_from_meta(meta["tokenizer"])
        # what /v1/models lists: the run directory's name, which an export records (it travels alone);
        # an ensemble's members' names joined by "+"
        self.model_id = "+".join((m["train_config"].get("model_tag") if "exported_from" in m else None) or p.parent.name
                                 for m, p in self.members)
        self.created = int(path.stat().st_mtime) if path.exists() else int(time.time())
        self.slot_bytes = sum(KVSlots.bytes_per_slot(m.config, m.wte.weight.dtype) for m in self.models)
        slots = max_batch if kv_cache_gib is None else min(max_batch, int(kv_cache_gib * 2**30 // self.slot_bytes))
        if slots < 1:
            raise ValueError(f"--kv_cache_gib {kv_cache_gib} holds no KV-cache slot "
                             f"({self.slot_bytes / 2**20:.1f} MiB each for this model)")
        self.max_batch, self.max_queue = slots, max_queue
        self.scheduler = Scheduler(self.models, slots, max_queue, self.tok.n_real)

    def close(self) -> None:
        self.scheduler.close()

    def info(self) -> dict:
        m = self.meta
        tok = m["tokenizer"]
        return {
            "checkpoint": str(self.path), "step": m["step"], "val_loss": m["val_loss"],
            "report": "/report" if (self.path.parent / "report.md").is_file() else None,
            "tokens_seen": ckpt.run_state(m).tokens_seen, "model_config": m["model_config"],
            "num_params": sum(m.num_params() for m in self.models), "device": str(self.device),
            "ensemble": [{"checkpoint": str(p), "step": m["step"], "val_loss": m["val_loss"]} for m, p in self.members]
            if len(self.members) > 1 else None,
            "dtype": str(self.model.wte.weight.dtype).removeprefix("torch."), "model_id": self.model_id,
            "vocabulary": {"tokenizer": tok["tokenizer"], "encoding": tok["encoding"], "characters": tok["chars"],
                           "size": self.tok.n_real, "padded_size": tok["vocab_size"]},
            "limits": {"max_body_bytes": MAX_BODY_BYTES, "max_tokens": MAX_NEW_TOKENS,
                       "max_temperature": MAX_TEMPERATURE, "max_stop_chars": MAX_STOP_CHARS, "max_stops": MAX_STOPS},
            "batching": {"max_batch": self.max_batch, "max_queue": self.max_queue,
                         "kv_cache_bytes": self.max_batch * self.slot_bytes, **self.scheduler.load()},
        }

    def validate(self, body) -> GenerateRequest:
        """A POST /generate body."""
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        unknown = sorted(set(body) - set(DEFAULTS) - {"prompt"})
        if unknown:
            raise BadRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
        r = {**DEFAULTS, **body}
        if r["stop"] is not None and not isinstance(r["stop"], str):
            raise BadRequest(f"stop: null or a string of 1..{MAX_STOP_CHARS} characters", param="stop")
        return self._checked(r)

    def validate_openai(self, body) -> GenerateRequest:
        """A POST /v1/completions body: OpenAI's fields, our limits."""
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        known = set(OPENAI_DEFAULTS) | set(OPENAI_NEUTRAL) | {"model", "prompt", "user", "stream_options"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise BadRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
        if not isinstance(body.get("model"), str):
            raise BadRequest(f"model: required, a string (this server has {self.model_id!r})", param="model")
        if body["model"] != self.model_id:
            raise BadRequest(f"the model {body['model']!r} does not exist; this server has {self.model_id!r}",
                             HTTPStatus.NOT_FOUND, param="model", code="model_not_found")
        for name, neutral in OPENAI_NEUTRAL.items():
            if not _neutral(body.get(name), neutral):
                raise BadRequest(f"{name}: only {json.dumps(neutral)} (or null) is supported", param=name)
        if "user" in body and not isinstance(body["user"], str):
            raise BadRequest("user: a string", param="user")
        # null means the default, as OpenAI reads it
        r = {**OPENAI_DEFAULTS, **{k: v for k, v in body.items() if k in OPENAI_DEFAULTS and v is not None}}
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                    or not isinstance(options.get("include_usage", False), bool)):
            raise BadRequest('stream_options: null or {"include_usage": true|false}', param="stream_options")
        if options is not None and r["stream"] is not True:
            raise BadRequest("stream_options: only with stream true", param="stream_options")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # some clients always send a list; one prompt is one choice
        elif not isinstance(prompt, str):
            raise BadRequest("prompt: required, a string (or a list of one string; batches of prompts and "
                             "token arrays are not supported)", param="prompt")
        r["prompt"] = prompt
        stop = r["stop"]
        if isinstance(stop, list) and not 1 <= len(stop) <= MAX_STOPS:
            raise BadRequest(f"stop: null, a string, or a list of 1..{MAX_STOPS} strings", param="stop")
        if stop is not None and not isinstance(stop, (str, list)):
            raise BadRequest(f"stop: null, a string, or a list of 1..{MAX_STOPS} strings", param="stop")
        include_usage = bool(options and options.get("include_usage"))
        return dataclasses.replace(self._checked(r), include_usage=include_usage)

    def _checked(self, r: dict) -> GenerateRequest:
        """The checks both APIs share; r holds every field (defaults filled in), stop as str, list or None."""
        if not isinstance(r.get("prompt"), str):
            raise BadRequest("prompt: required, a string", param="prompt")
        if not _is_int(r["max_tokens"]) or not 1 <= r["max_tokens"] <= MAX_NEW_TOKENS:
            raise BadRequest(f"max_tokens: an integer in 1..{MAX_NEW_TOKENS}", param="max_tokens")
        if not _is_number(r["temperature"]) or not 0 <= r["temperature"] <= MAX_TEMPERATURE:
            raise BadRequest(f"temperature: a finite number in 0..{MAX_TEMPERATURE} (0 is greedy)", param="temperature")
        if r["top_k"] is not None and (not _is_int(r["top_k"]) or not 1 <= r["top_k"] <= self.tok.n_real):
            raise BadRequest(f"top_k: null or an integer in 1..{self.tok.n_real} (the vocabulary size)", param="top_k")
        if r["top_p"] is not None and (not _is_number(r["top_p"]) or not 0 < r["top_p"] <= 1):
            raise BadRequest("top_p: null or a number in (0, 1]", param="top_p")
        if r["seed"] is not None and (not _is_int(r["seed"]) or not 0 <= r["seed"] < 2**63):
            raise BadRequest("seed: null or an integer in 0..2^63-1", param="seed")
        stops = [] if r["stop"] is None else [r["stop"]] if isinstance(r["stop"], str) else r["stop"]
        if not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in stops):
            raise BadRequest(f"stop: each stop string 1..{MAX_STOP_CHARS} characters", param="stop")
        if not isinstance(r["stream"], bool):
            raise BadRequest("stream: true or false", param="stream")
        try:
            self.tok.encode(r["prompt"])
        except ValueError as e:
            raise BadRequest(f"prompt: {e}", param="prompt") from None
        top_p = None if r["top_p"] is None else float(r["top_p"])
        return GenerateRequest(r["prompt"], r["max_tokens"], r["temperature"], r["top_k"], top_p, r["seed"],
                               tuple(stops), r["stream"])

    def submit(self, req: GenerateRequest) -> Job:
        """Queues the request for the engine thread (Overloaded if the queue is full)."""
        ids, dropped = prompt_ids(self.tok, req.prompt, self.model.config.max_seq_len)
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        job = Job(req, self.tok, ids, dropped, seed)
        self.scheduler.submit(job)
        return job


# The run report the trainer writes beside the checkpoints (experiment/report.py), by route.
REPORT_FILES = {"/report": "report.md", "/loss.svg": "loss.svg"}
MAX_REPORT_BYTES = 4 * 2**20

GET_ROUTES = ("/", "/health", "/info", "/v1/models", *REPORT_FILES)
POST_ROUTES = ("/generate", "/v1/completions")


class Handler(BaseHTTPRequestHandler):
    engine: Engine  # set on the subclass made by make_server
    timeout = SOCKET_TIMEOUT_SECONDS
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes; with Nagle's algorithm the second waits for the client's
    # delayed ACK of the first (40 ms on Linux), longer than a 32-token completion takes.
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):  # one short line per request on stderr
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    @property
    def route(self) -> str:
        return urlsplit(getattr(self, "path", "")).path  # no path when the request line was unparsable

    @property
    def openai(self) -> bool:
        return self.route.startswith("/v1/")

    def _error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        """{"error": message} on our routes, OpenAI's {"error": {message, type, param, code}} under /v1/."""
        self.close_connection = True  # the request body may be unread: never reuse this connection
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == HTTPStatus.SERVICE_UNAVAILABLE else None
        if self.openai:
            kind = "invalid_request_error" if status < 500 else "server_error"
            body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
        else:
            body = {"error": message}
        self._json(status, body, headers)

    def send_error(self, code, message=None, explain=None):
        # The base class answers malformed requests (bad request line, huge headers, unknown
        # method) with HTML; our clients always get JSON, and an unknown method is a 405.
        self._error(405 if code == HTTPStatus.NOT_IMPLEMENTED else code, message or HTTPStatus(code).phrase)

    def do_GET(self):
        if self.route == "/health":
            m = self.engine.meta
            if self.engine.scheduler.alive:
                self._json(200, {"status": "ok", "step": m["step"], "val_loss": m["val_loss"]})
            else:  # the engine thread is gone: no request can be answered
                self._json(503, {"status": "error", "step": m["step"], "val_loss": m["val_loss"],
                                 "error": "the model's engine is not running (see the server's log)"},
                           {"Retry-After": str(RETRY_AFTER_SECONDS)})
        elif self.route == "/info":
            self._json(200, self.engine.info())
        elif self.route == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.engine.model_id, "object": "model",
                                                          "created": self.engine.created, "owned_by": "nanogpt"}]})
        elif self.route == "/":
            self._send(200, prompt_page(MAX_NEW_TOKENS, MAX_TEMPERATURE), "text/html; charset=utf-8")
        elif self.route in REPORT_FILES:
            self._report_file(REPORT_FILES[self.route])
        elif self.route in POST_ROUTES:
            self._error(405, f"method GET not allowed on {self.route}; use POST")
        else:
            self._error(404, f"no such path: {self.path[:100]}")

    def _report_file(self, name: str) -> None:
        """The served run's report (report.md as a page around loss.svg) or its picture, read now: a
        run that is still training keeps rewriting both."""
        path = self.engine.path.parent / name
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_REPORT_BYTES)
        except OSError:
            self._error(404, f"no {name} beside the served checkpoint ({path.parent}); the trainer writes it "
                             "into the run directory at every eval")
            return
        if name == "loss.svg":
            self._send(200, data, "image/svg+xml")
        else:
            self._send(200, report_page(data), "text/html; charset=utf-8")

    def do_POST(self):
        if self.route not in POST_ROUTES:
            status = 405 if self.route in GET_ROUTES else 404
            return self._error(status, f"POST {self.path[:100]}: use POST /generate or POST /v1/completions")
        try:
            body = self._read_json()
            req = self.engine.validate_openai(body) if self.openai else self.engine.validate(body)
            job = self.engine.submit(req)
        except BadRequest as e:
            return self._error(e.status, str(e), e.param, e.code)
        except Overloaded as e:
            return self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(e), code="overloaded")
        try:
            self._answer(job)
        except Overloaded as e:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(e), code="overloaded")
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception:  # a bug must cost one request, never the server
            traceback.print_exc()
            self._error(500, "internal error while generating (logged on the server)")
        finally:
            # Out of the queue at once (it no longer counts against --max_queue); a no-op once done; if
            # running, the engine drops it before its next step.
            self.engine.scheduler.withdraw(job)
            job.cancelled.set()

    def _answer(self, job: Job) -> None:
        events = self._events(job)
        kind, value = next(events)  # waits for a slot: Overloaded after QUEUE_WAIT_SECONDS
        if kind == "error":
            return self._error(500, value)
        if not job.req.stream:
            return self._json(200, self._completion(job, value) if self.openai else self._summary(value, text=True))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's end
        self.close_connection = True
        self.end_headers()
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        while True:
            if kind == "text":
                self._event(self._chunk(job, cid, created, value, None) if self.openai else {"text": value})
            elif kind == "done":
                if self.openai:
                    self._event(self._chunk(job, cid, created, "", value["finish_reason"]))
                    if job.req.include_usage:
                        self._event({**self._chunk(job, cid, created, "", None), "choices": [],
                                     "usage": self._usage(value)})
                    self._event("[DONE]")
                else:
                    self._event({"done": True, **self._summary(value, text=False)})
                return
            else:  # the engine failed mid-stream: say so in the stream's own format, then end it
                self._event({"error": {"message": value, "type": "server_error", "param": None, "code": None}}
                            if self.openai else {"error": value})
                return
            kind, value = next(events)

    def _events(self, job: Job):
        """The job's events as they come. While it waits, checks that the client is still there
        (ClientGone) and withdraws it after QUEUE_WAIT_SECONDS in the queue (Overloaded)."""
        deadline = time.monotonic() + QUEUE_WAIT_SECONDS
        while True:
            try:
                yield job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._client_gone():
                    raise ClientGone() from None
                if time.monotonic() > deadline and self.engine.scheduler.withdraw(job):
                    raise Overloaded(f"no batch slot became free within {QUEUE_WAIT_SECONDS} s; retry later") from None

    def _client_gone(self) -> bool:
        """True if the client closed its end: readable with nothing to read (pipelined bytes are not EOF)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _event(self, obj) -> None:
        """One server-sent event; a client that left raises BrokenPipeError/ConnectionResetError."""
        self.wfile.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    @staticmethod
    def _summary(done: dict, text: bool) -> dict:
        keys = ("text", "tokens", "finish_reason", "prompt_truncated", "prompt_tokens_dropped")
        return {k: done[k] for k in keys if text or k != "text"}

    @staticmethod
    def _usage(done: dict) -> dict:
        return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["tokens"],
                "total_tokens": done["prompt_tokens"] + done["tokens"]}

    def _chunk(self, job: Job, cid: str, created: int, text: str, finish_reason: str | None) -> dict:
        chunk = {"id": cid, "object": "text_completion", "created": created, "model": self.engine.model_id,
                 "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}
        return {**chunk, "usage": None} if job.req.include_usage else chunk

    def _completion(self, job: Job, done: dict) -> dict:
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.engine.model_id,
                "choices": [{"text": done["text"], "index": 0, "logprobs": None,
                             "finish_reason": done["finish_reason"]}],
                "usage": self._usage(done)}

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


class Server(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True  # a stuck client never keeps the process alive at shutdown


def make_server(engine: Engine, host: str, port: int) -> Server:
    handler = type("BoundHandler", (Handler,), {"engine": engine})
    return Server((host, port), handler)


def load_engine(cfg: ServeConfig) -> Engine:
    """The model on its device, with a KV cache of --kv_cache_gib, else of half the memory left free."""
    dev = serving_device(cfg.device)
    workspace = Path(cfg.workspace) if cfg.workspace else default_workspace()
    members = ckpt.load_serving(cfg.checkpoint, workspace, dev, dtype=None if cfg.dtype == "auto" else DTYPES[cfg.dtype])
    models = [m for m, _, _ in members]
    cap, note = cfg.kv_cache_gib, "capped by --kv_cache_gib"
    if cap is None:
        cap, note = auto_kv_cache_gib(dev, sum(KVSlots.bytes_per_slot(m.config, m.wte.weight.dtype) for m in models))
    return Engine(models if len(models) > 1 else models[0], members[0][1], members[0][2], dev, cfg.max_batch,
                  cfg.max_queue, cap, note, [(meta, path) for _, meta, path in members])


def main(argv=None) -> int:
    cfg = parse_config(argv)
    print(f"config {json.dumps(dataclasses.asdict(cfg))}", file=sys.stderr, flush=True)
    try:  # before the model loads: a bad number fails in a moment, not after minutes of loading
        check_batching(cfg.max_batch, cfg.max_queue, cfg.kv_cache_gib)
        if cfg.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {cfg.threads}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        threads = cfg.threads or (torch.get_num_threads() if serving_device(cfg.device).type != "cpu" else 1)
        torch.set_num_threads(threads)  # process-wide: set here, never by load_engine (tests share a process)
        engine = load_engine(cfg)
        server = make_server(engine, cfg.host, cfg.port)
    except (ckpt.CheckpointError, OSError, RuntimeError, KeyError, ValueError) as e:
        print(f"error: no model served: {e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    served = served_line(engine.members)
    print(f"batch | {engine.max_batch} slots x {engine.slot_bytes / 2**20:.1f} MiB KV cache "
          f"({str(engine.model.wte.weight.dtype).removeprefix('torch.')}), {engine.kv_note} | queue {engine.max_queue} | "
          f"threads {torch.get_num_threads()}", file=sys.stderr, flush=True)
    print(f"serving {served}{f' as one ensemble of {len(engine.members)}' if len(engine.members) > 1 else ''} "
          f"at http://{host}:{port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
