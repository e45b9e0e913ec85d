#!/usr/bin/env python3
"""A prompt to a PNG with a diffusers FluxPipeline (FLUX.1 (dev; schnell: --guidance 0 --steps 4)), its transformer on diffcp across ranks.

  mpirun -np 2 python examples/diffusers/flux1.py --model PIPELINE_DIR --out image.png [--shard-weights]

PIPELINE_DIR: a FluxPipeline folder (a download of the published model, or a tiny random one). Options:
text_to_image.py.
"""
from text_to_image import main

main("FluxPipeline", {"guidance_scale": 3.5}, negative=False, side=1024, steps=28, doc=__doc__)
