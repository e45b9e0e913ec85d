"""Drafter training data from conversations (issue #71): read, regenerate with the target, tokenize.

A drafter learns the target's own answers, in the target's own chat format, so a data set is made in
three steps, each a subcommand of ``python -m diffcp.data`` (docs/data.md):

  regenerate  conversations JSONL -> the same conversations with their assistant turns answered again by
              the target: in process (transformers, batched, greedy or sampled with a seed) or by any
              server that speaks the OpenAI chat API (``--server URL``: vLLM, SGLang, ...). Each batch's
              conversations are appended (flushed, fsynced) as it ends, so a killed run resumes where it
              stopped (``--resume``), losing at most the batch in flight; a summary says what was
              regenerated, skipped and why.
  tokenize    conversations JSONL -> token JSONL, one ``{"id", "input_ids", "loss_mask"}`` a line: the
              target tokenizer's own chat template (``apply_chat_template``; template kwargs such as
              ``enable_thinking`` passed through), the loss on every assistant turn or the last only, the
              reasoning (``<think>...</think>``) kept in the loss or masked out, samples longer than
              ``--max-length`` split or dropped (counted), shorter than ``--min-length`` dropped.
  (then)      ``tools/extract_shards.py --token-jsonl`` runs the target over the token ids and writes the
              shards ``diffcp train --data`` reads.

Conversations are JSONL in either of the two forms trainers use, one conversation a line:
  ShareGPT  ``{"id": ..., "conversations": [{"from": "human" | "gpt" | "system", "value": "..."}]}``
  OpenAI    ``{"id": ..., "messages": [{"role": "user" | "assistant" | "system", "content": "...",
            "reasoning_content": "..."}]}`` (``reasoning_content`` optional: the thinking of an answer)
Both are read into OpenAI messages. Bad input (an unknown role, an empty conversation, one without an
assistant turn, a tokenizer without a chat template) is a :class:`DataError` naming the file and line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

__all__ = ["DataError", "Conversation", "read_conversations", "parse_conversation", "tokenize_conversation",
           "TokenizedSample", "fit_length", "ServerBackend", "TransformersBackend", "regenerate", "RegenerateSummary",
           "main"]

# ShareGPT's speaker names (the forms SpecForge's presets and ShareGPT dumps use) -> OpenAI roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """Bad input, named by its place (file:line) and what is wrong."""


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # OpenAI messages: {"role", "content"[, "reasoning_content"]}


def parse_conversation(obj, where: str) -> Conversation:
    """One JSON object in the ShareGPT or OpenAI form -> a Conversation (roles checked)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    cid = str(obj["id"]) if "id" in obj and obj["id"] is not None else "line-" + where.rsplit(":", 1)[-1]
    if "messages" in obj:
        turns = obj["messages"]
        if not isinstance(turns, list):
            raise DataError(f"{where}: 'messages' must be a list")
        messages = []
        for k, m in enumerate(turns):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                role = m.get("role") if isinstance(m, dict) else m
                raise DataError(f"{where}: message {k}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: message {k}: 'content' must be a string")
            msg = {"role": m["role"], "content": m["content"]}
            if m.get("reasoning_content"):
                msg["reasoning_content"] = str(m["reasoning_content"])
            messages.append(msg)
    elif "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list):
            raise DataError(f"{where}: 'conversations' must be a list")
        messages = []
        for k, m in enumerate(turns):
            who = m.get("from") if isinstance(m, dict) else None
            if who not in SHAREGPT_ROLES:
                raise DataError(f"{where}: turn {k}: unknown speaker {who!r} (expected one of "
                                f"{', '.join(sorted(SHAREGPT_ROLES))})")
            if not isinstance(m.get("value"), str):
                raise DataError(f"{where}: turn {k}: 'value' must be a string")
            messages.append({"role": SHAREGPT_ROLES[who], "content": m["value"]})
    else:
        raise DataError(f"{where}: neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
    if not messages:
        raise DataError(f"{where}: an empty conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn (nothing to train on)")
    if messages[0]["role"] == "assistant":
        raise DataError(f"{where}: the first message is an assistant turn (it answers nothing)")
    return Conversation(cid, messages)


def read_conversations(path: str) -> Iterator[Conversation]:
    """The conversations of a JSONL file, in order (blank lines skipped); ids must be unique."""
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg})") from None
            conv = parse_conversation(obj, where)
            if conv.id in seen:
                raise DataError(f"{where}: id {conv.id!r} repeats an earlier line's")
            seen.add(conv.id)
            yield conv


