"""Inference backends for hard-case mining: a local `transformers` checkpoint or an OpenAI-compatible
endpoint behind one interface, and a crash-safe per-row result store with a resumable run loop.

May import torch, transformers, httpx, `emrl_data` and `train.data`; never `flows`. torch and transformers are imported
only when a `TransformersBackend` is built, so the HTTP backend and the store stay light.
"""

from inference.backends import (
    DIALECTS,
    VLLM_VIDEO_EXTRA_BODY,
    EndpointAuthError,
    EndpointProbeError,
    InferenceBackend,
    InferenceRequest,
    InferenceResult,
    OpenAIBackend,
    ProbeReport,
    TransformersBackend,
    request_from_row,
)
from inference.store import ResultStore, run_inference


__all__ = [
    "DIALECTS",
    "VLLM_VIDEO_EXTRA_BODY",
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
