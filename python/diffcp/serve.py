"""An OpenAI-compatible image server over a diffcp-parallelized diffusers pipeline (issue #68).

    mpirun -np P python -m diffcp.serve --pipeline DIR --port 8000 [--mode cocodiff] [--cfg-parallel] ...

Rank 0 answers HTTP (a thread); every rank runs each batch's denoising together (the pipeline of
``diffcp.diffusers.parallelize``: its text encoders and VAE as diffusers runs them, the transformer
sequence-parallel). The API (docs/serve.md):

    POST   /v1/images/generations   OpenAI's images API: prompt, n, size, response_format (b64_json,
                                    PNG), and the extensions negative_prompt, seed,
                                    num_inference_steps, guidance_scale; answers when done
    POST   /v1/images/jobs          the same body; answers 202 with a job id at once
    GET    /v1/images/jobs/ID       its status: queued | running (with the step) | succeeded (with
                                    the images) | failed | cancelled
    DELETE /v1/images/jobs/ID       cancels it: queued, at once; running, between two steps on every rank
    GET    /health                  200 when ready, 503 while starting or stopping
    GET    /metrics                 Prometheus text: queue depth, requests, images, batches, step
                                    time, rank 0's bytes per link class

Errors are OpenAI error objects ({"error": {"message", "type", "param", "code"}}): 400 a bad field,
413 a body over 1 MB, 429 the queue full, 503 starting or stopping, 500 a failed rank (named).

Batching: requests waiting together with the same size, step count, guidance and negative prompt
run as one pipeline call (image k of a request seeded seed + k, each with its own prompt), and its
transformer runs them as one batch with per-image text (parallelize's batch_prompts).
Shutdown: SIGTERM or SIGINT to rank 0, or SIGUSR1 to mpirun (which forwards it): the batch in
flight finishes, what is queued is answered 503, every rank exits 0. A rank that raises reports
to rank 0, which answers 500 naming it and ends the job (MPI_Abort); a batch without progress for
--stall-timeout seconds the same. A supervisor restarts the job in both cases (exit status != 0).
"""
from __future__ import annotations

import argparse
import base64
import collections
import http.server
import importlib
import itertools
import json
import math
import signal
import struct
import sys
import threading
import time
import traceback
import zlib

import numpy as np

__all__ = ["png_bytes", "parse_request", "ApiError", "main"]

MAX_BODY = 1 << 20
KNOWN_FIELDS = {"prompt", "n", "size", "response_format", "negative_prompt", "seed", "num_inference_steps",
                "guidance_scale", "model", "user", "quality", "style"}