# ---- tokenize: the chat template, the loss mask, the length policy ----

@dataclass
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1: the drafter is trained to predict this token


def _render(tok, messages, template_kwargs, generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs)


def _visible(content: str, think_tags: tuple[str, str] = ("<think>", "</think>")) -> str:
    """An answer's text after its think block (as templates such as Qwen3's split it), stripped."""
    return content.split(think_tags[1])[-1].strip()


def split_reasoning(text: str, think_tags: tuple[str, str] = ("<think>", "</think>")) -> dict:
    """A generated answer -> an assistant message, its think block as reasoning_content."""
    if think_tags[1] not in text:
        return {"role": "assistant", "content": text}
    think, _, content = text.partition(think_tags[1])
    reasoning = think.split(think_tags[0], 1)[-1].strip("\n")
    out = {"role": "assistant", "content": content.lstrip("\n")}
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def tokenize_conversation(tok, conv: Conversation, loss: str = "all", reasoning: str = "keep",
                          template_kwargs: dict | None = None, think_tags: tuple[str, str] = ("<think>", "</think>")
                          ) -> TokenizedSample:
    """The conversation in the tokenizer's chat template, and its loss mask.

    Each assistant turn's span is what the template renders after the generation prompt of the turns
    before it (its answer and its end-of-turn marker), at that place in the whole rendering; the mask covers
    those spans' tokens: every turn's (loss "all") or the last's ("last"), with reasoning "mask" the
    ``<think>...</think>`` parts left out. tok: a transformers fast tokenizer (offsets) with a chat
    template."""
    if loss not in ("all", "last") or reasoning not in ("keep", "mask"):
        raise DataError(f"loss {loss!r} / reasoning {reasoning!r}: expected all|last and keep|mask")
    if not getattr(tok, "chat_template", None):
        raise DataError("the tokenizer has no chat template (tokenizer_config.json's chat_template): diffcp.data "
                        "formats conversations as the target does; give a tokenizer that has one")
    kw = dict(template_kwargs or {})
    msgs = conv.messages
    text = _render(tok, msgs, kw, False)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if loss == "last":
        turns = turns[-1:]
    spans = []
    for i in turns:
        # The turns before it render as a prefix of the whole (base); the generation prompt follows
        # there, then the turn's answer: what the template renders after the prompt, the turn last.
        base = _render(tok, msgs[:i], kw, False)
        before = _render(tok, msgs[:i], kw, True)
        through = _render(tok, msgs[:i + 1], kw, False)
        if not text.startswith(base) or not before.startswith(base) or not through.startswith(before):
            raise DataError(f"{conv.id}: assistant turn {i}: the template does not render the conversation's turns as "
                            "a prefix of the whole (the turns before this one, then its generation prompt, then it), "
                            "so the turn's span cannot be told")
        prompt, answer, at = before[len(base):], through[len(before):], len(base)
        if text.startswith(prompt + answer, at):
            at += len(prompt)
        else:
            # Templates such as Qwen3's render a turn that later turns follow without its think block:
            # its span is then its visible content and what follows it (the end-of-turn marker), right
            # after the turn's header (what the generation prompt and the rendering share).
            visible = _visible(msgs[i]["content"], think_tags)
            c = answer.rfind(visible) if visible else -1
            header = os.path.commonprefix([prompt, text[at:at + len(prompt)]])
            if c < 0 or not text.startswith(answer[c:], at + len(header)):
                raise DataError(f"{conv.id}: assistant turn {i} renders differently inside the conversation than as its "
                                "last turn, and its content is not where its header ends; train on the last turn "
                                "only (loss 'last')")
            answer, at = answer[c:], at + len(header)
        spans.append((at, at + len(answer)))
    masked: list[tuple[int, int]] = []
    if reasoning == "mask":
        open_tag, close_tag = think_tags
        for a, b in spans:
            s = text.find(open_tag, a, b)
            while s >= 0:
                e = text.find(close_tag, s, b)
                e = b if e < 0 else e + len(close_tag)
                masked.append((s, e))
                s = text.find(open_tag, e, b)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    mask = []
    for (s, e) in offsets:
        inside = any(a <= s < b for a, b in spans) and not any(a <= s < b for a, b in masked)
        mask.append(1 if inside and e > s else 0)
    return TokenizedSample(conv.id, ids, mask)


