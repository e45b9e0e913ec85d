#!/usr/bin/env python3
"""FLUX.2 (dev) from a prompt to a PNG: mpirun -np 2 python flux2.py --model DIR (options: text_to_image.py).

Not run here: its text encoder is too large to build at random; tools/diffusers_pipeline_check.py
checks its transformer against diffusers' own."""
from text_to_image import main

main("Flux2Pipeline", {"guidance_scale": 4.0}, negative=False, side=1024, steps=50, doc=__doc__)
