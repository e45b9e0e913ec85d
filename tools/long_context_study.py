#!/usr/bin/env python3
"""Long-context drafters and the wall-clock speed-up of speculative decoding (issue #53, items 1
and 4; not in CI: needs torch >= 2.6 and transformers from PyPI, hours at full size; the defaults are
the reduced sizes that ran on a 2-core machine, see bench/long_context_study.txt).

1. target: a Qwen3ForCausalLM (transformers, random init, no hub: vocab 64, hidden 64, 6 layers)
   for a corpus whose documents repeat with a period of D tokens (--period): the first D tokens are
   i.i.d. random, every later token equals the one D back, so past D everything is predictable
   and only by looking D tokens back. The target is trained PoSE-style (positional skip): each
   sequence is three chunks of n tokens, A at a random position g (up to --target-max-pos), a
   random distractor chunk somewhere in between, and A again at g + D; the loss is on the
   repeat. So RoPE sees the offset D (and the offsets around and below it) at every absolute
   position while a step computes only 3n tokens. Its own next-token accuracy right after
   prompts of every length (dense, contiguous documents) is measured and reported.
   (A first corpus, a header of random motifs recalled by key tokens far later, needed an
   induction circuit that did not form in 1000 steps on this machine; see the report.)
2. drafter data: for each drafter training context C, --docs documents of exactly C tokens
   (+ --heldout), their target features (the target's hidden states of the drafter's layers, as
   tools/extract_shards.py picks them) and the target's greedy tokens, as `diffcp train` shards
   (loss mask everywhere). A drafter trained at C < D never sees a predictable token.
3. `mpirun -np 2 diffcp train --preset tiny --context C --balancer lpt` (Split-KV over 2 ranks;
   --context is the packing length: one document per micro-batch), `diffcp export`; with
   --archs dflash,dflash2 a DFlash and a DFlash2 (`--arch dflash2`) drafter per context, compared
   in the tau and speed tables (an `arch` column; DFlash2's candidate recall from its training log).
4. decoding: prompts = fresh documents cut at each prompt length; every drafter decodes every
   prompt with diffcp.speculative.generate (greedy), checked against the target's greedy
   generation (lossless) -> bench/long_context_tau.csv.
5. speed: tokens/s of diffcp.speculative.generate vs transformers' model.generate(do_sample=False)
   (its KV cache) on the same prompts, with the longest-trained drafter, at --speed-lengths; the
   target and draft time per block timed here by wrapping the target and the drafter (works with
   every build) -> bench/speculative_speed.csv. When diffcp.speculative.generate accepts
   temperature/top_p/top_k/seed (speculative sampling), a sampled row (temperature
   --temperature) is measured too, against model.generate(do_sample=True).

Run (from the repository root; Debian's mpi4py is needed by diffcp.Drafter.load; if the venv
lacks it, this script appends /usr/lib/python3/dist-packages to the END of sys.path, so the venv's
numpy still wins over Debian's):

  V/bin/pip install "torch>=2.6" transformers safetensors
  OMP_NUM_THREADS=1 PYTHONPATH=build/release/python taskset -c 1 V/bin/python tools/long_context_study.py \\
      --diffcp build/release/src/diffcp --work /tmp/lcs --out bench/long_context_study.txt
  V/bin/python bench/plot_speculative.py

Stages keep their outputs in --work and are skipped when present (rerun with the same --work to
resume; delete a stage's folder to redo it).
"""
import argparse
import csv
import inspect
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch

try:
    import mpi4py  # noqa: F401
except ImportError:  # Debian's python3-mpi4py, after the venv's packages (its numpy must not win)
    sys.path.append("/usr/lib/python3/dist-packages")

from safetensors.numpy import save_file  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import diffcp  # noqa: E402
import diffcp.speculative  # noqa: E402

V, MASK = 64, 63  # the tiny drafter preset's vocabulary and mask token (the corpus never uses 63)
HERE = os.path.dirname(os.path.abspath(__file__))


class Corpus:
    """Documents that repeat with a period of D tokens: the first D are i.i.d. random tokens
    (0..62), every later token equals the one D positions back. Past D, each token is predictable
    exactly, and only by looking D tokens back (nothing local predicts it)."""

    def __init__(self, period):
        self.D = period

    def document(self, rng, length):
        return np.resize(rng.integers(0, MASK, size=self.D), length).tolist()

    def prompt(self, rng, length, cont):
        doc = self.document(rng, length + cont)
        return doc[:length], doc[length:]