def fit_length(sample: TokenizedSample, max_length: int, min_length: int = 0, over: str = "split"
               ) -> tuple[list[TokenizedSample], str | None]:
    """The sample within the length bounds -> (samples kept, why not all of it: None when whole).

    over "split": consecutive windows of at most max_length tokens ("<id>#k"), those with a loss token
    kept; "drop": a longer sample is dropped. Samples (or windows) shorter than min_length are dropped."""
    n = len(sample.input_ids)
    if max_length and n > max_length:
        if over == "drop":
            return [], "longer than max_length"
        parts = []
        for k, s in enumerate(range(0, n, max_length)):
            part = TokenizedSample(f"{sample.id}#{k}", sample.input_ids[s:s + max_length], sample.loss_mask[s:s + max_length])
            if any(part.loss_mask) and len(part.input_ids) >= min_length:
                parts.append(part)
        return parts, "split"
    if n < min_length:
        return [], "shorter than min_length"
    if not any(sample.loss_mask):
        return [], "no loss token"
    return [sample], None


# ---- regenerate: the target answers again ----

class ServerBackend:
    """An OpenAI-compatible chat server (vLLM, SGLang, or anything speaking /v1/chat/completions).

    A batch's requests go out at once (one thread each). ``temperature`` 0: greedy; else sampled with
    ``seed`` (per conversation: seed + its index, so a resumed run draws as the first would).
    ``template_kwargs`` go as ``chat_template_kwargs`` (vLLM's and SGLang's extension, e.g.
    enable_thinking). A reply's ``reasoning_content`` (servers with a reasoning parser) is kept beside
    its content. An answer cut at max_tokens (finish_reason "length") is an error unless
    keep_truncated. Each item of the result is a message, or {"error": why}."""

    RETRIED = (408, 429)  # and every 5xx

    def __init__(self, url: str, model: str, max_tokens: int = 1024, temperature: float = 0.0, seed: int = 0,
                 template_kwargs: dict | None = None, api_key: str | None = None, timeout: float = 600.0,
                 tries: int = 3, keep_truncated: bool = False):
        self.url = url.rstrip("/")
        for tail in ("/chat/completions", "/v1"):
            if self.url.endswith(tail):
                self.url = self.url[:-len(tail)]
        self.url += "/v1/chat/completions"
        self.model, self.max_tokens, self.temperature, self.seed = model, max_tokens, temperature, seed
        self.template_kwargs, self.api_key, self.timeout, self.tries = template_kwargs or {}, api_key, timeout, tries
        self.keep_truncated = keep_truncated

    def answer(self, batch: Sequence[tuple[int, list[dict]]]) -> list[dict]:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=max(1, len(batch))) as pool:
            return list(pool.map(lambda item: self._one(*item), batch))

    def _one(self, index: int, messages: list[dict]) -> dict:
        import http.client
        import urllib.error
        import urllib.request
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed + index}
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps(body).encode(), headers)
        last = None
        for attempt in range(self.tries):
            if attempt:
                time.sleep(min(2.0 ** (attempt - 1), 10.0))
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    reply = json.loads(r.read())
                choice = reply["choices"][0]
                msg = choice["message"]
            except urllib.error.HTTPError as e:  # the server's answer: a 4xx but 408 / 429 is not retried
                last = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
                if e.code < 500 and e.code not in self.RETRIED:
                    return {"error": last}
                continue
            except (urllib.error.URLError, http.client.HTTPException, OSError, KeyError, IndexError, TypeError,
                    json.JSONDecodeError) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if choice.get("finish_reason") == "length" and not self.keep_truncated:
                return {"error": "truncated at max_tokens"}
            out = {"role": "assistant", "content": msg.get("content") or ""}
            if msg.get("reasoning_content"):
                out["reasoning_content"] = msg["reasoning_content"]
            elif "</think>" in out["content"]:
                out = split_reasoning(out["content"])
            return out
        return {"error": f"no answer after {self.tries} tries ({last})"}


