"""What `train/` saves is a standard Qwen3-VL checkpoint, and the stock processor encodes as we train.

* The saved files: `processor_class` `Qwen3VLProcessor`, the image and video processor configs in the nested form
  (`processor_config.json`) and the standalone form, key sets and class names of the base model.
* Stock loaders: `AutoModelForImageTextToText`, `AutoTokenizer`, `AutoImageProcessor` (PIL backend) load it without
  our code; `AutoProcessor` fails on this CPU machine only because `Qwen3VLVideoProcessor` needs torchvision.
* Equality with serving: the frame stack through our training path vs the stock processor loaded from the saved
  checkpoint (image path here; video and image paths through the real `AutoProcessor` in a torchvision subprocess).
* The upgrade command on a checkpoint in the old form.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen3VLForConditionalGeneration
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # see test_stock_loaders
from transformers.models.auto.processing_auto import AutoProcessor

from model_io.checkpoint import BASE_IMAGE_PROCESSOR, BASE_VIDEO_PROCESSOR, CT_VIDEO_SIZE, VIDEO_TRIPLE
from model_io.processor import CTQwen3VLProcessor, load_model_and_processor, render_prompt_text
from model_io.video import encode_ct_video, video_placeholder
from tests import torchvision_side
from train.sft import main as sft_main
from train.tools.upgrade_checkpoint import main as upgrade_main


PROMPT = "Describe the liver."  # the prompt tests/train/hf_reference.py uses
REPO = Path(__file__).resolve().parents[2]
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "tokenizer_config.json",
)


@pytest.fixture(scope="module")
def sft_ckpt(sft_table, tiny_dir, tmp_path_factory) -> Path:
    """The checkpoint `python -m train.sft` writes (tiny model, one step)."""
    out = tmp_path_factory.mktemp("std") / "sft"
    sft_main(
        [
            "--config",
            "train/configs/sft_tiny.yaml",
            "--dataset_dir",
            str(sft_table),
            "--output_dir",
            str(out),
            "--model_name_or_path",
            str(tiny_dir),
            "--max_steps",
            "1",
        ]
    )
    return out


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    """One frame stack: 4 frames of 64x64 (2 temporal groups of 4x4 patches, 4 tokens each)."""
    return np.random.default_rng(0).integers(0, 256, (4, 64, 64), dtype=np.uint8)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_standard(ckpt: Path) -> None:
    """The processor files of `ckpt` declare Qwen3VLProcessor and have the base model's form."""
    proc = _json(ckpt / "processor_config.json")
    assert set(proc) == {"image_processor", "processor_class", "video_processor"}
    assert proc["processor_class"] == "Qwen3VLProcessor"
    assert _json(ckpt / "tokenizer_config.json")["processor_class"] == "Qwen3VLProcessor"
    image, video = _json(ckpt / "preprocessor_config.json"), _json(ckpt / "video_preprocessor_config.json")
    assert image == {**proc["image_processor"], "processor_class": "Qwen3VLProcessor"}
    assert video == {**proc["video_processor"], "processor_class": "Qwen3VLProcessor"}
    assert set(proc["image_processor"]) == set(BASE_IMAGE_PROCESSOR)
    assert set(proc["video_processor"]) == set(BASE_VIDEO_PROCESSOR)
    assert proc["image_processor"]["image_processor_type"] == "Qwen2VLImageProcessor"
    assert proc["video_processor"]["video_processor_type"] == "Qwen3VLVideoProcessor"
    for form in (proc["image_processor"], proc["video_processor"]):
        assert (form["patch_size"], form["merge_size"], form["temporal_patch_size"]) == (16, 2, 2)
        assert form["image_mean"] == form["image_std"] == [0.5, 0.5, 0.5]
    assert proc["video_processor"]["do_sample_frames"] is False
    assert proc["video_processor"]["size"] == CT_VIDEO_SIZE
    assert (ckpt / "chat_template.jinja").read_text().startswith("{%- if tools %}")
    assert _json(ckpt / "config.json")["model_type"] == "qwen3_vl"
    assert "CTQwen3VLProcessor" not in "".join((ckpt / f).read_text() for f in PROCESSOR_FILES)


def test_sft_checkpoint_is_standard(sft_ckpt):
    assert_standard(sft_ckpt)
    for sub in sft_ckpt.glob("checkpoint-*"):  # the trainer's intermediate checkpoints, if any were written
        assert_standard(sub)


def test_tiny_checkpoint_is_standard(tiny_dir):
    assert_standard(tiny_dir)


