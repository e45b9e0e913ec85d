#!/usr/bin/env python3
"""From a conversations file to a trained drafter's held-out tau, with diffcp.data (issue #71; not in CI:
needs torch >= 2.6 and transformers from PyPI). The command sequence of docs/data.md, on a tiny target:

1. target: tools/speculative_e2e.py's tiny Qwen3 (vocab 64, trained briefly on repeated motifs), saved
   with a character-level tokenizer of 63 tokens (the motifs' ids; id 63 is the drafter's mask token)
   and a Qwen-style chat template (<|im_start|> / <|im_end|>, think blocks), no hub;
2. conversations: ShareGPT JSONL, two user turns each with a placeholder answer;
3. ``python -m diffcp.data regenerate`` in process (batched, left-padded, greedy) and, beside it, the
   same through ``--server`` against an OpenAI-compatible stub on loopback that serves the same
   target one conversation at a time: the two files must be equal;
4. ``python -m diffcp.data tokenize`` (the template, every assistant turn in the loss);
5. ``tools/extract_shards.py --token-jsonl``: the target's hidden states -> shards;
6. ``mpirun -np 2 diffcp train --data`` prints the held-out tau.

  PYTHONPATH=build/release/python V/bin/python tools/data_e2e.py --diffcp build/release/src/diffcp [--out bench/data_e2e.txt]

Exit 0 when every step ran, the server's regeneration equals the in-process one and tau was printed.
"""
import argparse
import http.server
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from speculative_e2e import train_target  # noqa: E402

SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!") + list("ABCDEFGHIJKLMNOP")
TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def tokenizer():
    """63 tokens: the special ones, then one per character (decode joins them: text round-trips)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    assert len(vocab) == 63
    t = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<|endoftext|>", additional_special_tokens=SPECIAL)
    tok.chat_template = TEMPLATE
    return tok


class Serve(http.server.BaseHTTPRequestHandler):
    """/v1/chat/completions with the target, one conversation a request (greedy)."""
    backend = None

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        (a,) = Serve.backend.answer([(0, body["messages"])])
        out = json.dumps({"choices": [{"message": a}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--diffcp", default="build/release/src/diffcp")
    ap.add_argument("--out", help="also write this report here")
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--heldout", type=int, default=24)
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--drafter-steps", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args()
    import torch
    import transformers
    from diffcp import data
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    work = tempfile.mkdtemp(prefix="diffcp_data_")
    log(f"data_e2e: torch {torch.__version__}, transformers {transformers.__version__}, work dir {work}")
    t0 = time.time()
    target = train_target(0, a.target_steps, lambda s: None)
    tok = tokenizer()
    target.save_pretrained(f"{work}/target")
    tok.save_pretrained(f"{work}/target")
    log(f"1. target trained ({a.target_steps} steps) and saved with its tokenizer and chat template: {time.time() - t0:.0f} s")

    rng = np.random.default_rng(1)
    words = ["boat", "sea", "red", "sky", "two", "cat", "map", "sun"]
    with open(f"{work}/conversations.jsonl", "w") as f:
        for k in range(a.conversations):
            q = lambda: " ".join(rng.choice(words, size=rng.integers(2, 5))) + "?"  # noqa: E731
            f.write(json.dumps({"id": f"c{k}", "conversations": [
                {"from": "system", "value": "be brief."}, {"from": "human", "value": q()}, {"from": "gpt", "value": "."},
                {"from": "human", "value": q()}, {"from": "gpt", "value": "."}]}) + "\n")
    log(f"2. {a.conversations} ShareGPT conversations, two user turns each")

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    py = [sys.executable, "-m", "diffcp.data"]
    t0 = time.time()
    # --keep-truncated: the tiny target has no end-of-turn habit (it ends an answer only when it happens
    # to emit <|im_end|>), so most answers run to --max-tokens
    r = subprocess.run(py + ["regenerate", f"{work}/conversations.jsonl", "--out", f"{work}/regen.jsonl", "--model",
                             f"{work}/target", "--max-tokens", str(a.max_tokens), "--batch", "8", "--keep-truncated"],
                       env=env, check=True, capture_output=True, text=True)
    in_process = r.stdout.strip()
    t_in = time.time() - t0
    Serve.backend = data.TransformersBackend(target, tok, a.max_tokens, keep_truncated=True)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    t0 = time.time()
    r = subprocess.run(py + ["regenerate", f"{work}/conversations.jsonl", "--out", f"{work}/regen_server.jsonl",
                             "--model", "target", "--server", f"http://127.0.0.1:{srv.server_address[1]}",
                             "--max-tokens", str(a.max_tokens), "--batch", "8", "--keep-truncated"], env=env,
                       check=True, capture_output=True, text=True)
    t_srv = time.time() - t0
    srv.shutdown()
    same = open(f"{work}/regen.jsonl").read() == open(f"{work}/regen_server.jsonl").read()
    first = json.loads(open(f"{work}/regen.jsonl").readline())["messages"]
    log(f"3. regenerated in process (batches of 8, left-padded, greedy: {t_in:.0f} s) and over HTTP (one a request: "
        f"{t_srv:.0f} s): {'equal' if same else 'DIFFERENT'}; in process: {in_process}; over HTTP: {r.stdout.strip()}")
    log(f"   e.g. {[m['content'] for m in first if m['role'] == 'assistant']}")

    r = subprocess.run(py + ["tokenize", f"{work}/regen.jsonl", "--out", f"{work}/tokens.jsonl", "--tokenizer",
                             f"{work}/target", "--loss", "all", "--max-length", "256"], env=env, check=True,
                       capture_output=True, text=True)
    log(f"4. {r.stdout.strip()}")
    r = subprocess.run([sys.executable, f"{HERE}/extract_shards.py", "--model", f"{work}/target", "--token-jsonl",
                        f"{work}/tokens.jsonl", "--out", f"{work}/shards", "--target-layers", "2", "--max-samples",
                        str(a.conversations), "--samples-per-shard", "64"], env=env, check=True, capture_output=True,
                       text=True)
    log("5. tools/extract_shards.py: " + " ".join(r.stdout.split("\n")[-3:]).strip())
    train = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", a.diffcp, "train", "--data", f"{work}/shards",
                            "--preset", "tiny", "--heldout", str(a.heldout), "--steps", str(a.drafter_steps),
                            "--no-progress", "--out", f"{work}/train"], env=env, check=True, capture_output=True, text=True)
    m = re.search(r"held-out acceptance length tau ([0-9.]+) \(against the ([^)]*)\)", train.stdout)
    log(f"6. diffcp train ({a.drafter_steps} steps, P = 2): " +
        (f"held-out tau {float(m.group(1)):.3f} (against the {m.group(2)})" if m else "no tau printed"))
    ok = same and m is not None
    log(f"data_e2e: {'passed' if ok else 'FAILED'}")
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines).replace(work, "WORK") + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
