"""diffusers pipeline folders for the NumPy references of the DiT families (qwenimage_reference.py,
flux2_reference.py, sd3_reference.py): writing a tiny random pipeline, reading one back against a
family's tensor list, a data-less real-shape folder, and reading diffcp's --dump-velocity.

A family module gives `read_config(config: dict, where: str) -> dict` (the class's arguments,
refusing what it does not model) and `weight_shapes(args: dict) -> {name: shape}` (diffusers'
state-dict names); the folder layout is diffusers' own: model_index.json, transformer/config.json
beside diffusion_pytorch_model.safetensors or its sharded set (diffusion_pytorch_model-0000k-of-
0000n.safetensors + .index.json), scheduler/scheduler_config.json.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from flux_reference import InputError, decode, encode, load_npy, load_weights, write_safetensors

ReadConfig = Callable[[dict, str], dict]
WeightShapes = Callable[[dict], dict]


def rng(seed: int, name: str) -> np.random.Generator:
    """A stream per (seed, name): tensors and inputs do not shift each other's draws."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """A tiny model's float32 weights: Linear / conv weights N(0, 1/fan_in), biases N(0, 0.01), norm
    weights 1 + N(0, 0.01), a position table N(0, 0.25)."""
    out = {}
    for name, s in shapes.items():
        g = rng(seed, name).standard_normal(s)
        if name.endswith("pos_embed"):
            g = 0.5 * g
        elif len(s) == 1 and "norm" in name:
            g = 1.0 + 0.1 * g
        elif name.endswith(".bias"):
            g = 0.1 * g
        else:
            g = g / math.sqrt(int(np.prod(s[1:])))
        out[name] = g.astype(np.float32)
    return out


def write_pipeline(out: Path, config: dict, pipeline: str, scheduler: dict, tensors: dict[str, np.ndarray],
                   dtype: str, shards: int, read_config: ReadConfig, weight_shapes: WeightShapes) -> None:
    """A pipeline folder of `tensors` (float32, stored as `dtype`: F32 / BF16 / F16) in `shards` files;
    read back: each tensor equal to its stored (rounded) value, or InputError."""
    t = out / "transformer"
    t.mkdir(parents=True, exist_ok=True)
    (t / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "model_index.json").write_text(json.dumps(
        {"_class_name": pipeline, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
         "transformer": ["diffusers", config["_class_name"]]}, indent=2) + "\n")
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
    names = list(tensors)
    if shards == 1:
        write_safetensors(t / "diffusion_pytorch_model.safetensors", tensors, dtype)
    else:
        weight_map, total = {}, 0
        for k, chunk in enumerate(np.array_split(np.arange(len(names)), shards), 1):
            fname = f"diffusion_pytorch_model-{k:05d}-of-{shards:05d}.safetensors"
            part = {names[j]: tensors[names[j]] for j in chunk}
            total += write_safetensors(t / fname, part, dtype)
            weight_map.update({n: fname for n in part})
        (t / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _, back, _ = load_pipeline(out, read_config, weight_shapes)
    for name, x in tensors.items():
        if not np.array_equal(back[name], decode(encode(x, dtype), dtype, list(x.shape))):
            raise InputError(f"read-back mismatch for {name}")


def load_pipeline(path: Path, read_config: ReadConfig, weight_shapes: WeightShapes, header_only: bool = False
                  ) -> tuple[dict, dict[str, np.ndarray], Path | None]:
    """(the class's arguments, the weights by diffusers' name (none with header_only), the
    pipeline's scheduler_config.json or None) of a pipeline or transformer folder."""
    t = path / "transformer" if (path / "model_index.json").exists() else path
    sched = path / "scheduler" / "scheduler_config.json"
    try:
        a = read_config(json.loads((t / "config.json").read_text()), str(t / "config.json"))
    except (OSError, ValueError) as e:
        raise InputError(f"{t / 'config.json'}: cannot read ({e!r})") from None
    if header_only:
        return a, {}, sched if sched.exists() else None
    index = t / "diffusion_pytorch_model.safetensors.index.json"
    w = load_weights(index if index.exists() else t / "diffusion_pytorch_model.safetensors")
    want = weight_shapes(a)
    if set(w) != set(want):
        raise InputError(f"{t}: missing {sorted(set(want) - set(w))[:5]}, extra {sorted(set(w) - set(want))[:5]}")
    for n, s in want.items():
        if w[n].shape != s:
            raise InputError(f"{t}: {n} has shape {w[n].shape}, expected {s}")
    return a, w, sched if sched.exists() else None


def write_header(config_path: str, out: Path, read_config: ReadConfig, weight_shapes: WeightShapes) -> int:
    """A transformer folder of a config's real shape without data: config.json and one BF16
    safetensors whose header lists every tensor, extended (sparse, no disk blocks) to its true size."""
    try:
        c = json.loads(Path(config_path).read_text())
        p = read_config(c, config_path)
    except (InputError, OSError, ValueError) as e:
        print(f"header: {e}")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in weight_shapes(p).items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    f_out = out / "diffusion_pytorch_model.safetensors"
    with open(f_out, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + off)
    print(f"header: {len(header) - 1} tensors, {off // 2} parameters -> {f_out}")
    return 0


def check_dump_timesteps(dump: Path, steps: int, velocity_shape: tuple, sigmas: list[float]) -> bool:
    """diffcp's --dump-velocity DIR: every velocity_<k>.npy of `velocity_shape` present (else
    InputError), and its timesteps.json equal to `sigmas` to 1e-9 (printed)."""
    try:
        got = [float(t) for t in json.loads((dump / "timesteps.json").read_text())["timesteps"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{dump / 'timesteps.json'}: no readable 'timesteps' list ({e!r})") from None
    for k in range(steps):
        load_npy(dump / f"velocity_{k}.npy", [velocity_shape])
    dt = max((abs(u - v) for u, v in zip(got, sigmas)), default=0.0)
    ok = len(got) == len(sigmas) and dt <= 1e-9
    print(f"timesteps: {len(got)} given, {len(sigmas)} expected, max|diff| {dt:.3e} {'ok' if ok else 'MISMATCH'}")
    return ok


def check_sampler_run(dump: Path, x: np.ndarray, sigmas: list[float], velocity, tol: float, label: str,
                      step=None, model_sigmas: list[float] | None = None, final: Path | None = None) -> int:
    """The check of a dumped sampler run: its timesteps, then every step's reference velocity(x, sigma)
    on the reference's own trajectory from the noise x (Euler; or step(k, x, v) -> the next x, with the
    model called at model_sigmas[k]), against the dump; with `final` (diffcp's --save-latent), the
    last update's latent too; prints PASS / FAIL (`label`: the guidance) and returns the exit code (0
    pass, 1 mismatch)."""
    steps = len(sigmas) - 1
    ok = check_dump_timesteps(dump, steps, x.shape, sigmas)
    for k in range(steps):
        t = sigmas[k] if model_sigmas is None else model_sigmas[k]
        v = velocity(x, t)
        ok &= compare_step(dump, k, t, v, tol)
        x = x + (sigmas[k + 1] - sigmas[k]) * v if step is None else step(k, x, v)
    if final is not None:
        got = load_npy(final, [x.shape])
        rel = float(np.abs(got - x).max() / max(np.abs(x).max(), 1e-30))
        print(f"final latent  rel={rel:.3e}  {'ok' if rel <= tol else 'MISMATCH'}")
        ok &= rel <= tol
    print(f"{'PASS' if ok else 'FAIL'} ({steps} steps, {label}, tol {tol:g})")
    return 0 if ok else 1


def compare_step(dump: Path, k: int, sigma: float, want: np.ndarray, tol: float) -> bool:
    """Step k's dumped velocity against the reference's `want` (max relative error; printed)."""
    got = load_npy(dump / f"velocity_{k}.npy", [want.shape])
    rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    print(f"step {k:3d}  sigma={sigma:.6f}  rel={rel:.3e}  {'ok' if rel <= tol else 'MISMATCH'}")
    return rel <= tol
