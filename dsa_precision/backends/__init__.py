"""The external kernel libraries, one module each: the lazy import, the API subset the package
calls, and why a call cannot run (``*_unsupported_reason``). Importing this package imports
neither library.

- :mod:`.cudnn`: nvidia-cudnn-frontend's ``cudnn.DSA`` (SM90 indexer scoring, radix top-k,
  sparse attention).
- :mod:`.deepgemm`: DeepGEMM's ``fp8_mqa_logits`` (the engines' FP8 scoring kernel).
"""
