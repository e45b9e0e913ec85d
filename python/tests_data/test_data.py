"""diffcp.data (issue #71): conversations -> the target's chat template, loss masks, regeneration.

Runs in a venv with transformers, tokenizers and jinja2 from PyPI (no torch: tests/project/data_check.sh).
The tokenizer is built here: a word-level vocabulary (every word and every other character a token),
the special tokens of a Qwen-style chat format, and a Jinja chat template written like Qwen3's: the
last answer after the last user turn carries its think block (empty with enable_thinking false),
earlier answers are rendered without it. The target is a deterministic function of the conversation,
answered in process and by a stub OpenAI server on loopback that this test starts.
"""
from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from diffcp import data  # noqa: E402

SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]
TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}")
WORDS = ("you are a helpful assistant what is two plus three five and four nine thanks welcome the sum think add "
         "user system echo answer turn hi ok").split()


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {w: i for i, w in enumerate(SPECIAL + ["[UNK]"] + WORDS + [c for c in chars if c not in WORDS])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[a-z]+|[^a-z]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIAL)
    fast.chat_template = TEMPLATE
    return fast


def conv(*turns, cid="c"):
    msgs = []
    for role, content, *reasoning in turns:
        m = {"role": role, "content": content}
        if reasoning:
            m["reasoning_content"] = reasoning[0]
        msgs.append(m)
    return data.Conversation(cid, msgs)


def expected(tok, pieces):
    """Pieces (text, in the loss?) -> (ids, mask), tokenized piece by piece (the word-level split makes
    the pieces' tokens the whole's)."""
    ids, mask = [], []
    for text, m in pieces:
        got = tok(text, add_special_tokens=False)["input_ids"]
        ids += got
        mask += [int(m)] * len(got)
    return ids, mask


MULTI = conv(("system", "you are a helpful assistant"), ("user", "what is two plus three"),
             ("assistant", "five", "two add three"), ("user", "and four plus five"),
             ("assistant", "nine", "four add five"))


def test_multi_turn_masks_every_answer(tok):
    # loss "all": the first answer as the template renders it once later turns follow (no think block)
    # and the last one with its reasoning; each with its end-of-turn marker.
    s = data.tokenize_conversation(tok, MULTI, "all", "keep")
    ids, mask = expected(tok, [
        ("<|im_start|>system\nyou are a helpful assistant<|im_end|>\n<|im_start|>user\nwhat is two plus three<|im_end|>\n"
         "<|im_start|>assistant\n", 0), ("five<|im_end|>\n", 1),
        ("<|im_start|>user\nand four plus five<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nfour add five\n</think>\n\nnine<|im_end|>\n", 1)])
    assert s.input_ids == ids and s.loss_mask == mask


def test_last_turn_only_and_reasoning_masked(tok):
    s = data.tokenize_conversation(tok, MULTI, "last", "mask")
    ids, mask = expected(tok, [
        ("<|im_start|>system\nyou are a helpful assistant<|im_end|>\n<|im_start|>user\nwhat is two plus three<|im_end|>\n"
         "<|im_start|>assistant\nfive<|im_end|>\n<|im_start|>user\nand four plus five<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nfour add five\n</think>", 0), ("\n\nnine<|im_end|>\n", 1)])
    assert s.input_ids == ids and s.loss_mask == mask


def test_thinking_off_passes_through_the_template(tok):
    # enable_thinking false: the template's empty think block is the generation prompt's, so the loss is
    # the answer alone; with thinking on, the (empty) block is the answer's.
    one = conv(("user", "hi"), ("assistant", "ok"))
    off = data.tokenize_conversation(tok, one, "all", "keep", {"enable_thinking": False})
    ids, mask = expected(tok, [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
                               ("ok<|im_end|>\n", 1)])
    assert off.input_ids == ids and off.loss_mask == mask
    on = data.tokenize_conversation(tok, one, "all", "keep", {"enable_thinking": True})
    ids, mask = expected(tok, [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
                               ("<think>\n\n</think>\n\nok<|im_end|>\n", 1)])
    assert on.input_ids == ids and on.loss_mask == mask


def test_a_user_turn_equal_to_the_answer_is_not_taken_for_it(tok):
    # The span is placed where the answer is rendered, never searched for: "ok" said by the user first.
    same = conv(("user", "ok"), ("assistant", "ok"), ("user", "ok"), ("assistant", "ok"))
    s = data.tokenize_conversation(tok, same, "all", "keep", {"enable_thinking": False})
    ids, mask = expected(tok, [("<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", 0), ("ok<|im_end|>\n", 1),
                               ("<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
                               ("ok<|im_end|>\n", 1)])
    assert s.input_ids == ids and s.loss_mask == mask


def test_a_generated_think_block_becomes_reasoning():
    assert data.split_reasoning("<think>\nadd them\n</think>\n\nnine") == {
        "role": "assistant", "content": "nine", "reasoning_content": "add them"}
    assert data.split_reasoning("nine") == {"role": "assistant", "content": "nine"}


def test_sharegpt_and_openai_forms_read_alike(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"id": 7, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]})
                 + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "ok"}]}) + "\n")
    a, b = list(data.read_conversations(str(f)))
    assert a.id == "7" and b.id == "line-3" and a.messages == b.messages