def make_target(args):
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=args.target_ffn,
                      num_hidden_layers=args.target_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=2 * args.target_max_pos, rope_theta=args.rope_theta,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # QK-norm gain: |q.k|/sqrt(d) <= d g^2 / sqrt(d); g = 1 caps the logits at 4 (d = 16),
        for layer in model.model.layers:  # too flat to pick one key among thousands
            layer.self_attn.q_norm.weight.fill_(args.qk_norm_init)
            layer.self_attn.k_norm.weight.fill_(args.qk_norm_init)
    return model


def pose_batch(rng, args, D, phase):
    """One batch of PoSE sequences (tokens, position ids, where the repeat B starts).
    Phase 1: chunk A at a random position g, one distractor chunk between, B = A at g + D.
    Phase 2: B at a random position b, A at b - D, --target-distractors chunks of n/2 tokens at
    random positions anywhere before B (offsets up to --target-max-pos: in phase 1 the offsets
    past D + n never occur, and a target trained on it alone could not copy in dense documents)."""
    n, xs, ps = args.target_chunk, [], []
    for _ in range(args.target_batch):
        A = rng.integers(0, MASK, size=n).tolist()
        if phase == 1:
            g = int(rng.integers(0, args.target_max_pos - D - n))
            u = int(rng.integers(n, D - n + 1))
            xs.append(A + rng.integers(0, MASK, size=n).tolist() + A)
            ps.append(list(range(g, g + n)) + list(range(g + u, g + u + n)) + list(range(g + D, g + D + n)))
            continue
        b = int(rng.integers(D, args.target_max_pos - n))
        chunks = [(b - D, A)]
        m = n // 2
        while len(chunks) < 1 + args.target_distractors:
            st = int(rng.integers(0, b - m))
            if all(st + m <= c or st >= c + len(t) for c, t in chunks):
                chunks.append((st, rng.integers(0, MASK, size=m).tolist()))
        chunks.sort()
        x, pos = [], []
        for st, t in chunks + [(b, A)]:
            x += t
            pos += list(range(st, st + len(t)))
        xs.append(x)
        ps.append(pos)
    return torch.tensor(xs), torch.tensor(ps), len(xs[0]) - n


