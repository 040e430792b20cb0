"""Low-precision training: FP8 / MXFP8 conversion of the model's Linear modules and routed experts
(float8.py), between the model and the parallel code that shards what it converted."""