def test_image_processor_form_is_exactly_what_transformers_writes(sft_ckpt):
    """The nested file is byte-identical to `json.dumps(indent=2, sort_keys=True)` of its dicts (5.17's writer)."""
    text = (sft_ckpt / "processor_config.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert _json(sft_ckpt / "processor_config.json")["image_processor"]["size"] == {
        "longest_edge": 16777216,
        "shortest_edge": 1024,  # the tiny processor's setting is kept (a 64² verifier frame stays 64²)
    }


def test_stock_loaders(sft_ckpt):
    """What loads without our code on a CPU machine without torchvision, and how AutoProcessor fails there.

    In 5.17, `transformers.AutoImageProcessor` (the top-level name) is a placeholder that requires torchvision; the
    class itself, imported from its module, resolves to the PIL backend (`Qwen2VLImageProcessorPil`).
    """
    model = AutoModelForImageTextToText.from_pretrained(sft_ckpt)
    assert isinstance(model, Qwen3VLForConditionalGeneration)
    tok = AutoTokenizer.from_pretrained(sft_ckpt)
    assert tok.convert_tokens_to_ids("<|video_pad|>") == model.config.video_token_id
    image_processor = AutoImageProcessor.from_pretrained(sft_ckpt, backend="pil")
    assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert (image_processor.patch_size, image_processor.merge_size) == (16, 2)
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 (absent, or present but unloadable next to the CPU torch)
        with pytest.raises(ImportError, match=r"Qwen3VLVideoProcessor requires the Torchvision library"):
            AutoProcessor.from_pretrained(sft_ckpt)
    else:
        proc = AutoProcessor.from_pretrained(sft_ckpt)
        assert (type(proc).__name__, type(proc.video_processor).__name__) == (
            "Qwen3VLProcessor",
            "Qwen3VLVideoProcessor",
        )


def test_our_loaders_still_load(sft_ckpt, frames):
    model, proc = load_model_and_processor(sft_ckpt, dtype=torch.float32)
    assert isinstance(proc, CTQwen3VLProcessor) and isinstance(model, Qwen3VLForConditionalGeneration)
    out = proc(text=[render_prompt_text(proc, PROMPT)], videos=[frames], return_tensors="pt")
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]


