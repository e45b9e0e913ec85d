"""Stand-ins for diffusers' FLUX.1 classes where diffusers is not installed (CI has Debian's torch,
not PyPI's diffusers): a FluxTransformer2DModel (the class name, the config with the folder it
came from, and parameters: what diffcp.diffusers.parallelize reads) and a FluxPipeline that calls
it as diffusers' FluxPipeline does (packed latents, img_ids / txt_ids, timestep = sigma, the
distilled guidance; a list of prompts and one generator per image; callback_on_step_end and the
interrupt flag; output_type "np" or "latent"). Its text encoder is a seeded hash of the prompt and
its "VAE" a fixed map of the latent to RGB: enough to serve and compare images, not a real model.
The prompt "__fail_on_rank_1__" raises on rank 1 (the server test's failed rank).

    make(args): the pipeline of the folder args.pipeline (tools/flux_reference.py make --format
    diffusers), what `python -m diffcp.serve --pipeline-factory standin_pipeline:make` calls.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


class FluxTransformer2DModel(torch.nn.Module):
    """Stands in for diffusers' class: its name, config (with the folder it came from) and parameters."""

    def __init__(self, path: Path):
        super().__init__()
        c = json.loads((Path(path) / "transformer" / "config.json").read_text())
        self.config = SimpleNamespace(_name_or_path=str(Path(path) / "transformer"), **c)
        self.w = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))


class FluxPipeline:
    """FluxPipeline's call, reduced: Euler over sigmas 1 .. 1/T (then 0), FLUX's 2 x 2 packing;
    DIFFCP_STANDIN_TEXT_TOKENS text tokens per prompt (default 8)."""

    text_tokens = int(os.environ.get("DIFFCP_STANDIN_TEXT_TOKENS", "8"))

    def __init__(self, folder: Path):
        self.transformer = FluxTransformer2DModel(folder)
        c = self.transformer.config
        self.text_dim, self.pooled_dim, self.channels = c.joint_attention_dim, c.pooled_projection_dim, c.in_channels
        self._interrupt = False

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def encode(self, prompt: str):
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
        g = torch.Generator("cpu").manual_seed(seed)
        return (torch.randn(self.text_tokens, self.text_dim, generator=g), torch.randn(self.pooled_dim, generator=g))

    def __call__(self, prompt, height: int = 64, width: int = 64, num_inference_steps: int = 4,
                 guidance_scale: float = 3.5, generator=None, output_type: str = "np", callback_on_step_end=None,
                 callback_on_step_end_tensor_inputs=None):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        B = len(prompts)
        if "__fail_on_rank_1__" in prompts:  # the server test's failing rank
            from mpi4py import MPI
            if MPI.COMM_WORLD.Get_rank() == 1:
                raise RuntimeError("the stand-in pipeline was asked to fail on rank 1")
        gens = generator if isinstance(generator, list) else [generator] * B
        if len(gens) != B:
            raise ValueError(f"{len(gens)} generators for {B} images")
        gh, gw = height // 16, width // 16
        x = torch.cat([torch.randn((1, gh * gw, self.channels), generator=g) for g in gens])
        enc = [self.encode(p) for p in prompts]
        txt = torch.stack([e[0] for e in enc])
        pooled = torch.stack([e[1] for e in enc])
        ids = torch.zeros(gh, gw, 3)
        ids[..., 1] = torch.arange(gh)[:, None]
        ids[..., 2] = torch.arange(gw)[None, :]
        img_ids, txt_ids = ids.reshape(-1, 3), torch.zeros(self.text_tokens, 3)
        sigmas = [1 - k / num_inference_steps for k in range(num_inference_steps)] + [0.0]
        self._interrupt = False
        for i in range(num_inference_steps):
            if self.interrupt:
                continue
            v = self.transformer(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled,
                                 timestep=torch.full((B,), sigmas[i]), img_ids=img_ids, txt_ids=txt_ids,
                                 guidance=torch.full((B,), float(guidance_scale)), joint_attention_kwargs=None,
                                 return_dict=False)[0]
            x = x + (sigmas[i + 1] - sigmas[i]) * v
            if callback_on_step_end is not None:
                callback_on_step_end(self, i, sigmas[i], {})
        if output_type == "latent":
            return SimpleNamespace(images=x)
        # "decode": the first three latent channels of each 2 x 2 patch position, 8 x 8 pixels each
        lat = x.numpy().reshape(B, gh, gw, self.channels // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
        lat = lat.reshape(B, self.channels // 4, 2 * gh, 2 * gw)[:, :3]
        img = 0.5 + 0.5 * np.tanh(lat.transpose(0, 2, 3, 1))
        return SimpleNamespace(images=np.repeat(np.repeat(img, 8, axis=1), 8, axis=2).astype(np.float32))


def make(args) -> FluxPipeline:
    return FluxPipeline(Path(args.pipeline))