class TransformersBackend:
    """In process: a transformers causal LM and its tokenizer, a batch of conversations at once
    (left-padded; the eos token pads where the tokenizer has no pad token), greedy (temperature 0) or
    sampled with a seed per batch (so a resumed run's batches draw differently). A think block in the
    answer becomes its reasoning_content; an answer that reaches max_tokens without the end-of-sequence
    token is an error unless keep_truncated."""

    def __init__(self, model, tokenizer, max_tokens: int = 1024, temperature: float = 0.0, seed: int = 0,
                 template_kwargs: dict | None = None, keep_truncated: bool = False):
        self.model, self.tok = model, tokenizer
        self.max_tokens, self.temperature, self.seed = max_tokens, temperature, seed
        self.template_kwargs, self.keep_truncated = template_kwargs or {}, keep_truncated
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token

    def answer(self, batch: Sequence[tuple[int, list[dict]]]) -> list[dict]:
        import torch
        prompts = [_render(self.tok, messages, self.template_kwargs, True) for _, messages in batch]
        side = self.tok.padding_side
        self.tok.padding_side = "left"
        try:
            enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            self.tok.padding_side = side
        enc = enc.to(self.model.device)
        kw = dict(max_new_tokens=self.max_tokens, do_sample=self.temperature > 0, pad_token_id=self.tok.pad_token_id)
        if self.temperature > 0:
            kw["temperature"] = self.temperature
            torch.manual_seed(self.seed + batch[0][0])
        with torch.no_grad():
            out = self.model.generate(**enc, **kw)
        new = out[:, enc["input_ids"].shape[1]:]
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]) | {self.tok.eos_token_id}
        answers = []
        for row in new.tolist():
            if len(row) >= self.max_tokens and not eos.intersection(row) and not self.keep_truncated:
                answers.append({"error": "truncated at max_tokens"})
            else:
                answers.append(split_reasoning(self.tok.decode(row, skip_special_tokens=True)))
        return answers


@dataclass
class RegenerateSummary:
    regenerated: int = 0
    resumed: int = 0  # finished by an earlier run (the output already holds them)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> conversations

    def line(self) -> str:
        why = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items())) or "none"
        return (f"regenerate: {self.regenerated} regenerated, {self.resumed} already done (resumed), "
                f"skipped: {why}")