@pytest.mark.parametrize("line,message", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown speaker 'robot'"),
    ({"messages": []}, "an empty conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"text": "hi"}, "neither 'messages'"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "the first message is an assistant turn"),
])
def test_bad_conversations_are_named(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                 + "\n" + json.dumps(line) + "\n")
    with pytest.raises(data.DataError, match=f"bad.jsonl:2: .*{message}"):
        list(data.read_conversations(str(f)))


def test_a_tokenizer_without_template_is_refused(tok):
    tok2 = tok.__class__(tokenizer_object=tok.backend_tokenizer, unk_token="[UNK]")
    with pytest.raises(data.DataError, match="no chat template"):
        data.tokenize_conversation(tok2, MULTI)


def test_length_split_and_drop(tok):
    s = data.tokenize_conversation(tok, MULTI, "all")
    n = len(s.input_ids)
    parts, why = data.fit_length(s, 30, 0, "split")
    # windows of 30: the first (system and user text) has no loss token and is dropped
    assert why == "split" and [p.id for p in parts] == [f"c#{k}" for k in range(1, -(-n // 30))]
    assert [p.input_ids for p in parts] == [s.input_ids[k * 30:(k + 1) * 30] for k in range(1, -(-n // 30))]
    assert data.fit_length(s, 30, 0, "drop") == ([], "longer than max_length")
    assert data.fit_length(s, 0, n + 1) == ([], "shorter than min_length")
    assert data.fit_length(s, n, n) == ([s], None)


# ---- regeneration: in process and over HTTP ----

def target(messages, kwargs) -> str:
    """The stand-in target: its answer is a function of the conversation so far (and the template's
    enable_thinking), so that every path gives the same text."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    before = sum(m["role"] == "assistant" for m in messages)
    return f"echo {users[-1]} turn {before}" + (" think" if kwargs.get("enable_thinking", True) else "")


class InProcess:
    def __init__(self, kwargs):
        self.kwargs = kwargs

    def answer(self, batch):
        return [{"role": "assistant", "content": target(m, self.kwargs)} for _, m in batch]


class Stub(http.server.BaseHTTPRequestHandler):
    fail_on = None      # a user text the server refuses (HTTP 400)
    truncate_on = None  # a user text whose answer is cut at max_tokens (finish_reason "length")
    block_after = None  # requests answered before the next ones wait for `release`
    served = 0
    release = threading.Event()
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions" and body["temperature"] == 0 and "seed" in body
        with Stub.lock:
            Stub.served += 1
            hold = Stub.block_after is not None and Stub.served > Stub.block_after
        if hold:
            Stub.release.wait(30)
        last = body["messages"][-1]["content"]
        if Stub.fail_on and last == Stub.fail_on:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"bad request")
            return
        reply = {"choices": [{"message": {"role": "assistant",
                                          "content": target(body["messages"], body.get("chat_template_kwargs", {}))},
                              "finish_reason": "length" if last == Stub.truncate_on else "stop"}]}
        out = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    Stub.release.set()
    srv.shutdown()
    srv.server_close()
    Stub.fail_on = Stub.truncate_on = Stub.block_after = None
    Stub.served = 0
    Stub.release.clear()


def conversations_file(path: Path, n: int = 6) -> Path:
    with open(path, "w") as f:
        for k in range(n):
            f.write(json.dumps({"id": f"s{k}", "conversations": [
                {"from": "system", "value": "be brief"}, {"from": "human", "value": f"q{k}"},
                {"from": "gpt", "value": "old"}, {"from": "human", "value": f"again {k}"},
                {"from": "gpt", "value": "old"}]}) + "\n")
    return path


def test_server_regeneration_equals_in_process(tmp_path, server):
    convs = conversations_file(tmp_path / "c.jsonl")
    kw = {"enable_thinking": False}
    s1 = data.regenerate(data.read_conversations(str(convs)), InProcess(kw), str(tmp_path / "a.jsonl"), batch=4)
    s2 = data.regenerate(data.read_conversations(str(convs)), data.ServerBackend(server, "stub", template_kwargs=kw),
                         str(tmp_path / "b.jsonl"), batch=4)
    assert s1.regenerated == s2.regenerated == 6 and not s1.skipped and not s2.skipped
    a, b = (tmp_path / "a.jsonl").read_text(), (tmp_path / "b.jsonl").read_text()
    assert a == b
    first = json.loads(a.splitlines()[0])["messages"]
    # every assistant turn answered again, the second seeing the first's new answer
    assert [m["content"] for m in first if m["role"] == "assistant"] == ["echo q0 turn 0", "echo again 0 turn 1"]
    last = data.regenerate(data.read_conversations(str(convs)), InProcess(kw), str(tmp_path / "l.jsonl"), turns="last")
    m = json.loads((tmp_path / "l.jsonl").read_text().splitlines()[0])["messages"]
    assert last.regenerated == 6 and [x["content"] for x in m if x["role"] == "assistant"] == ["old", "echo again 0 turn 1"]


def test_skips_are_counted_and_output_is_never_overwritten(tmp_path, server):
    # In one batch of 4: a refused request and a truncated answer skip their own conversations only.
    convs = conversations_file(tmp_path / "c.jsonl", 4)
    Stub.fail_on, Stub.truncate_on = "again 1", "q3"
    s = data.regenerate(data.read_conversations(str(convs)), data.ServerBackend(server + "/v1/chat/completions", "stub"),
                        str(tmp_path / "o.jsonl"), batch=4)
    assert s.regenerated == 2 and s.skipped == {"server error": 1, "truncated at max_tokens": 1}
    assert [json.loads(x)["id"] for x in (tmp_path / "o.jsonl").read_text().splitlines()] == ["s0", "s2"]
    with pytest.raises(data.DataError, match="exists: pass --resume"):
        data.regenerate(data.read_conversations(str(convs)), InProcess({}), str(tmp_path / "o.jsonl"))


def _cli(*args):
    env = dict(os.environ)
    return [sys.executable, "-m", "diffcp.data", *args], env


def test_a_killed_run_resumes_to_the_same_file(tmp_path, server):
    convs = conversations_file(tmp_path / "c.jsonl", 8)
    whole = tmp_path / "whole.jsonl"
    cmd, env = _cli("regenerate", str(convs), "--out", str(whole), "--model", "stub", "--server", server,
                    "--batch", "1", "--thinking", "off")
    assert subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).returncode == 0
    # The server answers 3 conversations (2 turns each), then holds the next request: the run is killed
    # there, with 3 lines written.
    Stub.served, Stub.block_after = 0, 6
    out = tmp_path / "killed.jsonl"
    cmd, env = _cli("regenerate", str(convs), "--out", str(out), "--model", "stub", "--server", server, "--batch", "1",
                    "--thinking", "off")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and Stub.served <= 6:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    assert len(out.read_text().splitlines()) == 3
    with open(out, "a") as f:  # a line cut mid-write by a crash is dropped and redone (even one that parses)
        f.write('{"id": "s7"}')
    Stub.block_after = None
    Stub.release.set()
    r = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "5 regenerated, 3 already done (resumed)" in r.stdout
    assert out.read_text() == whole.read_text()
    lines = out.read_text().splitlines()  # a damaged line before the end is refused, not truncated away
    out.write_text("\n".join(lines[:2] + ["not json"] + lines[2:]) + "\n")
    r = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "killed.jsonl:3: not a conversation this command wrote" in r.stderr


def test_cli_tokenize_and_errors(tmp_path, tok):
    folder = tmp_path / "tok"
    tok.save_pretrained(folder)
    convs = tmp_path / "c.jsonl"
    convs.write_text(json.dumps({"id": "m", "messages": MULTI.messages}) + "\n")
    out = tmp_path / "t.jsonl"
    cmd, env = _cli("tokenize", str(convs), "--out", str(out), "--tokenizer", str(folder), "--loss", "last",
                    "--reasoning", "mask")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())
    want = data.tokenize_conversation(tok, MULTI, "last", "mask")
    assert row["input_ids"] == want.input_ids and row["loss_mask"] == want.loss_mask and "1 samples" in r.stdout
    # A conversation the template cannot place (reasoning with thinking off: its answer does not follow the
    # generation prompt) is dropped and counted; the others are written.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"id": "r", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                     "content": "ok", "reasoning_content": "think"}]}) + "\n" +
                     json.dumps({"id": "p", "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "ok"}]}) + "\n")
    cmd, env = _cli("tokenize", str(mixed), "--out", str(out), "--tokenizer", str(folder), "--thinking", "off")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "1 samples" in r.stdout and "1 dropped by the template" in r.stdout, r.stdout
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["p"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "narrator", "content": "x"}]}\n')
    cmd, env = _cli("tokenize", str(bad), "--out", str(out), "--tokenizer", str(folder))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bad.jsonl:1: message 0: unknown role 'narrator'" in r.stderr
