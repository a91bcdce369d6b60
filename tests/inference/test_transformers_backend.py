"""TransformersBackend on a tiny local Qwen3-VL: greedy determinism, batch == one by one, order, bad rows, no Hub."""

import io

import pytest
from PIL import Image

from inference.requests import InferenceRequest, request_from_row
from inference.transformers_backend import TransformersBackend


@pytest.fixture(scope="module")
def backend(tiny_dir) -> TransformersBackend:
    return TransformersBackend(str(tiny_dir), device="cpu", batch_size=3, max_new_tokens=12)


def test_greedy_is_deterministic(backend, requests3):
    first = backend.generate(requests3)
    second = backend.generate(requests3)
    assert [r.text for r in first] == [r.text for r in second]
    assert all(r.ok and r.text and r.attempts == 1 for r in first)
    assert len({r.text for r in first}) == 3  # different inputs, different (random-model) texts


@pytest.mark.slow
def test_batch_equals_one_by_one_and_order_is_kept(backend, requests3):
    batched = backend.generate(requests3)  # one left-padded batch of 3 (prompts of 8, 5 and 6 frames)
    single = [backend.generate([r])[0] for r in requests3]
    assert [r.request_id for r in batched] == [r.request_id for r in requests3]
    assert [r.text for r in batched] == [r.text for r in single]
    reordered = backend.generate(requests3[::-1])
    assert [r.request_id for r in reordered] == [r.request_id for r in requests3[::-1]]
    assert {r.request_id: r.text for r in reordered} == {r.request_id: r.text for r in batched}


def test_greedy_settings_and_suppressed_vision_tokens(backend):
    gen = backend.generation_config
    assert gen.do_sample is False and gen.num_beams == 1
    assert set(backend.processor.vision_token_ids) <= set(gen.suppress_tokens)
    assert backend.processor.tokenizer.padding_side == "left"


@pytest.mark.slow
def test_bad_frames_fail_only_their_row(backend, requests3):
    bad = InferenceRequest("bad/liver", "Describe the liver.", [b"not a png"])
    out = backend.generate([requests3[0], bad, requests3[1]])
    assert [r.request_id for r in out] == [requests3[0].request_id, "bad/liver", requests3[1].request_id]
    assert out[1].text is None and out[1].error.startswith("bad frames:")
    assert out[0].text == backend.generate([requests3[0]])[0].text and out[2].ok


def test_max_new_tokens_override(backend, requests3):
    short = backend.generate(requests3[:1], max_new_tokens=1)[0].text
    full = backend.generate(requests3[:1])[0].text
    assert full.startswith(short) and len(short) < len(full)


def test_hub_ids_are_refused():
    with pytest.raises(FileNotFoundError, match="local checkpoint directory"):
        TransformersBackend("Qwen/Qwen3-VL-8B-Instruct")


def test_request_from_row_accepts_structs_and_pil(requests3):
    req = requests3[0]
    structs = [{"bytes": b, "path": None} for b in req.frames_png]
    row = {"case_id": "BDMAP_00000001", "organ": "liver", "prompt": req.prompt, "frames": structs}
    assert request_from_row(row) == InferenceRequest("BDMAP_00000001/liver", req.prompt, req.frames_png)
    pil_row = {**row, "frames": [Image.open(io.BytesIO(b)) for b in req.frames_png]}
    decoded = request_from_row(pil_row).frames_png
    assert [Image.open(io.BytesIO(b)).tobytes() for b in decoded] == [
        Image.open(io.BytesIO(b)).tobytes() for b in req.frames_png
    ]  # lossless re-encoding
