#!/usr/bin/env python3
"""A prompt to a PNG with a diffusers StableDiffusion3Pipeline (Stable Diffusion 3.5 (large)), its transformer on diffcp across ranks.

  mpirun -np 2 python examples/diffusers/sd35.py --model PIPELINE_DIR --out image.png [--shard-weights]

PIPELINE_DIR: a StableDiffusion3Pipeline folder (a download of the published model, or a tiny random one). Options:
text_to_image.py.
"""
from text_to_image import main

main("StableDiffusion3Pipeline", {"guidance_scale": 7.0}, negative=True, side=1024, steps=28, doc=__doc__)
