#!/usr/bin/env python3
"""A prompt to a PNG with a diffusers Flux2Pipeline (FLUX.2 (dev)), its transformer on diffcp across ranks.

  mpirun -np 2 python examples/diffusers/flux2.py --model PIPELINE_DIR --out image.png [--shard-weights]

Not run here: the pipeline's text encoder (Qwen2.5-VL / Mistral) is too large to build at random,
so tools/diffusers_pipeline_check.py checks its transformer one level down (bench/RESULTS.md).

PIPELINE_DIR: a Flux2Pipeline folder (a download of the published model, or a tiny random one). Options:
text_to_image.py.
"""
from text_to_image import main

main("Flux2Pipeline", {"guidance_scale": 4.0}, negative=False, side=1024, steps=50, doc=__doc__)
