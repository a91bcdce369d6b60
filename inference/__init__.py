"""Inference backends for hard-case mining: a local `transformers` checkpoint or an OpenAI-compatible endpoint behind
one interface, and a crash-safe per-row result store with a resumable run loop.

May import torch, transformers, httpx, `emrl_data` and `model_io` (the CT video encoding, the chat layout and the
checkpoint checks it shares with training); never `train`, `flows` or the CLI. torch and transformers are imported
only when a `TransformersBackend` is built, so the HTTP backend and the store stay light.
"""

from inference.backends import InferenceBackend
from inference.bounded_http import Deadlines
from inference.openai_client import DIALECTS, VLLM_VIDEO_EXTRA_BODY, EndpointAuthError, OpenAIBackend
from inference.probe import EndpointProbeError, ProbeReport
from inference.requests import InferenceRequest, InferenceResult, request_from_row
from inference.store import ResultStore, run_inference
from inference.transformers_backend import TransformersBackend


__all__ = [
    "DIALECTS",
    "VLLM_VIDEO_EXTRA_BODY",
    "Deadlines",
    "EndpointAuthError",
    "EndpointProbeError",
    "InferenceBackend",
    "InferenceRequest",
    "InferenceResult",
    "OpenAIBackend",
    "ProbeReport",
    "ResultStore",
    "TransformersBackend",
    "request_from_row",
    "run_inference",
]