def _done_ids(path: str) -> set[str]:
    """The ids a previous run finished; a last line cut by a crash is removed from the file."""
    if not os.path.exists(path):
        return set()
    done, good = set(), 0
    with open(path, "rb") as f:
        data = f.read()
    lines = data.splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        if not line.endswith(b"\n"):
            break  # the line a crash cut (only ever the last one: each line is written whole, then fsynced)
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise DataError(f"{path}:{n}: not a conversation this command wrote; the output to resume from is "
                            "damaged") from None
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def regenerate(conversations: Iterable[Conversation], backend, out_path: str, turns: str = "all", batch: int = 8,
               resume: bool = False, progress: Callable[[str], None] | None = None) -> RegenerateSummary:
    """Every conversation with its assistant turns answered by ``backend`` (turns "all": each in order,
    the later ones seeing the new earlier answers; "last": only the last, the conversation cut after
    it), appended to out_path (OpenAI form) one conversation at a time. resume: the ids already in
    out_path are not asked again; without it an existing out_path is an error (nothing is overwritten)."""
    if turns not in ("all", "last") or batch < 1:
        raise DataError(f"turns {turns!r}, batch {batch}: expected all or last, and a batch of at least 1")
    if os.path.exists(out_path) and os.path.getsize(out_path) and not resume:
        raise DataError(f"{out_path} exists: pass --resume to go on from it, or choose another output")
    done = _done_ids(out_path) if resume else set()
    summary = RegenerateSummary()
    pending: list[tuple[int, Conversation]] = []
    t0, total = time.time(), 0

    def flush(out) -> None:
        # conversations in lock-step: each round answers the next turn of every conversation in the batch
        state = []
        for index, conv in pending:
            msgs = conv.messages
            targets = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            if turns == "last":
                msgs, targets = msgs[:targets[-1] + 1], targets[-1:]
            state.append({"index": index, "conv": conv, "msgs": [dict(m) for m in msgs], "targets": targets, "k": 0})
        while True:
            ask = [s for s in state if s["k"] < len(s["targets"]) and "error" not in s]
            if not ask:
                break
            answers = backend.answer([(s["index"], s["msgs"][:s["targets"][s["k"]]]) for s in ask])
            for s, a in zip(ask, answers):
                if "error" in a:
                    s["error"] = a["error"]
                    continue
                if not a.get("content", "").strip():
                    s["error"] = "empty answer"
                    continue
                s["msgs"][s["targets"][s["k"]]] = a
                s["k"] += 1
        for s in state:
            if "error" in s:
                reason = s["error"] if s["error"] in ("empty answer", "truncated at max_tokens") else "server error"
                summary.skipped[reason] = summary.skipped.get(reason, 0) + 1
                if progress:
                    progress(f"regenerate: {s['conv'].id}: skipped ({s['error']})")
                continue
            out.write(json.dumps({"id": s["conv"].id, "messages": s["msgs"]}, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
            summary.regenerated += 1
        pending.clear()
        if progress:
            done_now = summary.regenerated + sum(summary.skipped.values())
            progress(f"regenerate: {done_now} of {total} asked ({summary.resumed} resumed), "
                     f"{time.time() - t0:.1f} s")

    with open(out_path, "a", encoding="utf-8") as out:
        for index, conv in enumerate(conversations):
            if conv.id in done:
                summary.resumed += 1
                continue
            total += 1
            pending.append((index, conv))
            if len(pending) == batch:
                flush(out)
        if pending:
            flush(out)
    return summary


# ---- the command ----

def _tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("diffcp.data needs transformers (pip install transformers) for the target's tokenizer") from None
    return AutoTokenizer.from_pretrained(path)


def _template_kwargs(items: Sequence[str], thinking: str | None) -> dict:
    kw = {}
    for item in items:
        if "=" not in item:
            raise DataError(f"--template-kwarg {item!r}: expected KEY=JSON_VALUE (e.g. enable_thinking=false)")
        k, v = item.split("=", 1)
        try:
            kw[k] = json.loads(v)
        except json.JSONDecodeError:
            kw[k] = v
    if thinking is not None:
        kw["enable_thinking"] = thinking == "on"
    return kw


def cmd_tokenize(a) -> int:
    tok = _tokenizer(a.tokenizer)
    kw = _template_kwargs(a.template_kwarg, a.thinking)
    if os.path.exists(a.out) and os.path.samefile(a.out, a.conversations):
        raise DataError(f"--out {a.out} is the input file")
    counts: dict[str, int] = {}
    lengths: list[int] = []
    with open(a.out, "w", encoding="utf-8") as out:
        for conv in read_conversations(a.conversations):
            try:
                sample = tokenize_conversation(tok, conv, a.loss, a.reasoning, kw)
            except DataError as e:  # this conversation's rendering: counted, the others go on
                print(f"tokenize: {conv.id}: dropped: {e}", file=sys.stderr)
                counts["dropped by the template"] = counts.get("dropped by the template", 0) + 1
                continue
            kept, why = fit_length(sample, a.max_length, a.min_length, a.over)
            if why:
                counts[why] = counts.get(why, 0) + 1
            for s in kept:
                out.write(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")
                lengths.append(len(s.input_ids))
    line = f"tokenize: {len(lengths)} samples -> {a.out}"
    if lengths:
        ls = sorted(lengths)
        line += f"; tokens min {ls[0]}, median {ls[len(ls) // 2]}, max {ls[-1]}, total {sum(ls)}"
    print(line + "; " + (", ".join(f"{n} {w}" for w, n in sorted(counts.items())) or "every sample whole"))
    return 0


def cmd_regenerate(a) -> int:
    kw = _template_kwargs(a.template_kwarg, a.thinking)
    if a.server:
        backend = ServerBackend(a.server, a.model, a.max_tokens, a.temperature, a.seed, kw,
                                os.environ.get("OPENAI_API_KEY"), keep_truncated=a.keep_truncated)
    else:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise DataError("in-process regeneration needs torch and transformers; or give --server URL") from None
        import torch
        tok = _tokenizer(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype="auto").eval()
        if torch.cuda.is_available():
            model = model.to("cuda")
        backend = TransformersBackend(model, tok, a.max_tokens, a.temperature, a.seed, kw, a.keep_truncated)
    s = regenerate(read_conversations(a.conversations), backend, a.out, a.turns, a.batch, a.resume,
                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(s.line())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffcp.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("regenerate", help="answer the assistant turns again with the target")
    r.add_argument("conversations", help="JSONL, ShareGPT or OpenAI form")
    r.add_argument("--out", required=True, help="JSONL of the regenerated conversations (OpenAI form)")
    r.add_argument("--model", required=True, help="the target: a transformers folder, or the server's model name")
    r.add_argument("--server", help="an OpenAI-compatible server's base URL (http://host:port[/v1]); else in process")
    r.add_argument("--turns", choices=["all", "last"], default="all")
    r.add_argument("--max-tokens", type=int, default=1024)
    r.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--resume", action="store_true", help="go on from an existing --out (its conversations kept)")
    r.add_argument("--keep-truncated", action="store_true",
                   help="keep answers cut at --max-tokens (skipped by default: the drafter would learn to stop there)")
    t = sub.add_parser("tokenize", help="the chat template and the loss masks: token JSONL for tools/extract_shards.py")
    t.add_argument("conversations")
    t.add_argument("--out", required=True)
    t.add_argument("--tokenizer", required=True, help="the target's folder (its tokenizer and chat template)")
    t.add_argument("--loss", choices=["all", "last"], default="all", help="every assistant turn, or the last")
    t.add_argument("--reasoning", choices=["keep", "mask"], default="keep", help="<think>...</think> in the loss or not")
    t.add_argument("--max-length", type=int, default=0, help="0: no bound")
    t.add_argument("--min-length", type=int, default=0, help="drop shorter samples (long-context sets)")
    t.add_argument("--over", choices=["split", "drop"], default="split", help="what happens to a longer sample")
    for p in (r, t):
        p.add_argument("--thinking", choices=["on", "off"], help="enable_thinking for templates that take it")
        p.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                       help="another chat-template argument (JSON value), repeatable")
    a = ap.parse_args(argv)
    try:
        return {"regenerate": cmd_regenerate, "tokenize": cmd_tokenize}[a.cmd](a)
    except (DataError, OSError) as e:
        print(f"diffcp.data {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
