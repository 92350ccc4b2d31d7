"""Bits per character on a text every member held out: what ranks models of different tokenizers
(a sweep across TOKENIZER or ALPHABET) on the same corpus.

A val loss is per token of the model's own tokenizer, and each prepared corpus cuts its val split by
its own token counts, so neither compares across tokenizers. Here the text is, per source, the
longest tail that every member's decoded val split shares (none of them trained on it); each member
scores it with its own tokenizer and context, document by document (each from its BOS), and its
summed loss in bits is divided by the text's characters.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np

DOC = "\x00"  # between documents in a source's val text; no corpus holds it (the data checks refuse NUL)


def text_key(prepared_meta: dict) -> str:
    """The corpus behind a prepared directory, whatever its tokenizer: each file's source and sha256,
    and the val fraction."""
    files = sorted((s["source"], s["sha256"]) for s in prepared_meta["sources"])
    return hashlib.sha256(json.dumps([files, prepared_meta["split"]["val_fraction"]]).encode()).hexdigest()[:16]


def val_texts(prepared) -> dict[str, str]:
    """Each source's val split decoded, its documents joined by DOC."""
    tok, val, bos = prepared.tokenizer(), prepared.tokens("val"), prepared.meta["bos_id"]
    out = {}
    for part in prepared.meta["source_splits"]:
        ids = np.asarray(val[part["val"][0]:part["val"][1]])
        cuts = np.flatnonzero(ids == bos)
        docs = np.split(ids, cuts)
        out[part["name"]] = DOC.join(tok.decode(d[1:] if len(d) and d[0] == bos else d) for d in docs)
    return out


def common_text(texts: list[dict[str, str]], max_chars: int) -> list[str]:
    """The documents of the longest tail each source's val text shares across members (its first
    document may be cut), at most max_chars characters in all, taken source by source."""
    docs, left = [], max_chars
    for name in texts[0]:
        tails = [t.get(name, "") for t in texts]
        shared = os.path.commonprefix([t[::-1] for t in tails])[::-1]
        for doc in shared.split(DOC):
            if doc and left > 0:
                docs.append(doc[:left])
                left -= len(docs[-1])
    return docs


def bits_per_char(model, tok, docs: list[str], stop=lambda: False) -> float:
    """The model's summed loss on `docs` in bits over their characters: each document from its BOS,
    in windows of the model's context."""
    import torch  # here: the sweep reads text_key without loading torch

    device, ctx = model.wte.weight.device, model.config.max_seq_len
    nats, chars = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor([tok.bos_id, *tok.encode(doc)], dtype=torch.long)
            for i in range(0, len(ids) - 1, ctx):
                if stop():
                    raise InterruptedError("a stop signal came while bits per character were scored")
                y = ids[i + 1:i + ctx + 1][None].to(device)
                logp = model(ids[i:i + y.shape[1]][None].to(device)).float().log_softmax(-1)
                nats -= logp.gather(-1, y[..., None]).sum().item()
            chars += len(doc)
    return nats / math.log(2) / max(chars, 1)