def png_bytes(img: np.ndarray) -> bytes:
    """[H, W, 3] uint8 -> a PNG file (8-bit RGB, no filter), with the standard library only."""
    h, w, c = img.shape
    if c != 3 or img.dtype != np.uint8:
        raise ValueError(f"png_bytes: expected [H, W, 3] uint8, got {img.shape} {img.dtype}")
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_request(body, limits) -> dict:
    """A generation request checked field by field (ApiError 400 naming the field) -> its settings."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; accepted: {sorted(KNOWN_FIELDS)}", unknown[0])

    def integer(name, default, lo, hi):
        v = body.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ApiError(400, f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", name)
        return v

    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
    negative = body.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise ApiError(400, "'negative_prompt' must be a string", "negative_prompt")
    size = body.get("size", limits.size)
    try:
        w, h = (int(v) for v in str(size).lower().split("x"))
    except ValueError:
        raise ApiError(400, f"'size' must be WIDTHxHEIGHT, got {size!r}", "size") from None
    if not (16 <= w <= limits.max_side and 16 <= h <= limits.max_side and w % 16 == 0 and h % 16 == 0):
        raise ApiError(400, f"'size' {w}x{h}: each side a multiple of 16 in [16, {limits.max_side}]", "size")
    fmt = body.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise ApiError(400, f"'response_format' {fmt!r}: this server returns b64_json (PNG) only", "response_format")
    g = body.get("guidance_scale", limits.guidance)
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
        raise ApiError(400, f"'guidance_scale' must be a finite number >= 0, got {g!r}", "guidance_scale")
    seed = body.get("seed")
    if seed is not None:
        seed = integer("seed", 0, 0, 2 ** 63 - 1 - limits.max_n)
    return {"prompt": prompt, "negative_prompt": negative, "n": integer("n", 1, 1, limits.max_n), "width": w, "height": h,
            "steps": integer("num_inference_steps", limits.steps, 1, limits.max_steps), "guidance": float(g), "seed": seed}


class Job:
    ids = itertools.count(1)

    def __init__(self, req: dict):
        self.id = f"img-{next(Job.ids)}"
        self.req = req
        self.status, self.step, self.error, self.images = "queued", 0, None, None
        self.created, self.submitted = int(time.time()), time.monotonic()
        self.cancelled = False
        self.done = threading.Event()

    def key(self):
        r = self.req
        return (r["width"], r["height"], r["steps"], r["guidance"], r["negative_prompt"])

    def finish(self, status: str, error: ApiError | None = None, images=None):
        self.status, self.error, self.images = status, error, images
        self.done.set()

    def view(self) -> dict:
        out = {"id": self.id, "object": "image.job", "created": self.created, "status": self.status,
               "step": self.step, "steps": self.req["steps"]}
        if self.status == "succeeded":
            out["data"] = [{"b64_json": b} for b in self.images]
        if self.error is not None:
            out["error"] = self.error.body()["error"]
        return out


class Server:
    """Rank 0's state: the bounded queue, the jobs, the metrics; shared by the HTTP threads and the
    scheduling loop under one lock."""

    def __init__(self, args):
        self.args = args
        self.lock = threading.Condition()
        self.state = "starting"
        self.queue: collections.deque[Job] = collections.deque()
        self.jobs: dict[str, Job] = {}
        self.running: list[Job] = []
        self.last_progress = self.batch_end = time.monotonic()
        self.seeds = itertools.count(1)
        self.m = collections.Counter()
        self.bytes = {"intra": 0, "inter": 0}
        self.answering = 0  # requests whose answer is not written yet

    def drain(self, timeout: float) -> None:
        """Waits (at most `timeout` seconds) until every request taken has been answered."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.answering and time.monotonic() < deadline:
                self.lock.wait(0.05)

    def submit(self, req: dict) -> Job:
        with self.lock:
            if self.state != "ready":
                raise ApiError(503, f"the server is {self.state}", code="unavailable", type_="server_error")
            if len(self.queue) >= self.args.max_queue:
                self.m["rejected_queue_full"] += 1
                raise ApiError(429, f"the queue is full ({self.args.max_queue} requests waiting); retry later",
                               code="queue_full", type_="rate_limit_error")
            if req["seed"] is None:
                req["seed"] = next(self.seeds)
            job = Job(req)
            self.jobs[job.id] = job
            self.queue.append(job)
            self.m["requests"] += 1
            while len(self.jobs) > 4096:  # keep the newest finished jobs' status
                old = next(iter(self.jobs))
                if not self.jobs[old].done.is_set():
                    break
                del self.jobs[old]
            self.lock.notify_all()
            return job

    def cancel(self, job_id: str) -> Job:
        with self.lock:
            job = self.jobs.get(job_id)
            if job is None:
                raise ApiError(404, f"no job {job_id!r}", code="not_found")
            if job.status == "queued":
                self.queue.remove(job)
                job.finish("cancelled")
                self.m["cancelled"] += 1
            elif job.status == "running":
                job.cancelled = True
            return job

    def next_batch(self) -> list[Job] | None:
        """Waits for work: the oldest job and every queued one of its key (up to --max-batch images);
        None once stopping (the queue answered 503). An idle server starts a request at once; under
        load (a request that waited through the last batch) it gives more --batch-wait-ms to arrive."""
        with self.lock:
            loaded = bool(self.queue) and self.queue[0].submitted < self.batch_end
            while not self.queue and self.state == "ready":
                self.lock.wait(0.2)
            if self.state != "ready":
                for job in self.queue:
                    job.finish("failed", ApiError(503, "the server is shutting down", code="shutting_down",
                                                  type_="server_error"))
                self.queue.clear()
                return None
        if loaded and self.args.batch_wait_ms > 0 and self.args.max_batch > 1:
            time.sleep(self.args.batch_wait_ms / 1000)
        with self.lock:
            first = self.queue.popleft()
            batch, images = [first], first.req["n"]
            for job in list(self.queue):
                if job.key() == first.key() and images + job.req["n"] <= self.args.max_batch:
                    self.queue.remove(job)
                    batch.append(job)
                    images += job.req["n"]
            for job in batch:
                job.status = "running"
            self.running = batch
            self.last_progress = time.monotonic()
            self.m["batches"] += 1
            self.m["batch_images"] += images
            return batch

    def fail_all(self, error: ApiError) -> None:
        with self.lock:
            self.state = "failed"
            for job in self.running + list(self.queue):
                if not job.done.is_set():
                    job.finish("failed", error)
                    self.m["failed"] += 1
            self.queue.clear()

    def metrics(self) -> str:
        with self.lock:
            m, depth = dict(self.m), len(self.queue)
        lines = [
            "# HELP diffcp_serve_queue_depth Requests waiting.", "# TYPE diffcp_serve_queue_depth gauge",
            f"diffcp_serve_queue_depth {depth}",
            "# TYPE diffcp_serve_requests_total counter"]
        for status in ("succeeded", "failed", "cancelled"):
            lines.append(f'diffcp_serve_requests_total{{status="{status}"}} {m.get(status, 0)}')
        lines.append(f'diffcp_serve_requests_total{{status="rejected_queue_full"}} {m.get("rejected_queue_full", 0)}')
        lines += ["# TYPE diffcp_serve_images_total counter", f"diffcp_serve_images_total {m.get('images', 0)}",
                  "# TYPE diffcp_serve_batches_total counter", f"diffcp_serve_batches_total {m.get('batches', 0)}",
                  "# TYPE diffcp_serve_batch_images_total counter",
                  f"diffcp_serve_batch_images_total {m.get('batch_images', 0)}",
                  "# TYPE diffcp_serve_step_seconds summary",
                  f"diffcp_serve_step_seconds_sum {m.get('step_us', 0) / 1e6:.6f}",
                  f"diffcp_serve_step_seconds_count {m.get('steps', 0)}",
                  "# HELP diffcp_serve_bytes_sent_total Rank 0's attention exchange bytes by link class.",
                  "# TYPE diffcp_serve_bytes_sent_total counter"]
        for link, v in self.bytes.items():
            lines.append(f'diffcp_serve_bytes_sent_total{{link="{link}"}} {v}')
        return "\n".join(lines) + "\n"


