"""The server's two HTML pages: the prompt page (/) and the run report around its loss picture
(/report). Plain text with placeholders; experiment/server.py serves them with its limits and the
run's report.md filled in."""

from __future__ import annotations

import html

PROMPT_PAGE = """<!doctype html>
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
<p><a id="report" href="/report" hidden>the run's report: loss curve, evals, samples</a></p>
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
  $('report').hidden = !i.report;
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
"""


REPORT_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>run report</title>
<style>body{font-family:system-ui,sans-serif;max-width:64rem;margin:2rem auto;padding:0 1rem}
img{max-width:100%} pre{white-space:pre-wrap}</style></head><body>
<p><a href="/">back to the prompt</a></p>
<img id="loss" src="/loss.svg" alt="train and val loss">
<pre>REPORT</pre>
</body></html>
"""


def prompt_page(max_new_tokens: int, max_temperature: float) -> bytes:
    """/: a prompt box, the sampling settings within the server's limits, the completion."""
    return PROMPT_PAGE.replace("MAX_NEW", str(max_new_tokens)).replace("MAX_T", str(max_temperature)).encode()


def report_page(report_md: bytes) -> bytes:
    """/report: the run's report.md, escaped, under its loss curve (/loss.svg)."""
    return REPORT_PAGE.replace("REPORT", html.escape(report_md.decode("utf-8", errors="replace"))).encode()