def _image_inputs(tok, image_processor, frames):
    """The stock image path assembled from the saved checkpoint's tokenizer, template and PIL image processor.

    What `Qwen3VLProcessor.__call__` does for images (it cannot be built here without a video processor): the
    template's `<|image_pad|>` becomes `grid.prod() / merge_size²` pads per image.
    """
    content = [{"type": "image"} for _ in frames] + [{"type": "text", "text": PROMPT}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    pixels = image_processor([Image.fromarray(f).convert("RGB") for f in frames], return_tensors="pt")
    parts = text.split("<|image_pad|>")
    merge = image_processor.merge_size**2
    pads = ["<|image_pad|>" * int(g.prod() // merge) for g in pixels["image_grid_thw"]]
    expanded = parts[0] + "".join(p + rest for p, rest in zip(pads, parts[1:], strict=True))
    return tok(expanded, add_special_tokens=False)["input_ids"], pixels, text


def test_image_path_equals_stock_image_processor(sft_ckpt, frames):
    """(a) Frames as images: our processor vs the PIL image processor + tokenizer + template from the checkpoint."""
    ours_proc = CTQwen3VLProcessor.from_pretrained(sft_ckpt)
    tok = AutoTokenizer.from_pretrained(sft_ckpt)
    ids, stock, text = _image_inputs(tok, AutoImageProcessor.from_pretrained(sft_ckpt, backend="pil"), frames)
    ours = ours_proc(text=[text], images=[Image.fromarray(f).convert("RGB") for f in frames], return_tensors="pt")
    assert ours["input_ids"][0].tolist() == ids
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 4 * 4  # 4 images x (4x4 patches / 2x2 merge)
    assert ours["image_grid_thw"].tolist() == stock["image_grid_thw"].tolist() == [[1, 4, 4]] * 4
    assert torch.allclose(ours["pixel_values"], stock["pixel_values"], atol=1e-6, rtol=0)


def test_video_placeholder_layout(sft_ckpt, frames):
    """(b) Our video layout, pinned: the reference/vLLM layout (no outer wrapper), timestamps at fps = 1."""
    proc = CTQwen3VLProcessor.from_pretrained(sft_ckpt)
    text = render_prompt_text(proc, PROMPT)
    assert text.count(VIDEO_TRIPLE) == 1
    ids = proc(text=[text], videos=[frames])["input_ids"][0]
    block = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    expected = text.replace(VIDEO_TRIPLE, f"<0.5 seconds>{block}<2.5 seconds>{block}")
    assert ids == proc.tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert ids.count(proc.video_token_id) == 8 and ids.count(proc.vision_start_token_id) == 2


# ---- the real stock processor, in a subprocess where torchvision is importable ---------------------------------


def _torchvision_dir() -> Path:
    """PyPI torchvision in the side folder `make test` fills (never the venv); a missing folder fails, naming the fix."""
    if problem := torchvision_side.missing():
        pytest.fail(problem)
    return torchvision_side.DIR


@pytest.fixture(scope="module")
def stock(sft_ckpt, frames, tmp_path_factory):
    """The stock `AutoProcessor`'s encodings (tests/train/hf_reference.py) of `frames`."""
    out = tmp_path_factory.mktemp("hf_reference")
    np.save(out / "frames.npy", frames)
    env = {**os.environ, "PYTHONPATH": str(_torchvision_dir())}  # no project code on the path
    cmd = [sys.executable, str(REPO / "tests/train/hf_reference.py"), str(sft_ckpt), str(out / "frames.npy"), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(out / "reference.npz"), _json(out / "reference.json"), out / "resaved"


@pytest.mark.side_env  # torchvision (.cache/torchvision)
def test_stock_auto_processor_is_qwen3_vl_with_video_processor(stock):
    _, info, _ = stock
    assert (info["processor"], info["image_processor"], info["video_processor"]) == (
        "Qwen3VLProcessor",
        "Qwen2VLImageProcessor",
        "Qwen3VLVideoProcessor",
    )


@pytest.mark.side_env  # torchvision (.cache/torchvision)
def test_written_forms_equal_transformers(stock, sft_ckpt):
    """Our hand-written dicts have the real classes' key sets; a stock re-save reproduces our files byte for byte."""
    _, info, resaved = stock
    assert info["default_video_keys"] == sorted(BASE_VIDEO_PROCESSOR)
    assert info["default_image_keys"] == sorted(BASE_IMAGE_PROCESSOR)
    assert (resaved / "processor_config.json").read_text() == (sft_ckpt / "processor_config.json").read_text()
    assert (resaved / "chat_template.jinja").read_text() == (sft_ckpt / "chat_template.jinja").read_text()
    load_only = {"is_local", "local_files_only"}  # what a stock load adds to the tokenizer's init kwargs
    resaved_tok = {k: v for k, v in _json(resaved / "tokenizer_config.json").items() if k not in load_only}
    assert resaved_tok == _json(sft_ckpt / "tokenizer_config.json")


@pytest.mark.side_env  # torchvision (.cache/torchvision)
def test_video_path_equals_stock_video_processor(stock, sft_ckpt, frames):
    """(b) encode_ct_video vs the stock Qwen3VLVideoProcessor with the saved settings and video_metadata fps = 1.

    Same pixels (within 1e-6), same grid, same token ids once the outer `<|vision_start|>…<|vision_end|>` that
    transformers 5.x keeps around the expanded video is accounted for (`docs/training.md`, serving).
    """
    ref, info, _ = stock
    proc = CTQwen3VLProcessor.from_pretrained(sft_ckpt)
    pixels, grid, placeholder = encode_ct_video(frames)
    assert grid.tolist() == ref["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert np.abs(pixels.numpy() - ref["pixel_values_videos"]).max() <= 1e-6
    text = render_prompt_text(proc, PROMPT)
    assert info["video_text"] == text  # the same chat template renders the same prompt
    ours = proc(text=[text], videos=[frames])["input_ids"][0]
    wrap = ("<|vision_start|>", "<|vision_end|>")
    stock_form = text.replace(VIDEO_TRIPLE, wrap[0] + placeholder + wrap[1])
    assert ref["video_input_ids"].tolist() == proc.tokenizer(stock_form, add_special_tokens=False)["input_ids"]
    stock_ids = ref["video_input_ids"].tolist()
    start = stock_ids.index(proc.vision_start_token_id)  # the outer wrapper: first start, last end
    end = len(stock_ids) - 1 - stock_ids[::-1].index(proc.vision_end_token_id)
    assert stock_ids[:start] + stock_ids[start + 1 : end] + stock_ids[end + 1 :] == ours
    # Without video_metadata the stock processor assumes fps = 24: timestamps <0.0 seconds>, <0.1 seconds>.
    at_24 = text.replace(VIDEO_TRIPLE, wrap[0] + video_placeholder(2, 4, fps=24.0) + wrap[1])
    assert ref["video_nometa_input_ids"].tolist() == proc.tokenizer(at_24, add_special_tokens=False)["input_ids"]


@pytest.mark.side_env  # torchvision (.cache/torchvision)
def test_image_path_equals_stock_processor(stock, sft_ckpt, frames):
    """(a) through the real AutoProcessor (torchvision image processor, as a GPU server loads it)."""
    ref, info, _ = stock
    proc = CTQwen3VLProcessor.from_pretrained(sft_ckpt)
    ours = proc(
        text=[info["image_text"]], images=[Image.fromarray(f).convert("RGB") for f in frames], return_tensors="pt"
    )
    assert ours["input_ids"][0].tolist() == ref["image_input_ids"].tolist()
    assert ours["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
    assert np.abs(ours["pixel_values"].numpy() - ref["pixel_values"]).max() <= 1e-6


# ---- upgrade path -----------------------------------------------------------------------------------------------


def _write_old_form(ckpt: Path) -> None:
    """Turn a standard checkpoint into the pre-issue-15 form (what `train/` saved before)."""
    image = _json(ckpt / "processor_config.json")["image_processor"]
    (ckpt / "processor_config.json").write_text(
        json.dumps({"image_processor": image, "processor_class": "CTQwen3VLProcessor"}, indent=2, sort_keys=True)
        + "\n"
    )
    tok = _json(ckpt / "tokenizer_config.json")
    tok["processor_class"] = "CTQwen3VLProcessor"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")
    (ckpt / "preprocessor_config.json").unlink()
    (ckpt / "video_preprocessor_config.json").unlink()


def test_upgrade_rewrites_old_checkpoint_in_place(sft_ckpt, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(sft_ckpt, old)
    _write_old_form(old)
    assert upgrade_main([str(old)]) == 0
    assert "rewrote processor_config.json, preprocessor_config.json, video_preprocessor_config.json, " in (
        capsys.readouterr().out
    )
    assert_standard(old)
    for name in PROCESSOR_FILES:  # identical to a fresh save
        assert (old / name).read_text() == (sft_ckpt / name).read_text(), name
    assert (old / "model.safetensors").read_bytes() == (sft_ckpt / "model.safetensors").read_bytes()
    assert upgrade_main([str(old)]) == 0  # idempotent
    assert capsys.readouterr().out == f"{old}: already standard\n"
    CTQwen3VLProcessor.from_pretrained(old)


def test_upgrade_refuses_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert upgrade_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path} is not a checkpoint: no config.json.\n"
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert upgrade_main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err == f"error: {tmp_path} is not a Qwen3-VL checkpoint: config.json model_type='llama'.\n"
    )
    (tmp_path / "config.json").write_text("{not json")
    assert upgrade_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'config.json'} is not valid JSON (")
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl"}')
    assert upgrade_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path} is not a checkpoint: no tokenizer_config.json.\n"
    assert upgrade_main([str(tmp_path / "notes.txt")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'notes.txt'} is not a directory.\n"


def test_emrl_upgrade_checkpoint(sft_ckpt, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(sft_ckpt, old)
    _write_old_form(old)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "upgrade-checkpoint", str(old)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert_standard(old)
    bad = subprocess.run(
        [sys.executable, "-m", "cli.main", "upgrade-checkpoint", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"error: {tmp_path} is not a checkpoint: no config.json."]


_DEVICE_STEP = """
import json, sys
from pathlib import Path
import numpy as np
import torch
lib = torch.library.Library("torchvision", "DEF")  # the schemas PyPI torchvision checks at import (hf_reference.py)
lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import torchvision
from train.tools.device_check import auto_processor_check
from train.tiny.model import build_config, build_processor
p = build_processor()
n, px = int(sys.argv[2]), int(sys.argv[3])
frames = np.random.default_rng(0).integers(0, 256, (n, px, px), dtype=np.uint8)
print(json.dumps(auto_processor_check(p, build_config(p.tokenizer), Path(sys.argv[1]), frames)))
"""


@pytest.mark.side_env  # torchvision (.cache/torchvision)
@pytest.mark.parametrize(("n", "px", "grid"), [(5, 64, [3, 4, 4]), (4, 70, [2, 4, 4])])
def test_device_check_auto_processor_step(tmp_path, n, px, grid):
    """The device check's AutoProcessor step (it runs on the GPU machine), here with torchvision in a subprocess.

    5 frames: the odd frame is repeated as the stock processor does; 70 px: resized to 64 exactly as torchvision does.
    """
    env = {**os.environ, "PYTHONPATH": f"{_torchvision_dir()}{os.pathsep}{REPO}"}
    done = subprocess.run(
        [sys.executable, "-c", _DEVICE_STEP, str(tmp_path), str(n), str(px)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["processor"], result["video_processor"]) == ("Qwen3VLProcessor", "Qwen3VLVideoProcessor")
    assert result["video_grid_thw"] == grid
    assert result["video_pixels_max_abs_diff"] <= 1e-6
    assert _json(tmp_path / "checkpoint" / "processor_config.json")["processor_class"] == "Qwen3VLProcessor"
