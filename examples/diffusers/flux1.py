#!/usr/bin/env python3
"""FLUX.1 (dev; schnell: --guidance 0 --steps 4) from a prompt to a PNG: mpirun -np 2 python flux1.py --model DIR (options: text_to_image.py)."""
from text_to_image import main

main("FluxPipeline", {"guidance_scale": 3.5}, negative=False, side=1024, steps=28, doc=__doc__)
