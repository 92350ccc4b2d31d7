"""Load test of the server: aggregate tokens/s and latency percentiles per number of concurrent clients.

    python -m experiment.tools.loadtest [--checkpoint PATH] [--clients 1,8,32] [--tokens 256] [--requests 4]

Starts `python -m experiment.server` on the checkpoint (default: the newest run's best) in a process of
its own, so the clients' threads never hold the server's interpreter lock (or targets a running one
with --url). For each client count, that many clients each send --requests sampled completions of
exactly --tokens tokens to POST /generate (more where the count's total would fall short of
--min_requests), back to back on one keep-alive connection, all starting together. Per count: aggregate
tok/s (completion tokens of every request / wall time from the first send to the last answer) and p50/p95
of the per-request latency (send to last byte), each also as a ratio to the first count's. Any answer
other than 200, or a connection that fails (reset, closed), is counted as a failed request and makes
the exit status 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, help="model_*.pt or run directory (default: newest run's best)")
    parser.add_argument("--workspace", default=None, help="where to look for runs (default as in run.sh)")
    parser.add_argument("--url", default=None, help="load an already running server instead of starting one")
    parser.add_argument("--device", default="auto", help="the started server's --device")
    parser.add_argument("--dtype", default="auto", help="the started server's --dtype")
    parser.add_argument("--max_batch", type=int, default=None, help="the started server's --max_batch "
                        "(default: the largest client count, so every client is decoded at once)")
    parser.add_argument("--threads", type=int, default=0, help="the started server's --threads (0: its default)")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated concurrent client counts")
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per request")
    parser.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    parser.add_argument("--min_requests", type=int, default=16, help="at least this many requests per client count "
                        "(one client sends 16, not 4: its p95 is the baseline of the others')")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    parser.add_argument("--prompt", default="\n", help="the prompt of every request (the demo corpus's lines "
                        "start after a newline)")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ratio(value: float, base: float) -> str:
    """value / base as "1.5x", or " n/a" where the base is 0 or NaN (every base request failed)."""
    if not (math.isfinite(value) and math.isfinite(base)) or base == 0:
        return " n/a"
    return f"{value / base:4.1f}x"


def start_server(args, max_batch: int, log) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "experiment.server", "--port", "0", "--device", args.device, "--dtype", args.dtype,
           "--max_batch", str(max_batch), "--threads", str(args.threads)]
    for flag in ("checkpoint", "workspace"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()  # "serving <path> (...) at http://host:port/", or EOF when it failed
    if not line.startswith("serving "):
        proc.wait(timeout=60)
        raise RuntimeError(f"the server did not start (exit {proc.returncode})")
    return proc, line.rsplit(" at ", 1)[1].strip()


class Client:
    """One keep-alive connection sending completions one after another."""

    def __init__(self, host: str, port: int):
        self.conn = http.client.HTTPConnection(host, port, timeout=600)

    def complete(self, body: dict) -> tuple[int, int, float]:
        """(status, completion tokens, seconds from send to the last byte of the answer); status 0 when
        the connection failed (reset, closed, timed out, not HTTP): a failed request, not a failed run."""
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        try:
            self.conn.request("POST", "/generate", body=data, headers={"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            out = json.loads(resp.read())
        except (OSError, http.client.HTTPException, ValueError):
            self.conn.close()  # the next request reconnects
            return 0, 0, time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        if resp.status != 200 or resp.getheader("Connection", "").lower() == "close":
            self.conn.close()  # the server closes after an error; the next request reconnects
        return resp.status, out.get("tokens", 0) if resp.status == 200 else 0, seconds


def run_clients(host: str, port: int, n_clients: int, args, seed0: int) -> dict:
    start = threading.Barrier(n_clients + 1)
    per_client = max(args.requests, math.ceil(args.min_requests / n_clients))

    def client(c: int) -> list[tuple[int, int, float]]:
        conn = Client(host, port)
        start.wait()
        results = []
        try:
            for r in range(per_client):
                body = {"prompt": args.prompt, "max_tokens": args.tokens, "temperature": args.temperature,
                        "seed": seed0 + c * per_client + r}
                results.append(conn.complete(body))
        finally:
            conn.conn.close()
        return results

    with ThreadPoolExecutor(max_workers=n_clients) as pool:
        futures = [pool.submit(client, c) for c in range(n_clients)]
        start.wait()
        t0 = time.perf_counter()
        results = [r for f in futures for r in f.result()]
        wall = time.perf_counter() - t0
    ok = [(tokens, seconds) for status, tokens, seconds in results if status == 200]
    latencies = [seconds for _, seconds in ok] or [math.nan]
    tokens = sum(t for t, _ in ok)
    return {"clients": n_clients, "requests": len(results), "failed": len(results) - len(ok), "tokens": tokens,
            "seconds": wall, "tok_per_s": tokens / wall, "p50_s": percentile(latencies, 50),
            "p95_s": percentile(latencies, 95)}


def main(args) -> int:
    try:
        counts = [int(c) for c in args.clients.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or args.tokens < 1 or args.requests < 1 or args.min_requests < 0:
        print("error: --clients needs positive integers (e.g. 1,8,32); --tokens and --requests >= 1", file=sys.stderr)
        return 2
    proc = None
    with tempfile.TemporaryFile("w+") as log:
        try:
            if args.url:
                url = args.url
            else:
                proc, url = start_server(args, args.max_batch or max(counts), log)
            host, port = urlsplit(url).hostname, urlsplit(url).port
            return _measure(host, port, counts, args)
        except (RuntimeError, OSError) as e:
            log.seek(0)
            print(f"error: {e}\n{log.read()[-3000:]}", file=sys.stderr)
            return 2
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)


def _measure(host: str, port: int, counts: list[int], args) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("GET", "/info")
    info = json.loads(conn.getresponse().read())
    conn.close()
    c = info["model_config"]
    batch = info.get("batching", {}).get("max_batch", "-")  # a server from before batching (--url) has none
    print(f"loadtest | {info['checkpoint']} | d{c['depth']} width {c['depth'] * c['aspect_ratio']} ctx "
          f"{c['max_seq_len']} | {info['num_params']:,} params | {info['device']} {info.get('dtype', '?')} | "
          f"max_batch {batch} | {args.tokens} tokens per request, temperature {args.temperature}, "
          f"{args.requests} requests per client, at least {args.min_requests} per count", flush=True)
    warm = Client(host, port)
    try:
        warm.complete({"prompt": args.prompt, "max_tokens": args.tokens, "seed": 0})
    finally:
        warm.conn.close()
    rows, failed = [], 0
    for i, n in enumerate(counts):
        r = run_clients(host, port, n, args, seed0=i * 1_000_000)
        base = rows[0] if rows else r
        rows.append(r)
        failed += r["failed"]
        print(f"loadtest | clients {n:3d} | {r['requests']:4d} requests ({r['failed']} failed) | {r['tokens']:7,d} "
              f"tokens in {r['seconds']:6.2f}s | {r['tok_per_s']:8,.1f} tok/s "
              f"({ratio(r['tok_per_s'], base['tok_per_s'])}) "
              f"| latency p50 {r['p50_s']:6.2f}s p95 {r['p95_s']:6.2f}s ({ratio(r['p95_s'], base['p95_s'])}) "
              f"| ratios vs {base['clients']} client(s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m experiment.tools.loadtest", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