def train_target(args, corpus, log, model=None):
    """Phase 1 (--target-steps) from a random init, then phase 2 (--target-steps2); a given
    model (--target-resume: the saved phase-1 target) runs phase 2 only."""
    torch.manual_seed(args.seed)
    phases = [(2, args.target_steps2)] if model is not None else [(1, args.target_steps), (2, args.target_steps2)]
    model = make_target(args) if model is None else model
    rng = np.random.default_rng(args.seed + (0 if len(phases) == 2 else 1))
    model.train()
    for phase, steps in phases:
        opt = torch.optim.AdamW(model.parameters(), lr=args.target_lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * s / steps))))
        for step in range(steps):
            x, pos, b0 = pose_batch(rng, args, corpus.D, phase)
            logits = model(x, position_ids=pos).logits[:, b0:-1]  # predictions of B's tokens 1..
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), x[:, b0 + 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 100 == 0 or step == steps - 1:
                acc = (logits.argmax(-1) == x[:, b0 + 1:]).float().mean().item()
                log(f"  target phase {phase} step {step}: loss {loss.item():.4f}, accuracy on the repeat {acc:.3f}")
    model.eval()
    return model


@torch.no_grad()
def target_accuracy(model, corpus, rng, length, n_docs, cont):
    """Teacher-forced accuracy of the target on the `cont` tokens after a prompt of `length`
    tokens of a periodic document, and on the first of them."""
    hit = tot = first = 0
    for _ in range(n_docs):
        p, motif = corpus.prompt(rng, length, cont)
        ids = torch.tensor([p + motif])
        pred = model(ids).logits[0, len(p) - 1:-1].argmax(-1).tolist()
        hit += sum(a == b for a, b in zip(pred, motif))
        tot += len(motif)
        first += pred[0] == motif[0]
    return hit / tot, first / n_docs


def layer_ids(n_layers, n_t):  # tools/extract_shards.py's choice (SPEC A.1)
    return [n_layers // 2] if n_t == 1 else [round(1 + i * (n_layers - 4) / (n_t - 1)) for i in range(n_t)]


@torch.no_grad()
def write_shards(model, corpus, args, C, out, log):
    """Documents of C tokens, their target features and greedy tokens, as diffcp train shards."""
    os.makedirs(out, exist_ok=True)
    layers = layer_ids(model.config.num_hidden_layers, 2)
    emb = model.get_input_embeddings().weight.detach().float().numpy()
    head = model.get_output_embeddings().weight.detach().float().numpy().T
    save_file({"embedding": np.ascontiguousarray(emb), "lm_head": np.ascontiguousarray(head)},
              f"{out}/model.safetensors",
              metadata={"target_layer_ids": json.dumps(layers), "num_target_layers": str(model.config.num_hidden_layers)})
    rng = np.random.default_rng(args.seed + 1000 + C)
    n_docs = args.docs + args.heldout
    buf, shard, rec = [], 0, 0
    per_shard = max(1, (1 << 20) // C)

    def flush():
        nonlocal buf, shard
        if buf:
            save_file({"tokens": np.concatenate([b[0] for b in buf]).astype(np.int32),
                       "loss_mask": np.concatenate([b[1] for b in buf]).astype(np.uint8),
                       "offsets": np.cumsum([0] + [len(b[0]) for b in buf]).astype(np.int64),
                       "hidden": np.concatenate([b[2] for b in buf]).astype(np.float32),
                       "target_greedy": np.concatenate([b[3] for b in buf]).astype(np.int32)},
                      f"{out}/shard_{shard:05d}.safetensors")
            shard, buf = shard + 1, []

    for _ in range(n_docs):
        toks = corpus.document(rng, C)
        mask = np.ones(C, dtype=np.uint8)  # loss and anchors everywhere (past D, all is a repeat)
        rec += max(0, C - corpus.D)
        o = model(torch.tensor([toks]), output_hidden_states=True)
        h = torch.cat([o.hidden_states[l + 1][0] for l in layers], dim=-1).numpy()
        greedy = np.concatenate([[toks[0]], o.logits[0, :-1].argmax(-1).numpy()])
        buf.append((np.array(toks), mask, h, greedy))
        if len(buf) == per_shard:
            flush()
    flush()
    log(f"  C = {C}: {n_docs} documents ({args.heldout} held out), {rec} tokens past the first period, target layers {layers}")


class Timed:
    """Forwards attribute access; times __call__ (the target) or draft (the drafter)."""

    def __init__(self, inner, method):
        self.__dict__.update(_inner=inner, _method=method, times=[])

    def __getattr__(self, name):
        if name == self._method and name != "__call__":
            f = getattr(self._inner, name)

            def timed(*a, **k):
                t = time.perf_counter()
                r = f(*a, **k)
                self.times.append(time.perf_counter() - t)
                return r
            return timed
        return getattr(self._inner, name)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        r = self._inner(*a, **k)
        self.times.append(time.perf_counter() - t)
        return r


def write_csv(path, rows, log):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), restval="")
        w.writeheader()
        w.writerows(rows)
    log(f"   wrote {path}")


def spec_kwargs(**want):
    """Only the keyword arguments this build's diffcp.speculative.generate accepts."""
    params = inspect.signature(diffcp.speculative.generate).parameters
    return {k: v for k, v in want.items() if k in params}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--diffcp", default="build/release/src/diffcp")
    ap.add_argument("--work", default="/tmp/long_context_study")
    ap.add_argument("--out", default="bench/long_context_study.txt")
    ap.add_argument("--tau-csv", default="bench/long_context_tau.csv")
    ap.add_argument("--speed-csv", default="bench/speculative_speed.csv")
    ap.add_argument("--seed", type=int, default=0)
    # corpus
    ap.add_argument("--period", type=int, default=1024, help="D: documents repeat every D tokens")
    # target
    ap.add_argument("--target-layers", type=int, default=6)
    ap.add_argument("--target-ffn", type=int, default=256)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--target-steps", type=int, default=800, help="phase 1 steps")
    ap.add_argument("--target-steps2", type=int, default=400, help="phase 2 steps")
    ap.add_argument("--target-distractors", type=int, default=4)
    ap.add_argument("--target-resume", action="store_true", help="run phase 2 on the saved target")
    ap.add_argument("--target-chunk", type=int, default=128, help="n: tokens per PoSE chunk (3 chunks a sequence)")
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--target-max-pos", type=int, default=16384)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--qk-norm-init", type=float, default=1.0, help="the target's q_norm/k_norm weights at init")
    # drafters
    ap.add_argument("--contexts", default="512,2048,8192", help="drafter training contexts")
    ap.add_argument("--docs", type=int, default=48, help="training documents per drafter (of C tokens each)")
    ap.add_argument("--heldout", type=int, default=2)
    ap.add_argument("--steps", default="2000", help="drafter steps: one number, or one per --contexts entry")
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--archs", default="dflash", help="drafter architectures to train and compare: dflash, dflash2 "
                    "(diffcp train --arch; issue #67: DFlash2's convolutions and candidate selector)")
    # decoding
    ap.add_argument("--lengths", default="1024,1536,2048,4096,8192,16384", help="prompt lengths")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--speed-lengths", default="2048,8192")
    ap.add_argument("--speed-prompts", type=int, default=3)
    ap.add_argument("--speed-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--stages", default="target,data,train,tau,speed")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    contexts = [int(c) for c in args.contexts.split(",")]
    archs = args.archs.split(",")
    # a drafter per (context, architecture); DFlash keeps the directory names of the first study
    tag = lambda C, a: f"{C}" if a == "dflash" else f"{C}_{a}"
    steps = [int(x) for x in args.steps.split(",")]
    steps = dict(zip(contexts, steps if len(steps) == len(contexts) else steps[:1] * len(contexts)))
    lengths = [int(c) for c in args.lengths.split(",")]
    stages = args.stages.split(",")
    os.makedirs(args.work, exist_ok=True)
    lines = []
    if os.path.exists(args.out) and "target" not in stages:
        lines = open(args.out).read().splitlines()

    def log(s):
        print(s, flush=True)
        lines.append(s)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")

    corpus = Corpus(args.period)
    log(f"long_context_study: torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
        f"threads {torch.get_num_threads()}, diffcp {args.diffcp}, work {args.work}")
    log("  " + " ".join(sys.argv[1:]))
    log(f"  generate signature: {inspect.signature(diffcp.speculative.generate)}")

    # 1. target
    tdir = f"{args.work}/target"
    if "target" in stages:
        t0 = time.time()
        if not os.path.exists(f"{tdir}/config.json") or args.target_resume:
            prev = None
            if args.target_resume:
                prev = Qwen3ForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="sdpa")
                log(f"  resuming the saved target {tdir}: phase 2 only")
            model = train_target(args, corpus, log, prev)
            model.save_pretrained(tdir)
            log(f"1. target ({args.target_layers} layers, hidden 64, ffn {args.target_ffn}, rope_theta {args.rope_theta:g}) "
                f"trained (phase 1: {args.target_steps} steps, phase 2: {args.target_steps2} steps) x {args.target_batch} sequences, chunks of {args.target_chunk}, PoSE positions up to "
                f"{args.target_max_pos}: {time.time() - t0:.0f} s")
        model = Qwen3ForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="sdpa").eval()
        t0 = time.time()
        rng = np.random.default_rng(args.seed + 7)
        for L in sorted(set(lengths + contexts)):
            acc, first = target_accuracy(model, corpus, rng, L, 4, args.new_tokens)
            log(f"  target accuracy at prompt length {L}: next-token accuracy {acc:.3f} on the {args.new_tokens} tokens after "
                f"the prompt, {first:.2f} on the first (teacher-forced, 4 documents, period {corpus.D})")
        log(f"   ({time.time() - t0:.0f} s)")
    model = Qwen3ForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="sdpa").eval()

    # 2-3. drafters
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    train_tau, train_last = {}, {}
    for C in contexts:
        sdir = f"{args.work}/shards_{C}"
        if "data" in stages and not os.path.exists(f"{sdir}/model.safetensors"):
            t0 = time.time()
            write_shards(model, corpus, args, C, sdir, log)
            log(f"2. shards for C = {C}: {time.time() - t0:.0f} s")
        for arch in archs:
            k = tag(C, arch)
            ddir = f"{args.work}/drafter_{k}"
            if "train" in stages and not os.path.exists(f"{ddir}/config.json"):
                t0 = time.time()
                cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1", "-np", "2",
                       args.diffcp, "train", "--data", sdir, "--preset", "tiny", "--arch", arch, "--context", str(C),
                       "--anchors", str(args.anchors), "--balancer", "lpt", "--steps", str(steps[C]), "--heldout",
                       str(args.heldout), "--eval-every", str(steps[C]), "--log", f"{args.work}/train_{k}.jsonl", "--out",
                       f"{args.work}/train_{k}", "--no-progress"]
                log("  $ " + " ".join(cmd))
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if r.returncode:
                    print(r.stdout, r.stderr)
                    raise SystemExit(f"diffcp train failed for C = {C}, {arch}")
                m = re.search(r"held-out acceptance length tau ([0-9.]+)", r.stdout)
                subprocess.run([args.diffcp, "export", "--checkpoint", f"{args.work}/train_{k}/checkpoint.bin", "--out", ddir],
                               check=True, capture_output=True)
                last = json.loads(open(f"{args.work}/train_{k}.jsonl").read().splitlines()[-1])
                recall = f", candidate recall {last['candidate_recall']:.3f}" if "candidate_recall" in last else ""
                log(f"3. drafter C = {C} ({arch}): {steps[C]} steps, P = 2, {time.time() - t0:.0f} s; final loss {last['loss']:.3f}"
                    f"{recall}, held-out tau {m.group(1) if m else '?'}, {last.get('step_ms', 0):.0f} ms/step")
            if os.path.exists(f"{args.work}/train_{k}.jsonl"):
                rows = [json.loads(x) for x in open(f"{args.work}/train_{k}.jsonl").read().splitlines()]
                train_tau[k] = next((x["tau"] for x in reversed(rows) if "tau" in x), None)
                train_last[k] = rows[-1]

    # 4. tau vs prompt length
    if "tau" in stages:
        drafters = {tag(C, a): diffcp.Drafter.load(f"{args.work}/drafter_{tag(C, a)}") for C in contexts for a in archs}
        rows = []
        for L in lengths:
            rng = np.random.default_rng(args.seed + 100 + L)
            prompts = [corpus.prompt(rng, L, args.new_tokens) for _ in range(args.prompts)]
            t0 = time.time()
            refs = []
            for p, _ in prompts:
                ids = torch.tensor([p])
                g = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=MASK,
                                   eos_token_id=None)
                refs.append(g[0, len(p):].tolist())
            motif_ok = np.mean([sum(a == b for a, b in zip(r, m)) / len(m) for r, (_, m) in zip(refs, prompts)])
            log(f"4. prompt length {L}: target greedy ({time.time() - t0:.0f} s), its {args.new_tokens} tokens right (vs the document) {motif_ok:.3f}")
            for C, arch in [(C, a) for C in contexts for a in archs]:
                k = tag(C, arch)
                t0 = time.time()
                taus, lossless, new, fwd = [], 0, 0, 0
                for (p, _), ref in zip(prompts, refs):
                    out, st = diffcp.speculative.generate(model, drafters[k], torch.tensor(p), args.new_tokens,
                                                          **spec_kwargs(temperature=0.0))
                    lossless += out[0, len(p):].tolist() == ref
                    taus.append(st["tau"])
                    new += st["new_tokens"]
                    fwd += st["target_forwards"]
                row = dict(train_context=C, **({"arch": arch} if archs != ["dflash"] else {}),
                           prompt_length=L, tau=round(float(np.mean(taus)), 4),
                           tau_min=round(float(np.min(taus)), 4), tau_max=round(float(np.max(taus)), 4),
                           tokens_per_target_forward=round(new / fwd, 4),
                           lossless="yes" if lossless == len(prompts) else f"no ({lossless}/{len(prompts)})",
                           prompts=len(prompts), new_tokens=args.new_tokens, target_greedy_accuracy=round(float(motif_ok), 4),
                           trainer_heldout_tau=train_tau.get(k), seconds=round(time.time() - t0, 1))
                if "candidate_recall" in train_last.get(k, {}):  # DFlash2: the last training step's
                    row["train_candidate_recall"] = round(train_last[k]["candidate_recall"], 4)
                rows.append(row)
                log(f"   drafter C = {C} ({arch}): tau {row['tau']:.3f} (prompts {row['tau_min']:.2f}..{row['tau_max']:.2f}), "
                    f"{row['tokens_per_target_forward']:.2f} tokens/target forward, lossless {row['lossless']}, "
                    f"{row['seconds']:.0f} s")
        write_csv(args.tau_csv, rows, log)

    # 5. speed
    speed_rows = []
    for arch in (archs if "speed" in stages else []):
        C = max(contexts)
        drafter = diffcp.Drafter.load(f"{args.work}/drafter_{tag(C, arch)}")
        params = inspect.signature(diffcp.speculative.generate).parameters
        # greedy from the draft KV cache and, for the before/after, drafting statelessly (the whole
        # context every block); sampled from the cache (builds with those arguments)
        modes = (["greedy", "greedy-stateless", "sampled"] if "draft_cache" in params else
                 ["greedy"] + (["sampled"] if "temperature" in params else []))
        rows = []
        for L in [int(x) for x in args.speed_lengths.split(",")]:
            rng = np.random.default_rng(args.seed + 200 + L)
            prompts = [corpus.prompt(rng, L, args.new_tokens)[0] for _ in range(args.speed_prompts)]
            for mode in modes:
                base_s = spec_s = tgt_s = dr_s = pre_s = 0.0
                taus, blocks, new_b, new_s, lossless = [], 0, 0, 0, 0
                for i, p in enumerate(prompts):
                    ids = torch.tensor([p])
                    greedy = mode.startswith("greedy")
                    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=args.temperature)
                    torch.manual_seed(i)
                    t = time.perf_counter()
                    g = model.generate(ids, max_new_tokens=args.speed_new_tokens, pad_token_id=MASK, eos_token_id=None,
                                       top_k=None, top_p=None, **kw)
                    base_s += time.perf_counter() - t
                    new_b += g.shape[1] - len(p)
                    tm, td = Timed(model, "__call__"), Timed(drafter, "draft")
                    sk = spec_kwargs(temperature=0.0 if greedy else args.temperature, seed=i,
                                     draft_cache=mode != "greedy-stateless")
                    t = time.perf_counter()
                    out, st = diffcp.speculative.generate(tm, td, torch.tensor(p), args.speed_new_tokens, use_cache=True, **sk)
                    spec_s += time.perf_counter() - t
                    new_s += st["new_tokens"]
                    lossless += greedy and out[0, len(p):].tolist() == g[0, len(p):].tolist()
                    taus.append(st["tau"])
                    blocks += len(st["acceptance_lengths"])
                    # timed around the calls (works with every build); the first target call is the prefill
                    pre_s += tm.times[0]
                    tgt_s += sum(tm.times[1:])
                    dr_s += st.get("draft_seconds", sum(td.times))  # the cache's appends and the LM head too, where reported
                n = len(prompts)
                row = dict(mode=mode, train_context=C, **({"arch": arch} if archs != ["dflash"] else {}),
                           prompt_length=L, prompts=n, new_tokens=args.speed_new_tokens,
                           baseline_tokens_per_s=round(new_b / base_s, 2), speculative_tokens_per_s=round(new_s / spec_s, 2),
                           speedup=round((new_s / spec_s) / (new_b / base_s), 3),
                           # without the prefill (the same forward in both; timed in the speculative run)
                           decode_speedup=round((base_s - pre_s) / (spec_s - pre_s) * new_s / new_b, 3),
                           tau=round(float(np.mean(taus)), 3),
                           lossless=("yes" if lossless == n else f"no ({lossless}/{n})") if mode.startswith("greedy") else "n/a",
                           baseline_s=round(base_s / n, 3), speculative_s=round(spec_s / n, 3),
                           prefill_s=round(pre_s / n, 3), target_s=round(tgt_s / n, 3), draft_s=round(dr_s / n, 3),
                           target_ms_per_block=round(1e3 * tgt_s / max(1, blocks), 2),
                           draft_ms_per_block=round(1e3 * dr_s / max(1, blocks), 2))
                rows.append(row)
                log(f"5. speed {arch} {mode}, prompt {L}: plain {row['baseline_tokens_per_s']:.1f} tok/s, speculative "
                    f"{row['speculative_tokens_per_s']:.1f} tok/s -> {row['speedup']:.2f}x ({row['decode_speedup']:.2f}x without the prefill; tau {row['tau']:.2f}, lossless "
                    f"{row['lossless']}); per prompt: prefill {row['prefill_s']:.2f} s, target blocks {row['target_s']:.2f} s, draft {row['draft_s']:.2f} s of "
                    f"{row['speculative_s']:.2f} s; target {row['target_ms_per_block']:.1f} ms/forward vs draft "
                    f"{row['draft_ms_per_block']:.1f} ms/block")
        speed_rows.extend(rows)
    if speed_rows:
        write_csv(args.speed_csv, speed_rows, log)


if __name__ == "__main__":
    main()