def _handler(server: Server):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet: the metrics count what happens
            pass

        def reply(self, status: int, body, content_type="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise ApiError(413, f"the body is {n} bytes; the limit is {MAX_BODY}", code="too_large")
            try:
                return json.loads(self.rfile.read(n) or b"null")
            except ValueError as e:
                raise ApiError(400, f"the body is not JSON: {e}") from None

        def guarded(self, fn):
            with server.lock:
                server.answering += 1
            try:
                fn()
            except ApiError as e:
                if e.status == 413:
                    self.close_connection = True
                self.reply(e.status, e.body())
            finally:
                with server.lock:
                    server.answering -= 1
                    server.lock.notify_all()

        def do_GET(self):
            def run():
                if self.path == "/health":
                    ok = server.state == "ready"
                    return self.reply(200 if ok else 503, {"status": server.state})
                if self.path == "/metrics":
                    return self.reply(200, server.metrics(), "text/plain; version=0.0.4")
                if self.path.startswith("/v1/images/jobs/"):
                    job = server.jobs.get(self.path.rsplit("/", 1)[1])
                    if job is None:
                        raise ApiError(404, f"no job {self.path.rsplit('/', 1)[1]!r}", code="not_found")
                    return self.reply(200, job.view())
                raise ApiError(404, f"no route GET {self.path}", code="not_found")
            self.guarded(run)

        def do_DELETE(self):
            def run():
                if not self.path.startswith("/v1/images/jobs/"):
                    raise ApiError(404, f"no route DELETE {self.path}", code="not_found")
                self.reply(200, server.cancel(self.path.rsplit("/", 1)[1]).view())
            self.guarded(run)

        def do_POST(self):
            def run():
                if self.path not in ("/v1/images/generations", "/v1/images/jobs"):
                    raise ApiError(404, f"no route POST {self.path}", code="not_found")
                body = self.body()
                job = server.submit(parse_request(body, server.args))
                if self.path == "/v1/images/jobs":
                    return self.reply(202, job.view())
                job.done.wait()
                if job.status == "succeeded":
                    return self.reply(200, {"created": job.created, "data": [{"b64_json": b} for b in job.images]})
                err = job.error or ApiError(409, "the request was cancelled", code="cancelled")
                raise err
            self.guarded(run)

    return Handler


def _pipeline(args):
    """The pipeline (every rank): --pipeline-factory MODULE:FUNCTION(args), or diffusers' own loader."""
    if args.pipeline_factory:
        mod, _, fn = args.pipeline_factory.partition(":")
        return getattr(importlib.import_module(mod), fn)(args)
    import torch
    from diffusers import DiffusionPipeline
    dtype = torch.bfloat16 if args.weights_dtype == "bf16" else torch.float32
    return DiffusionPipeline.from_pretrained(args.pipeline, torch_dtype=dtype)


def _qwen(pipe) -> bool:
    return type(getattr(pipe, "transformer", None)).__name__ == "QwenImageTransformer2DModel"


def _run_batch(comm, pipe, work: dict, server: Server | None) -> list[np.ndarray] | None:
    """One batch through the pipeline, on every rank. Rank 0 gets the images [H, W, 3] uint8."""
    import torch
    rank = comm.Get_rank()
    jobs = server.running if server is not None else []
    prompts, gens = [], []
    for prompt, n, seed in work["items"]:
        for k in range(n):
            prompts.append(prompt)
            gens.append(torch.Generator("cpu").manual_seed(seed + k))
    flag = np.zeros(1, np.int32)
    t_last = [time.perf_counter()]

    def on_step(p, i, t, kwargs):
        if rank == 0:
            now = time.perf_counter()
            with server.lock:
                for job in jobs:
                    job.step = i + 1
                server.last_progress = time.monotonic()
                server.m["steps"] += 1
                server.m["step_us"] += int(1e6 * (now - t_last[0]))
            t_last[0] = now
            flag[0] = int(all(job.cancelled for job in jobs))
        comm.Bcast(flag, root=0)  # cancel between steps, on every rank alike
        if flag[0]:
            p._interrupt = True
        return {}

    kwargs = dict(prompt=prompts, height=work["height"], width=work["width"], num_inference_steps=work["steps"],
                  generator=gens, output_type="np", callback_on_step_end=on_step)
    # The request's guidance_scale is the pipeline's guidance knob: QwenImagePipeline's is true_cfg_scale
    # (classifier-free guidance with a negative prompt); the others' guidance_scale.
    kwargs["true_cfg_scale" if _qwen(pipe) else "guidance_scale"] = work["guidance"]
    if work["negative_prompt"] is not None:
        kwargs["negative_prompt"] = work["negative_prompt"]
    out = pipe(**kwargs)
    if rank != 0:
        return None
    images = np.asarray(out.images)
    return [(np.clip(im, 0, 1) * 255).round().astype(np.uint8) for im in images]


def _watchdog(comm, err_comm, server: Server, stall_s: float):
    """Rank 0: a failure reported by another rank, or a batch without progress for stall_s
    seconds, answers 500 and ends the job (every rank)."""
    from mpi4py import MPI
    while server.state in ("starting", "ready", "stopping"):
        time.sleep(0.2)
        msg = None
        if err_comm.Iprobe(source=MPI.ANY_SOURCE, tag=7):
            msg = err_comm.recv(source=MPI.ANY_SOURCE, tag=7)
        elif server.running and time.monotonic() - server.last_progress > stall_s:
            msg = f"no step completed in {stall_s:g} s: a rank failed or stalled"
        if msg is not None:
            _fail(comm, server, msg)


def _fail(comm, server: Server, msg: str):
    print(f"diffcp.serve: error: {msg}; ending the job (a supervisor should restart it)", file=sys.stderr, flush=True)
    server.fail_all(ApiError(500, msg, code="rank_failed", type_="server_error"))
    server.drain(10.0)  # the HTTP threads answer
    comm.Abort(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffcp.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", help="a diffusers pipeline folder (FLUX.1, FLUX.2, Qwen-Image, SD3.5)")
    ap.add_argument("--pipeline-factory", help="MODULE:FUNCTION returning the pipeline, given the parsed arguments "
                    "(a pipeline class of your own; it may read --pipeline)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--mode", default="cocodiff")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--weights-dtype", default="auto")
    ap.add_argument("--shard-weights", action="store_true")
    ap.add_argument("--cfg-parallel", action="store_true")
    ap.add_argument("--step-cache", default="none")
    ap.add_argument("--wire", default="auto")
    ap.add_argument("--ulysses-degree", type=int)
    ap.add_argument("--ring-degree", type=int)
    ap.add_argument("--no-batch-prompts", action="store_true",
                    help="run each prompt of a batch as its own transformer pass (default: one batch, per-image text)")
    ap.add_argument("--max-queue", type=int, default=16, help="requests waiting; more are answered 429")
    ap.add_argument("--max-batch", type=int, default=4, help="images per pipeline call")
    ap.add_argument("--batch-wait-ms", type=float, default=20,
                    help="under load, how long a batch waits for more requests (an idle server starts at once)")
    ap.add_argument("--max-n", type=int, default=4)
    ap.add_argument("--max-side", type=int, default=2048)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--size", default="1024x1024", help="the default size")
    ap.add_argument("--steps", type=int, default=28, help="the default num_inference_steps")
    ap.add_argument("--guidance", type=float, default=3.5, help="the default guidance_scale")
    ap.add_argument("--stall-timeout", type=float, default=600, help="seconds a batch may go without a step")
    args = ap.parse_args(argv)
    if not args.pipeline and not args.pipeline_factory:
        ap.error("give --pipeline DIR (or --pipeline-factory MODULE:FUNCTION)")
    for name in ("max_queue", "max_batch", "max_n", "max_side", "max_steps", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    from mpi4py import MPI
    from . import diffusers as dd
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    err_comm = comm.Dup()
    server = httpd = None
    if rank == 0:  # HTTP first: /health answers 503 while the pipeline loads
        server = Server(args)
        httpd = http.server.ThreadingHTTPServer((args.host, args.port), _handler(server))
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        print(f"diffcp.serve: listening on http://{args.host}:{httpd.server_port} (rank 0 of {comm.Get_size()})", flush=True)

        def stop(signum, frame):
            with server.lock:
                if server.state == "ready":
                    server.state = "stopping"
                server.lock.notify_all()
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(s, stop)
    else:
        signal.signal(signal.SIGUSR1, lambda *a: None)  # rank 0 decides; mpirun forwards it to all
    try:
        pipe = _pipeline(args)
        if type(getattr(pipe, "transformer", None)).__name__ == "WanTransformer3DModel":
            raise NotImplementedError("a video pipeline (WanPipeline) is not served: the server speaks the OpenAI "
                                      "images API")
        pipe = dd.parallelize(pipe, comm=comm, mode=args.mode, dtype=args.dtype,
                              weights_dtype=args.weights_dtype, shard_weights=args.shard_weights,
                              cfg_parallel=args.cfg_parallel, step_cache=args.step_cache, wire=args.wire,
                              ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree,
                              batch_prompts=not args.no_batch_prompts)
    except Exception as e:  # every rank checks the same options alike
        print(f"diffcp.serve: rank {rank}: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        with server.lock:
            if server.state == "starting":
                server.state = "ready"
        watchdog = threading.Thread(target=_watchdog, args=(comm, err_comm, server, args.stall_timeout), daemon=True)
        watchdog.start()
        print("diffcp.serve: ready", flush=True)
    while True:
        work = None
        if rank == 0:
            batch = server.next_batch()
            if batch is not None:
                r = batch[0].req
                work = {"items": [(j.req["prompt"], j.req["n"], j.req["seed"]) for j in batch], "width": r["width"],
                        "height": r["height"], "steps": r["steps"], "guidance": r["guidance"],
                        "negative_prompt": r["negative_prompt"]}
        work = comm.bcast(work, root=0)
        if work is None:
            break
        try:
            images = _run_batch(comm, pipe, work, server)
        except Exception as e:
            msg = f"rank {rank}: {type(e).__name__}: {e}"
            traceback.print_exc()
            if rank == 0:
                _fail(comm, server, msg)
            err_comm.send(msg, dest=0, tag=7)
            while True:  # rank 0 answers and ends the job
                time.sleep(1)
        if rank == 0:
            stats = pipe.core.exchange_stats()
            with server.lock:
                server.bytes = {"intra": stats["bytes_intra"], "inter": stats["bytes_inter"]}
                k = 0
                for job in server.running:
                    n = job.req["n"]
                    if job.cancelled:
                        job.finish("cancelled")
                        server.m["cancelled"] += 1
                    else:
                        job.finish("succeeded", images=[base64.b64encode(png_bytes(im)).decode() for im in images[k:k + n]])
                        server.m["succeeded"] += 1
                        server.m["images"] += n
                    k += n
                server.running = []
                server.batch_end = time.monotonic()
    if rank == 0:
        with server.lock:
            server.state = "stopped"  # the watchdog's loop ends: no MPI call after this
        watchdog.join()
        server.drain(10.0)  # the last answers go out
        httpd.shutdown()
        print("diffcp.serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
